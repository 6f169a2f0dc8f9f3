"""Seeded runs: same seed + same arguments -> same tokens in every mode, whatever the timing.

The randomness of generated position i is `PositionNoise(seed)`'s; the default accept rule of a
seeded run is the Gumbel-max coupling, which makes speculative output equal target-only output
for that seed at any draft length; the draft-length controller ignores wall time when seeded.
"""

import json
import random
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from factory import tiny_package
from mlx_lm.generate import generate_step
from test_speculative import P_LOGITS, Q_LOGITS, chi2_pvalue, tokens_of

import bitnest_mlx
from bitnest_mlx.cli import generate
from bitnest_mlx.runtime.draft_control import DraftController
from bitnest_mlx.runtime.sampling import (
    ACCEPT,
    GUMBEL,
    RESAMPLE,
    PositionNoise,
    SeededSampler,
    gumbel_speculative_sample,
    speculative_sample,
)
from bitnest_mlx.runtime.speculative import (
    SpeculativeStats,
    make_sampler,
    speculative_generate_step,
)
from bitnest_mlx.runtime.speed_model import CostModel

TEMP = 0.8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_package(tmp_path_factory.mktemp("seeded"), seed=2, layers=2)


PROMPT = mx.array([5, 17, 3, 250, 9], dtype=mx.uint32)


def run(model, **kw) -> tuple[list[int], SpeculativeStats]:
    stats = SpeculativeStats()
    kw = {"max_tokens": 48, "sampler": make_sampler(TEMP), "seed": 1, **kw}
    return tokens_of(speculative_generate_step(PROMPT, model, stats=stats, **kw)), stats


# --------------------------------------------------------------------------------------------
# The noise


def test_position_noise_is_a_pure_function_of_seed_position_and_stream():
    noise = PositionNoise(7)
    rows = noise.gumbel(3, 4, 50)
    mx.random.seed(123)  # the global state plays no part
    mx.random.uniform(shape=(10,))
    assert mx.array_equal(noise.gumbel(5, 1, 50)[0], rows[2])  # independent of start / count
    assert mx.array_equal(PositionNoise(7).gumbel(3, 4, 50), rows)
    assert not mx.array_equal(PositionNoise(8).gumbel(3, 4, 50), rows)
    assert not mx.array_equal(noise.gumbel(3, 4, 50, RESAMPLE), rows)
    assert mx.array_equal(noise.uniform(2, 3, ACCEPT)[1:], noise.uniform(3, 2, ACCEPT))
    g = np.array(noise.gumbel(0, 200, 500)).ravel()
    assert np.isfinite(g).all()
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03  # Gumbel(0, 1)


# --------------------------------------------------------------------------------------------
# The Gumbel-max coupling is lossless: over seeds the tokens follow the target


def _noise_over_seeds(n_seeds: int, rows: int, vocab: int, stream: int = GUMBEL) -> mx.array:
    return mx.stack([PositionNoise(s).gumbel(0, rows, vocab, stream) for s in range(n_seeds)])


def test_gumbel_rule_first_tokens_follow_target_over_seeds():
    n_seeds, gamma, sampler = 6000, 3, make_sampler(TEMP)
    p = sampler.logprobs(P_LOGITS)  # rows: the target after y, d1, d2, d3 (fixed here)
    q = sampler.logprobs(Q_LOGITS[:gamma])
    g = _noise_over_seeds(n_seeds, gamma + 1, 6)
    drafts = mx.argmax(q + g[:, :gamma], axis=-1)  # the draft's Gumbel-max samples
    n, token = gumbel_speculative_sample(drafts, mx.broadcast_to(p, g.shape), g)
    n, token, drafts = np.array(n), np.array(token), np.array(drafts)
    first = np.where(n >= 1, drafts[:, 0], token)
    second = np.where(n >= 2, drafts[:, 1], token)[n >= 1]
    p_np, q_np = np.exp(np.array(p)), np.exp(np.array(q))
    assert chi2_pvalue(np.bincount(first, minlength=6), p_np[0]) > 0.01
    assert chi2_pvalue(np.bincount(second, minlength=6), p_np[1]) > 0.01
    assert chi2_pvalue(np.bincount(first, minlength=6), q_np[0]) < 1e-6
    # Every emitted token is the target's own Gumbel-max sample: target-only output.
    assert (first == np.array(mx.argmax(p[0] + g[:, 0], axis=-1))).all()
    # Acceptance: P(argmax(q + g) = argmax(p + g)), between (1-tv)/(1+tv) and sum(min(p, q)).
    accepted, tv = (n >= 1).mean(), 0.5 * np.abs(p_np[0] - q_np[0]).sum()
    assert (1 - tv) / (1 + tv) - 0.02 < accepted < (1 - tv) + 0.015
    assert 0 < (n == 0).mean() and 0 < (n == gamma).mean()


def test_seeded_rejection_rule_first_tokens_follow_target_over_seeds():
    n_seeds, gamma, sampler = 4000, 3, make_sampler(TEMP)
    p = sampler.logprobs(P_LOGITS)
    q = sampler.logprobs(Q_LOGITS[:gamma])
    g = _noise_over_seeds(n_seeds, gamma + 1, 6)
    resample = _noise_over_seeds(n_seeds, gamma, 6, RESAMPLE)
    u = mx.stack([PositionNoise(s).uniform(0, gamma) for s in range(n_seeds)])
    drafts = mx.argmax(q + g[:, :gamma], axis=-1)
    n, token = speculative_sample(
        drafts,
        mx.broadcast_to(q, drafts.shape + (6,)),
        mx.broadcast_to(p, g.shape),
        uniform=u,
        noise=mx.concatenate([resample, g[:, gamma:]], axis=1),
    )
    n, token, drafts = np.array(n), np.array(token), np.array(drafts)
    first = np.where(n >= 1, drafts[:, 0], token)
    p_np, q_np = np.exp(np.array(p)), np.exp(np.array(q))
    assert chi2_pvalue(np.bincount(first, minlength=6), p_np[0]) > 0.01
    assert chi2_pvalue(np.bincount(first, minlength=6), q_np[0]) < 1e-6
    assert abs((n >= 1).mean() - np.minimum(p_np[0], q_np[0]).sum()) < 0.02


# --------------------------------------------------------------------------------------------
# Reproducibility through the loop


@pytest.mark.parametrize("gamma", [1, 2, 3, 4])
def test_seeded_speculative_equals_target_only_at_every_draft_length(model, gamma):
    target_only, _ = run(model, num_draft_tokens=0)
    out, stats = run(model, num_draft_tokens=gamma, adaptive=False, fallback=False)
    assert out == target_only
    assert stats.rounds > 0 and 0 < stats.accepted < stats.drafted  # both paths exercised


def test_seeded_target_only_equals_mlx_lm_loop_with_seeded_sampler(model):
    """The same noise in mlx-lm's own loop (how the CLI runs the draft reading)."""
    target_only, _ = run(model, num_draft_tokens=0)
    model.mode = "target"
    sampler = SeededSampler(make_sampler(TEMP), 1)
    ref = [t for t, _ in generate_step(PROMPT, model, max_tokens=48, sampler=sampler)]
    assert ref == target_only


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
def test_same_seed_same_tokens_whatever_the_timing(model, rule, monkeypatch):
    def perturbed(seed):
        rng = random.Random(seed)
        monkeypatch.setattr(time, "perf_counter", lambda: rng.random() * 1e3)
        mx.random.seed(seed)  # and a different global random state
        return run(model, num_draft_tokens=4, rule=rule)  # adaptive, with fallback

    (a, sa), (b, sb) = perturbed(0), perturbed(1)
    assert a == b
    # γ did not follow the (random) clock: the same rounds, drafts and acceptances.
    assert (sa.rounds, sa.drafted, sa.accepted, sa.target_steps) == (
        sb.rounds,
        sb.drafted,
        sb.accepted,
        sb.target_steps,
    )
    assert sa.rounds > 0
    c, _ = run(model, num_draft_tokens=4, rule=rule, seed=2)
    assert c != a  # a different seed gives a different text


def test_the_clock_perturbation_does_move_an_unseeded_controller(model, monkeypatch):
    def perturbed(clock_seed):
        rng = random.Random(clock_seed)
        monkeypatch.setattr(time, "perf_counter", lambda: rng.random() * 1e3)
        mx.random.seed(0)
        _, s = run(model, num_draft_tokens=4, seed=None)
        return s.rounds, s.drafted, s.accepted, s.target_steps

    assert perturbed(0) != perturbed(1)  # so the test above would see a clock-driven γ


def test_rejection_rule_is_reproducible_per_draft_length_gumbel_is_independent_of_it(model):
    rej = {g: run(model, num_draft_tokens=g, adaptive=False, rule="rejection")[0] for g in (2, 3)}
    assert rej[2] == run(model, num_draft_tokens=2, adaptive=False, rule="rejection")[0]
    gum = {g: run(model, num_draft_tokens=g, adaptive=False)[0] for g in (2, 3)}
    assert gum[2] == gum[3]
    with pytest.raises(ValueError, match="rule"):
        run(model, rule="exact")


def test_greedy_is_unchanged_by_a_seed(model):
    greedy = tokens_of(speculative_generate_step(PROMPT, model, max_tokens=32))
    assert run(model, sampler=make_sampler(0.0), max_tokens=32, seed=5)[0] == greedy
    ref = [t for t, _ in generate_step(PROMPT, model, max_tokens=32)]
    assert greedy == ref


def test_fixed_cost_controller_ignores_measured_times():
    def choices(timer):
        c = DraftController(4, "model", True, cost=CostModel(0.5))
        rng, out = np.random.default_rng(0), []
        for _ in range(60):
            plan = c.choose()
            g, acc = plan.gamma, 0
            while acc < g and rng.random() < 0.9:
                acc += 1
            c.update(plan, acc, timer(), timer())
            out.append(g)
        return out

    rng = random.Random(0)
    assert choices(lambda: 1.0) == choices(lambda: rng.random() * 100)
    assert max(choices(lambda: 1.0)) >= 2  # high acceptance, cheap rows: it speculates


def test_api_stream_generate_and_generate_take_a_seed():
    from bitnest_mlx.runtime.demo import demo_path

    model, tokenizer = bitnest_mlx.load(demo_path())
    kw = {"max_tokens": 24, "sampler": bitnest_mlx.make_sampler(TEMP)}
    a = bitnest_mlx.generate(model, tokenizer, "The river", seed=3, **kw)
    b = "".join(
        r.text for r in bitnest_mlx.stream_generate(model, tokenizer, "The river", seed=3, **kw)
    )
    t = bitnest_mlx.generate(model, tokenizer, "The river", seed=3, num_draft_tokens=0, **kw)
    assert a == b == t
    assert bitnest_mlx.generate(model, tokenizer, "The river", seed=4, **kw) != a


# --------------------------------------------------------------------------------------------
# The CLI: run twice -> the same tokens, in each mode


def test_cli_seeded_runs_are_reproducible_in_every_mode(capsys):
    """Each mode twice, in one process (state left by a run must not leak into the next), and
    once more as its own `python -m` process (nothing else in the process decides the tokens)."""
    common = ["--temp", "0.8", "--seed", "1", "--max-tokens", "48", "--json"]
    runs = [(m, [*common, "--mode", m]) for m in ("speculative", "target", "draft") for _ in "ab"]
    runs.append(("other seed", [*common[:3], "2", *common[4:]]))
    fresh = subprocess.Popen(
        [sys.executable, "-m", "bitnest_mlx.generate", *runs[0][1]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out: dict[str, list[list[int]]] = {}
    for name, argv in runs:
        capsys.readouterr()
        assert generate.main(argv) == 0
        out.setdefault(name, []).append(json.loads(capsys.readouterr().out)["tokens"])
    stdout, stderr = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, stderr
    assert json.loads(stdout)["tokens"] == out["speculative"][0]
    for mode in ("speculative", "target", "draft"):
        first, second = out[mode]
        assert first == second and len(first) == 48, mode
    assert out["speculative"][0] == out["target"][0]  # same seed: the target-only sample
    # The draft reading is its own model (the demo's W4 and W8 samples for seed 1 part at token 28).
    assert out["draft"][0] != out["target"][0]
    assert out["other seed"][0] != out["speculative"][0]
