"""Self-speculative decoding: greedy parity, lossless sampling, exact rollback, API, controller."""

import math

import mlx.core as mx
import numpy as np
import pytest
from factory import differing_pair, tiny_package
from mlx_lm.generate import GenerationResponse, generate_step
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

import bitnest_mlx
from bitnest_mlx.runtime.demo import demo_path
from bitnest_mlx.runtime.draft_control import DraftController
from bitnest_mlx.runtime.rounds import commit, draft, verify
from bitnest_mlx.runtime.sampling import speculative_sample
from bitnest_mlx.runtime.speculative import (
    Sampler,
    SpeculativeStats,
    make_sampler,
    speculative_generate_step,
)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square goodness of fit; bins expecting < 5 are pooled, a draw in a bin of
    probability 0 gives 0. The p-value uses the Wilson-Hilferty normal approximation (accurate
    to ~1e-3 here; no scipy needed)."""
    if counts[probs == 0].any():
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    stat = float(((counts - expected) ** 2 / expected).sum())
    k = len(counts) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def tokens_of(gen) -> list[int]:
    return [t for t, *_ in gen]


# --------------------------------------------------------------------------------------------
# Greedy: token-for-token equal to target-only decoding


@pytest.fixture(scope="module")
def parity_cases(tmp_path_factory):
    """5 seeded packages x 3 prompts with mlx-lm's own target-only greedy output (64 tokens)."""
    cases = []
    for seed in range(5):
        layers = 2 if seed == 4 else 1
        model = tiny_package(tmp_path_factory.mktemp(f"p{seed}"), seed, layers=layers)
        rng = np.random.default_rng(100 + seed)
        for length in (1, 5, 17):
            prompt = mx.array(rng.integers(0, 300, length), dtype=mx.uint32)
            ref = [t for t, _ in generate_step(prompt, model, max_tokens=64)]
            cases.append((model, prompt, ref))
    return cases


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_greedy_speculative_output_equals_target_only_greedy(parity_cases, gamma):
    stats = SpeculativeStats()
    for model, prompt, ref in parity_cases:
        out = speculative_generate_step(
            prompt,
            model,
            max_tokens=64,
            num_draft_tokens=gamma,
            adaptive=False,
            fallback=False,
            stats=stats,
        )
        assert tokens_of(out) == ref
    # The packages make the draft usually right but not always: both paths were exercised.
    assert 0.3 < stats.acceptance_rate < 0.98, stats
    assert stats.target_steps <= len(parity_cases)  # only the last token of a run, if any


@pytest.mark.parametrize("group", [64, 32])
def test_greedy_speculative_equals_target_only_at_smaller_weight_groups(tmp_path, group):
    """Packages with one weight scale per 64 or 32 columns: the draft (W4) and target (W8)
    readings of the same planes still give target-only greedy output, and drafts get rejected."""
    model = tiny_package(tmp_path / "m", seed=5, group_size=group)
    assert model.args.group_size == group and model.lm_head.group_size == group
    prompt = mx.array(np.random.default_rng(group).integers(0, 300, 5), dtype=mx.uint32)
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=32)]
    stats = SpeculativeStats()
    out = speculative_generate_step(
        prompt,
        model,
        max_tokens=32,
        num_draft_tokens=3,
        adaptive=False,
        fallback=False,
        stats=stats,
    )
    assert tokens_of(out) == ref
    assert stats.rounds > 0 and stats.accepted < stats.drafted


# --------------------------------------------------------------------------------------------
# Rollback: the shared cache after any (draft, verify, accept a, trim) equals a fresh prefill


def test_rollback_leaves_cache_identical_to_fresh_target_prefill(tmp_path):
    model = tiny_package(tmp_path / "m", seed=7, layers=2)
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 300, 20).tolist()
    cache = model.make_cache()
    for c in cache:
        c.step = 8  # grow often, so rounds also cross growth boundaries
    model(mx.array(seq)[None], cache, "target")
    y = mx.array([int(rng.integers(300))], dtype=mx.uint32)
    draft_entries_differed = False
    for _ in range(14):
        gamma = int(rng.integers(0, 5))
        accepted = int(rng.integers(0, gamma + 1))
        drafts, _ = draft(model, cache, y, gamma, Sampler())
        if gamma:
            written = [c.state for c in cache]
            fresh = model.make_cache()
            model(mx.array(seq + [y.item()] + drafts.tolist()[:-1])[None], fresh, "target")
            draft_entries_differed |= any(
                not mx.array_equal(a, b) for w, f in zip(written, fresh) for a, b in zip(w, f.state)
            )
        verify(model, cache, y, drafts)
        commit(cache, gamma, accepted)
        seq += [y.item()] + drafts.tolist()[:accepted]
        fresh = model.make_cache()
        model(mx.array(seq)[None], fresh, "target")
        for c, f in zip(cache, fresh):
            assert c.offset == f.offset == len(seq)
            for a, b in zip(c.state, f.state):  # K, V: hi and lo planes (uint32), scales
                assert a.dtype == b.dtype and mx.array_equal(a, b)
        y = mx.array([int(rng.integers(300))], dtype=mx.uint32)
    # The draft's KV4-path writes really differ, so equality above proves they were replaced.
    assert draft_entries_differed


# --------------------------------------------------------------------------------------------
# Sampling: lossless rejection sampling


P_LOGITS = mx.array([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0], [0.0, 1.5, 0.3, 0.8, -1.0, 0.2]] * 2)
Q_LOGITS = mx.array([[0.5, 2.0, 0.0, 0.5, 0.5, -1.0], [1.0, 0.0, 0.3, 0.8, 0.0, 1.0]] * 2)


@pytest.mark.parametrize(
    "sampler",
    [make_sampler(1.0), make_sampler(0.7, top_p=0.9), make_sampler(1.3, min_p=0.1, top_k=4)],
    ids=["T1", "T0.7-top_p", "T1.3-min_p-top_k"],
)
def test_rejection_sampling_first_tokens_follow_target_not_draft(sampler):
    n_samples, gamma = 20_000, 3
    p = sampler.logprobs(P_LOGITS)  # rows 0..3: the target after y, d1, d2, d3 (fixed here)
    q = sampler.logprobs(Q_LOGITS[:gamma])
    drafts = mx.random.categorical(mx.broadcast_to(q, (n_samples, gamma, 6)))
    p_b = mx.broadcast_to(p, (n_samples, gamma + 1, 6))
    n, token = speculative_sample(drafts, mx.broadcast_to(q, drafts.shape + (6,)), p_b)
    n, token, drafts = np.array(n), np.array(token), np.array(drafts)
    first = np.where(n >= 1, drafts[:, 0], token)
    second = np.where(n >= 2, drafts[:, 1], token)[n >= 1]  # a round with n = 0 emits one token
    p_np, q_np = np.exp(np.array(p)), np.exp(np.array(q))
    assert chi2_pvalue(np.bincount(first, minlength=6), p_np[0]) > 0.01
    assert chi2_pvalue(np.bincount(second, minlength=6), p_np[1]) > 0.01
    assert chi2_pvalue(np.bincount(first, minlength=6), q_np[0]) < 1e-6
    # Acceptance is the optimal sum(min(p, q)), not mlx-lm's exact-match sum(p * q).
    assert abs((n >= 1).mean() - np.minimum(p_np[0], q_np[0]).sum()) < 0.015
    assert np.minimum(p_np[0], q_np[0]).sum() - (p_np[0] * q_np[0]).sum() > 0.1
    assert 0 < (n == 0).mean() and 0 < (n == gamma).mean()  # rejections and bonus tokens


def test_sampler_distribution_matches_mlx_lm_make_sampler():
    logits = mx.array([2.0, 1.0, 0.5, 0.2, 0.0, -0.5, -1.0, -3.0])
    ours = make_sampler(0.8, top_p=0.95, min_p=0.05, top_k=5)
    theirs = mlx_lm_make_sampler(0.8, top_p=0.95, min_p=0.05, top_k=5)
    lp = logits - mx.logsumexp(logits)
    draws = np.array(theirs(mx.broadcast_to(lp, (20_000, 8))))
    probs = np.exp(np.array(ours.logprobs(logits)))
    assert chi2_pvalue(np.bincount(draws, minlength=8), probs) > 0.01
    assert probs[5:].sum() == 0  # top-k 5 removed the rest in both


def test_greedy_sampler_is_exact_match_acceptance():
    p = Sampler().logprobs(P_LOGITS[:3])  # argmaxes 0, 1, 0
    q = Sampler().logprobs(Q_LOGITS[:2])
    n, token = speculative_sample(mx.array([0, 1]), q, p)
    assert (n.item(), token.item()) == (2, 0)  # both match: bonus = argmax of row 2
    n, token = speculative_sample(mx.array([0, 3]), q, p)
    assert (n.item(), token.item()) == (1, 1)  # second mismatches: the target's argmax


@pytest.mark.parametrize(
    "temp,seeded", [(1.0, False), (0.8, True)], ids=["rejection", "seeded-gumbel"]
)
def test_end_to_end_first_token_follows_target_distribution(tmp_path, temp, seeded):
    model, y, sampler, p, q = differing_pair(tmp_path / "v8", temp)
    counts, from_draft = np.zeros(8, dtype=int), 0
    for i in range(600):
        seed = {"seed": i} if seeded else {}  # seeded: one draw per seed, Gumbel coupling
        steps = speculative_generate_step(
            y, model, max_tokens=2, sampler=sampler, num_draft_tokens=1, adaptive=False, **seed
        )
        token, _, drafted = next(steps)
        counts[token] += 1
        from_draft += drafted
    assert chi2_pvalue(counts, p) > 0.01
    assert chi2_pvalue(counts, q) < 1e-6
    assert 150 < from_draft < 600


# --------------------------------------------------------------------------------------------
# Logits processors, the mlx-lm-like API and the draft-length controller


def test_logits_processors_match_mlx_lm_target_only(tmp_path):
    model = tiny_package(tmp_path / "m", seed=11)
    prompt = mx.array([1, 2, 3, 2, 1], dtype=mx.uint32)
    procs = make_logits_processors(logit_bias={7: 3.0}, repetition_penalty=1.5)
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=40, logits_processors=procs)]
    out = speculative_generate_step(
        prompt, model, max_tokens=40, logits_processors=procs, num_draft_tokens=3, fallback=False
    )
    assert tokens_of(out) == ref
    plain = [t for t, _ in generate_step(prompt, model, max_tokens=40)]
    assert plain != ref  # the processors changed the output


def test_stream_generate_api_on_demo_matches_target_only_text():
    model, tokenizer = bitnest_mlx.load(demo_path())
    stats = bitnest_mlx.SpeculativeStats()
    responses = list(
        bitnest_mlx.stream_generate(
            model, tokenizer, "The river", max_tokens=24, num_draft_tokens=3, stats=stats
        )
    )
    assert all(isinstance(r, GenerationResponse) for r in responses)
    assert len(responses) == 24 and responses[-1].finish_reason == "length"
    assert any(r.from_draft for r in responses) or stats.rounds == 0
    assert stats.generation_tokens == 24 and stats.generation_tps > 0
    model.mode = "target"
    target_only = mlx_lm_generate(model, tokenizer, "The river", max_tokens=24)
    assert "".join(r.text for r in responses) == target_only
    assert bitnest_mlx.generate(model, tokenizer, "The river", max_tokens=24) == target_only
    with pytest.raises(TypeError, match="make_sampler"):
        next(bitnest_mlx.stream_generate(model, tokenizer, "x", sampler=mlx_lm_make_sampler(0.5)))


def mlx_lm_generate(model, tokenizer, prompt, **kw):
    from mlx_lm.generate import generate

    return generate(model, tokenizer, prompt, **kw)


def test_api_generate_survives_importing_the_cli_module():
    import bitnest_mlx.cli.generate  # noqa: F401

    with pytest.raises(ImportError, match="bitnest_mlx.cli.generate"):
        import bitnest_mlx.generate  # noqa: F401  (would rebind the function to a module)
    model, tokenizer = bitnest_mlx.load(demo_path())
    assert bitnest_mlx.generate(model, tokenizer, "Hi", max_tokens=3, num_draft_tokens=0)


def _controller_after(fallback: bool, t_draft: float, t_row: float, t_fixed: float, alpha: float):
    """Feed a controller synthetic rounds: verify(k) = t_fixed + t_row (k + 1)."""
    c = DraftController(4, "model", fallback)
    rng = np.random.default_rng(0)
    for _ in range(40):
        plan = c.choose()
        g, acc = plan.gamma, 0
        while acc < g and rng.random() < alpha:
            acc += 1
        c.update(plan, acc, g * t_draft, t_fixed + t_row * (g + 1))
    return c


def test_controller_falls_back_when_verify_is_compute_bound_and_speculates_when_cheap():
    # CPU-like: each verified row costs a full step, the draft half of it -> target-only wins.
    cpu = _controller_after(True, t_draft=0.5, t_row=1.0, t_fixed=0.0, alpha=0.7)
    assert cpu.choose().gamma == 0
    # Forced speculation in the same conditions still drafts, but the shortest draft.
    forced = _controller_after(False, t_draft=0.5, t_row=1.0, t_fixed=0.0, alpha=0.7)
    assert forced.choose().gamma == 1
    # Bandwidth-bound: rows nearly free, cheap draft, high acceptance -> the maximum γ.
    gpu = _controller_after(True, t_draft=0.3, t_row=0.02, t_fixed=1.0, alpha=0.95)
    assert gpu.choose().gamma == 4
    assert 0.85 < gpu.alpha < 1.0


def test_num_draft_tokens_zero_is_target_only_and_not_a_fallback(parity_cases):
    model, prompt, ref = parity_cases[0]
    stats = SpeculativeStats()
    out = speculative_generate_step(prompt, model, max_tokens=64, num_draft_tokens=0, stats=stats)
    assert tokens_of(out) == ref
    assert stats.rounds == 0 and stats.target_steps == 64 and not stats.fallback


def test_parity_mode_verifies_row_by_row_with_the_same_output(parity_cases):
    model, prompt, ref = parity_cases[4]  # the 2-layer package
    stats = SpeculativeStats()
    out = speculative_generate_step(
        prompt, model, max_tokens=64, num_draft_tokens=3, fallback=False, parity=True, stats=stats
    )
    assert tokens_of(out) == ref and stats.rounds > 0 and stats.accepted < stats.drafted
