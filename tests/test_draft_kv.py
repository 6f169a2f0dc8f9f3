"""The draft's KV read at run time (RunOptions.draft_kv, --draft-kv 4|8|auto): KV8 changes what
the draft sees, never what speculative decoding emits; `auto` follows the bytes-per-token model."""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import numpy as np
import numpy_reference
import pytest
from factory import tiny_package
from mlx_lm.generate import generate_step
from numpy_reference import Reference, Trace
from test_model_parity import recording  # the runtime's quantizer inputs, for the reference

from bitnest_mlx.cli import generate
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement.roofline import roofline
from bitnest_mlx.runtime import rounds
from bitnest_mlx.runtime.draft_kv import (
    KV8_BUDGET,
    choose_draft_kv,
    kv8_context_limit,
    model_kv8_limit,
    resolve_draft_kv,
)
from bitnest_mlx.runtime.sampling import make_sampler
from bitnest_mlx.runtime.speculative import SpeculativeStats, speculative_generate_step

TOKENS = [3, 141, 59, 265, 35, 89, 7, 93, 12, 200]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = tmp_path_factory.mktemp("pkg")
    return tiny_package(path, seed=5, layers=2), path


def logits(model, options: RunOptions, tokens=TOKENS) -> np.ndarray:
    return np.array(model(mx.array([tokens]), options=options)[0]).astype(np.float64)


class KV8Sites(numpy_reference._Sites):
    """The reference's quantizer sites with every KV read as KV8, whatever the weights read."""

    def kv(self, x, group, draft):
        return super().kv(x, group, False)


def test_draft_kv8_is_w4_weights_over_kv8_values_per_the_numpy_reference(package, monkeypatch):
    model, path = package
    draft4 = logits(model, RunOptions("draft", draft_kv=4))
    trace = Trace()
    with recording(trace):
        draft8 = logits(model, RunOptions("draft", draft_kv=8))
    target = logits(model, RunOptions("target"))
    monkeypatch.setattr(numpy_reference, "_Sites", KV8Sites)
    expected = Reference.load(path).forward(TOKENS, draft=True, trace=trace)
    assert np.abs(draft8 - expected).max() <= 1e-4
    assert trace.adopted <= 1e-3 * trace.total
    # It is neither of the other readings: KV8 differs from KV4, W4 from W8.
    assert np.abs(draft8 - draft4).max() > 1e-2
    assert np.abs(draft8 - target).max() > 1e-2


def test_draft_kv_does_not_change_the_target_reading(package):
    model, _ = package
    a = logits(model, RunOptions("target", draft_kv=4))
    b = logits(model, RunOptions("target", draft_kv=8))
    assert np.array_equal(a, b)


def test_run_options_refuse_a_draft_kv_other_than_4_or_8():
    with pytest.raises(ValueError, match="draft_kv"):
        RunOptions(draft_kv=6)


@pytest.mark.parametrize("draft_kv", [4, 8, "auto"])
def test_greedy_speculative_output_equals_target_only_for_every_draft_kv(package, draft_kv):
    model, _ = package
    prompt = mx.array([5, 77, 130, 21, 9], dtype=mx.uint32)
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=40)]
    stats = SpeculativeStats()
    steps = speculative_generate_step(
        prompt,
        model,
        max_tokens=40,
        num_draft_tokens=3,
        adaptive=False,
        fallback=False,
        stats=stats,
        draft_kv=draft_kv,
    )
    assert [t for t, _, _ in steps] == ref
    assert stats.rounds > 0


def test_seeded_sampled_output_with_draft_kv8_equals_seeded_target_only(package):
    model, _ = package
    prompt = mx.array([5, 77, 130, 21, 9], dtype=mx.uint32)
    run = lambda gamma, kv: [
        t
        for t, _, _ in speculative_generate_step(
            prompt,
            model,
            max_tokens=30,
            sampler=make_sampler(0.8),
            num_draft_tokens=gamma,
            adaptive=False,
            fallback=False,
            seed=7,
            draft_kv=kv,
        )
    ]
    assert run(3, 8) == run(0, 4)


def test_auto_reads_kv8_up_to_the_context_where_it_adds_the_budget(package):
    model, _ = package
    r = roofline(model, context=0)
    weights = r["weight_bytes_per_token"]["draft"]
    kv4 = r["kv_bytes_per_context_token"]["draft"]
    kv8 = r["kv_bytes_per_context_token"]["target"]
    # By hand: (kv8 - kv4)·n <= 0.1·(weights + kv4·n)  <=>  n <= 0.1·weights / (kv8 - 1.1·kv4).
    limit = int(KV8_BUDGET * weights / (kv8 - kv4 - KV8_BUDGET * kv4))
    assert model_kv8_limit(model) == limit
    assert resolve_draft_kv("auto", model, 1) == 8
    assert resolve_draft_kv("auto", model, limit) == 8
    assert resolve_draft_kv("auto", model, limit + 1) == 4
    assert resolve_draft_kv("auto", model, 100 * limit) == 4
    assert resolve_draft_kv(4, model, 1) == 4 and resolve_draft_kv(8, model, 10**6) == 8
    # At the limit, reading KV8 costs the draft at most the budget more bytes per token.
    kv4_bytes = roofline(model, limit, 4)["bytes_per_token"]["draft"]
    kv8_bytes = roofline(model, limit, 8)["bytes_per_token"]["draft"]
    assert kv8_bytes - kv4_bytes <= KV8_BUDGET * kv4_bytes


def test_kv8_limit_is_none_when_the_budget_covers_any_context():
    # kv8 - kv4 = 10 <= 0.5 · kv4 = 50: the extra bytes never outgrow half the draft's.
    assert kv8_context_limit(1000, 100, 110, budget=0.5) is None
    assert choose_draft_kv(10**9, 1000, 100, 110, budget=0.5) == 8


def test_auto_decides_each_round_from_the_cache_length(package):
    model, _ = package
    limit = model_kv8_limit(model)
    seen = []
    real_draft = rounds.draft

    def spy(model_, cache, y, gamma, *args):
        seen.append((cache[0].offset + gamma, args[3].draft_kv))  # (sampler, history, procs, o)
        return real_draft(model_, cache, y, gamma, *args)

    prompt = mx.array(np.arange(limit - 8) % 250, dtype=mx.uint32)
    with mock.patch.object(rounds, "draft", spy):
        steps = speculative_generate_step(
            prompt,
            model,
            max_tokens=24,
            num_draft_tokens=2,
            adaptive=False,
            fallback=False,
            draft_source="model",  # the prompt repeats: copies would draft instead
        )
        for _ in steps:
            pass
    assert {kv for _, kv in seen} == {4, 8}  # the run crossed the limit
    assert all(kv == (8 if context <= limit else 4) for context, kv in seen)


def test_cli_refuses_an_unknown_draft_kv(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's refusal, before any model is loaded
        generate.main(["--draft-kv", "6"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: argument --draft-kv: must be 4, 8 or auto, got '6'"
    )
