"""DeepSeek-V4 speculates with n-gram copies through the bitnest loop (`draftless`): the output
is target-only decoding's, the cache rolls back exactly, the expert store keeps working, its
verify cost follows the expert union, and useless copies make the controller fall back.

The models are TINY_CONFIG's with random weights and an embedding scaled by 10, so each token's
own embedding dominates the residual streams: the next token depends mostly on the current one,
the greedy text falls into cycles, and copies from the context are sometimes right.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from factory import dsv4_model

from bitnest_mlx import load
from bitnest_mlx.cli import generate
from bitnest_mlx.formats import dsv4_bundle_write
from bitnest_mlx.runtime.demo import TINY_CONFIG, demo_bundle_path, random_weights
from bitnest_mlx.runtime.draftless import NoDraftError, bundle_cost
from bitnest_mlx.runtime.sampling import make_sampler
from bitnest_mlx.runtime.speculative import SpeculativeStats, speculative_generate_step
from bitnest_mlx.runtime.speed_model import DSV4_FLASH, rounds_speedup, verify_cost

TOKENS = 48
PHRASE = np.random.default_rng(5).integers(2, 256, 7).tolist()
PROMPT = mx.array(PHRASE * 3 + PHRASE[:2], dtype=mx.uint32)  # repeats: copies from round one


def cycling_weights(layers: int = 6) -> tuple[dict, dict[str, np.ndarray]]:
    config = dict(TINY_CONFIG, num_hidden_layers=layers)
    config["compress_ratios"] = TINY_CONFIG["compress_ratios"][:layers]
    weights = random_weights(config, seed=0)
    weights["embed.weight"] = weights["embed.weight"] * 10
    return config, weights


@pytest.fixture(scope="module")
def model():
    return dsv4_model(cycling_weights()[1])


def run(model, stats: SpeculativeStats | None = None, **kw) -> list[int]:
    kw = {"max_tokens": TOKENS, "seed": 0, **kw}
    return [t for t, _, _ in speculative_generate_step(PROMPT, model, stats=stats, **kw)]


def assert_copies_were_accepted_and_rejected(stats: SpeculativeStats) -> None:
    ngram = stats.sources["ngram"]
    assert set(stats.sources) == {"ngram"}  # a bundle has no W4 draft
    assert 0 < ngram["accepted"] < ngram["drafted"]


@pytest.mark.parametrize("source", ["ngram", "auto"])
def test_greedy_ngram_output_equals_target_only(model, source):
    ref = run(model, num_draft_tokens=0)
    stats = SpeculativeStats()
    assert run(model, stats, draft_source=source, fallback=False) == ref
    assert_copies_were_accepted_and_rejected(stats)


def test_seeded_sampling_with_copies_equals_target_only_for_the_seed(model):
    sampler = make_sampler(0.7)
    ref = run(model, num_draft_tokens=0, sampler=sampler, seed=11)
    stats = SpeculativeStats()
    out = run(model, stats, draft_source="ngram", sampler=sampler, seed=11, fallback=False)
    assert out == ref
    ngram = stats.sources["ngram"]
    assert ngram["drafted"] > ngram["accepted"]  # proposed, and rejected at least once


def test_model_drafts_are_refused_with_one_clear_error(model):
    with pytest.raises(NoDraftError, match="no draft plane.*--draft-source ngram"):
        run(model, draft_source="model")


def test_a_cache_that_cannot_roll_back_a_whole_copy_is_refused(model):
    with pytest.raises(ValueError, match=r"max_rollback=12"):
        run(model, prompt_cache=model.make_cache(max_rollback=8), ngram_tokens=12)
    # A cache that keeps enough history is used as given.
    assert run(model, prompt_cache=model.make_cache(max_rollback=12), ngram_tokens=12)


def test_expert_store_bundle_speculates_exactly(tmp_path):
    """MXTQ experts on disk behind a few-expert LRU: the same tokens as target-only, with the
    store evicting and re-reading experts across verify passes and rollbacks."""
    config, weights = cycling_weights(layers=3)  # hash layers and a ratio-4 layer
    path = dsv4_bundle_write.write(tmp_path / "b", config, weights, shards=1)
    model, _ = load(path, max_expert_memory=2e-5)
    ref = run(model, num_draft_tokens=0)
    stats = SpeculativeStats()
    assert run(model, stats, draft_source="ngram", fallback=False) == ref
    assert_copies_were_accepted_and_rejected(stats)
    assert model.expert_store.stats()["misses"] > 0


# --------------------------------------------------------------------------------------------
# The bundle's v(M), and the controller with useless copies


def test_bundle_verify_cost_adds_the_expert_union_to_the_dense_table():
    cost = bundle_cost()
    assert cost.verify(1) == pytest.approx(1.0)
    for m in range(2, 17):
        union = DSV4_FLASH.experts(m)
        assert DSV4_FLASH.experts(m - 1) < union <= min(m * DSV4_FLASH.top_k, 256)
        assert cost.verify(m) > verify_cost(m, cost.chip, "pure")  # the union costs extra
    assert DSV4_FLASH.experts(64) <= DSV4_FLASH.n_experts


class Walk:
    """A bundle whose target emits WALK(p) at position p whatever the context (a large logit
    added to the model's): the prompt below then holds every bigram of the output followed by
    a wrong token, so every round has a copy and no copy is ever right."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, x, cache):
        rows = cache[0].offset + mx.arange(x.shape[1]) + 1  # row i predicts position p + i + 1
        hot = mx.arange(self.args.vocab_size)[None] == walk(rows)[:, None]
        return self.model(x, cache) + 1e4 * hot


def walk(p):
    return (37 * p + 11) % 256


def test_useless_copies_make_the_controller_fall_back_to_target_steps(model):
    n = 40  # tokens generated; the prompt's triples cover positions 3(n - 2) + 2 .. on
    start = 3 * (n - 2)  # the prompt's length: generation starts at this position
    triples = [(walk(q - 2), walk(q - 1), walk(q) ^ 1) for q in range(start + 2, start + n)]
    prompt = mx.array([t for triple in triples for t in triple], dtype=mx.uint32)
    cost = bundle_cost()

    def go(fallback: bool) -> SpeculativeStats:
        stats = SpeculativeStats()
        steps = speculative_generate_step(
            prompt,
            Walk(model),
            max_tokens=n,
            draft_source="auto",
            fallback=fallback,
            stats=stats,
            seed=0,
        )
        assert [t for t, _, _ in steps] == [walk(start + i) for i in range(n)]
        return stats

    forced = go(fallback=False)
    assert forced.accepted == 0 and forced.rounds >= n - 3  # a copy almost every round, never right
    # By step time a rejected copy's extra verify row costs its bytes' v(M), not a step: Flash's
    # kernels are launched once a pass, and they are a good part of its step.
    assert rounds_speedup(forced.round_log, cost) < 0.93
    fell = go(fallback=True)
    # Copies while the prior decays: a copy that cheap pays from a low acceptance on.
    assert fell.fallback and fell.target_steps >= n // 2
    assert rounds_speedup(fell.round_log, cost) >= 0.95


# --------------------------------------------------------------------------------------------
# The generate CLI on a bundle


def test_generate_cli_speculates_on_a_bundle_with_copies_and_prints_them(capsys):
    bundle = str(demo_bundle_path())
    common = ["--model", bundle, "--prompt", "abcdabcdabcdab", "--ignore-chat-template"]
    common += ["--max-tokens", "24", "--temp", "0"]
    assert generate.main([*common, "--mode", "speculative", "--draft-source", "ngram"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("[speculative] ngram: "))
    assert "rounds" in line and "accepted" in line
    assert (
        generate.main([*common, "--mode", "speculative", "--draft-source", "ngram", "--json"]) == 0
    )
    spec = json.loads(capsys.readouterr().out)
    assert generate.main([*common, "--mode", "target", "--json"]) == 0
    target = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == target["tokens"] and spec["stats"]["sources"]["ngram"]["drafted"] > 0


def test_generate_cli_refuses_model_drafts_for_a_bundle_in_one_line(capsys):
    argv = ["--model", str(demo_bundle_path()), "--draft-source", "model", "--max-tokens", "2"]
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "no draft plane" in err and "\n" not in err
