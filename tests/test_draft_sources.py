"""Draft sources beyond the W4 chain: n-gram copies from the context (prompt lookup), copies
extended by the W4 draft, the per-round plan, and the fallback when drafts cannot pay."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from factory import tiny_package
from mlx_lm.generate import generate_step
from test_speculative import P_LOGITS, chi2_pvalue, tokens_of

import bitnest_mlx
from bitnest_mlx.runtime.demo import demo_path
from bitnest_mlx.runtime.prompt_lookup import PromptLookup
from bitnest_mlx.runtime.rounds import commit, draft, point_mass, verify
from bitnest_mlx.runtime.sampling import make_sampler, speculative_sample
from bitnest_mlx.runtime.speculative import (
    Sampler,
    SpeculativeStats,
    speculative_generate_step,
)
from bitnest_mlx.runtime.speed_model import CostModel, rounds_speedup

SOURCES = ("ngram", "auto", "model")


def brute_force_lookup(tokens: list[int], limit: int, lo: int, hi: int) -> tuple[list[int], int]:
    """The longest n in hi..lo whose suffix occurred earlier with a continuation; the latest
    such occurrence's next `limit` tokens."""
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for j in range(len(tokens) - n - 1, -1, -1):
            if tokens[j : j + n] == suffix:
                return tokens[j + n : j + n + limit], n
    return [], 0


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (3, 3)])
def test_prompt_lookup_proposes_the_latest_continuation_of_the_longest_match(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    tokens = rng.integers(0, 4, 300).tolist()  # 4 symbols: matches of every length occur
    lookup = PromptLookup(tokens[:5], min_ngram=lo, max_ngram=hi)
    proposed = 0
    for i in range(5, len(tokens)):
        for limit in (1, 5):
            got = lookup.propose(limit)
            assert got == brute_force_lookup(tokens[:i], limit, lo, hi)
            proposed += bool(got[0])
        lookup.extend(tokens[i : i + 1])
    assert proposed > 100  # the comparison covered real proposals


def test_prompt_lookup_proposes_nothing_without_a_match_of_min_ngram():
    lookup = PromptLookup([1, 2, 3, 4, 1, 2], min_ngram=3)
    assert lookup.propose(4) == ([], 0)  # "1 2" occurred before, but only 2 tokens long
    lookup.extend([3])
    assert lookup.propose(4) == ([4, 1, 2, 3], 3)  # copies run up to the present


# --------------------------------------------------------------------------------------------
# Exactness: every source gives the target-only output


@pytest.fixture(scope="module")
def repeat_cases(tmp_path_factory):
    """3 packages x 2 prompts that repeat a random phrase (so copies are proposed), with
    mlx-lm's own target-only greedy output (48 tokens)."""
    cases = []
    for seed in range(3):
        model = tiny_package(tmp_path_factory.mktemp(f"r{seed}"), seed, layers=1 + seed % 2)
        rng = np.random.default_rng(200 + seed)
        for length in (6, 11):
            phrase = rng.integers(0, 300, length).tolist()
            prompt = mx.array(phrase * 3 + phrase[:2], dtype=mx.uint32)
            ref = [t for t, _ in generate_step(prompt, model, max_tokens=48)]
            cases.append((model, prompt, ref))
    return cases


@pytest.mark.parametrize("adaptive", [True, False])
@pytest.mark.parametrize("source", SOURCES)
def test_greedy_output_equals_target_only_for_every_draft_source(repeat_cases, source, adaptive):
    stats = SpeculativeStats()
    for model, prompt, ref in repeat_cases:
        steps = speculative_generate_step(
            prompt,
            model,
            max_tokens=48,
            draft_source=source,
            adaptive=adaptive,
            fallback=False,
            stats=stats,
            seed=0,  # fixed costs: the plans do not depend on this machine's timing
        )
        assert tokens_of(steps) == ref
    counts = list(stats.sources.values())
    assert sum(c["drafted"] for c in counts) == stats.drafted
    assert sum(c["accepted"] for c in counts) == stats.accepted
    if source != "model":  # copies were proposed, and both outcomes happened
        ngram = stats.sources["ngram"] if "ngram" in stats.sources else stats.sources["ngram+model"]
        assert 0 < ngram["accepted"] < ngram["drafted"]


@pytest.mark.parametrize("rule", ["gumbel", "rejection"])
@pytest.mark.parametrize("source", SOURCES)
def test_seeded_sampling_is_reproducible_and_gumbel_equals_target_only(repeat_cases, source, rule):
    sampler = make_sampler(0.7, top_p=0.95)
    for model, prompt, _ in repeat_cases[:3]:

        def run(num_draft_tokens=3, model=model, prompt=prompt):
            return tokens_of(
                speculative_generate_step(
                    prompt,
                    model,
                    max_tokens=40,
                    sampler=sampler,
                    seed=11,
                    rule=rule,
                    draft_source=source,
                    num_draft_tokens=num_draft_tokens,
                )
            )

        out = run()
        assert out == run()  # seeded: the same run twice
        if rule == "gumbel":
            assert out == run(num_draft_tokens=0)


def test_demo_greedy_and_seeded_equal_target_only_with_copies():
    model, tokenizer = bitnest_mlx.load(demo_path())
    text = "You may copy and distribute the Program. You may copy and distribute the"
    prompt = mx.array(tokenizer.encode(text), dtype=mx.uint32)
    for sampler in (Sampler(), make_sampler(0.7)):
        kw = dict(max_tokens=48, sampler=sampler, seed=2)
        ref = tokens_of(speculative_generate_step(prompt, model, num_draft_tokens=0, **kw))
        for source in ("ngram", "auto"):
            out = speculative_generate_step(prompt, model, draft_source=source, **kw)
            assert tokens_of(out) == ref


def test_copied_drafts_keep_rejection_sampling_lossless():
    """A copy is a draft drawn from a point mass: accepted with probability p(d), else the
    residual p without d. The first emitted token then follows p."""
    sampler = make_sampler(1.0)
    p = sampler.logprobs(P_LOGITS[:2])  # [2, 6]: the target rows at the copy and after it
    n_samples, d = 20000, 1
    drafts = mx.full((n_samples, 1), d, dtype=mx.uint32)
    q = mx.broadcast_to(point_mass([d], 6), (n_samples, 1, 6))
    n, token = speculative_sample(drafts, q, mx.broadcast_to(p, (n_samples, 2, 6)))
    first = np.where(np.array(n) > 0, d, np.array(token))
    probs = np.exp(np.array(p[0]))
    assert chi2_pvalue(np.bincount(first, minlength=6), probs) > 0.01
    assert np.mean(np.array(n)) == pytest.approx(probs[d], abs=0.015)


def test_rollback_after_copies_and_extended_copies_equals_fresh_target_prefill(tmp_path):
    model = tiny_package(tmp_path / "m", seed=7, layers=2)
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 300, 20).tolist()
    cache = model.make_cache()
    model(mx.array(seq)[None], cache, "target")
    y = mx.array([int(rng.integers(300))], dtype=mx.uint32)
    for _ in range(12):
        prefix = rng.integers(0, 300, int(rng.integers(1, 5))).tolist()
        steps = int(rng.integers(0, 3))
        drafts, q = draft(model, cache, y, steps, Sampler(), prefix=prefix)
        assert drafts.tolist()[: len(prefix)] == prefix and q.shape[0] == drafts.size
        gamma = drafts.size
        assert cache[0].offset == len(seq) + (gamma if steps else 0)
        accepted = int(rng.integers(0, gamma + 1))
        verify(model, cache, y, drafts, written=gamma if steps else 0)
        commit(cache, gamma, accepted)
        seq += [y.item()] + drafts.tolist()[:accepted]
        fresh = model.make_cache()
        model(mx.array(seq)[None], fresh, "target")
        for c, f in zip(cache, fresh):
            assert c.offset == f.offset == len(seq)
            for a, b in zip(c.state, f.state):
                assert a.dtype == b.dtype and mx.array_equal(a, b)
        y = mx.array([int(rng.integers(300))], dtype=mx.uint32)


# --------------------------------------------------------------------------------------------
# Never slower than target-only: the fallback with a useless draft


class UselessDraft:
    """A bitnest model whose draft proposes the token after the target's choice: never right."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, x, cache=None, mode=None, **kw):
        logits = self.model(x, cache, mode, **kw)
        return mx.roll(logits, 1, axis=-1) if mode == "draft" else logits


def test_controller_falls_back_when_the_draft_is_useless(repeat_cases):
    model, prompt, ref = repeat_cases[0]
    useless = UselessDraft(model)
    cost = CostModel(0.5, "M4 Max", "pure")

    def run(fallback: bool, source: str = "model") -> SpeculativeStats:
        stats = SpeculativeStats()
        steps = speculative_generate_step(
            prompt[:5],  # no repeats: copies are rare
            useless,
            max_tokens=64,
            draft_source=source,
            fallback=fallback,
            stats=stats,
            seed=0,
            cost_model=cost,
            draft_kv=4,
        )
        assert len(tokens_of(steps)) == 64
        return stats

    forced = run(fallback=False)
    assert forced.accepted == 0 and rounds_speedup(forced.round_log, cost) < 0.75
    chain = run(fallback=True)
    assert chain.fallback and chain.target_steps >= 56
    assert rounds_speedup(chain.round_log, cost) >= 0.95  # a few probe rounds at most
    # auto: the useless chain is dropped the same way; copies of the output's own loops pay.
    auto = run(fallback=True, source="auto")
    assert auto.fallback and auto.sources["model"]["rounds"] <= 4
    assert rounds_speedup(auto.round_log, cost) >= 0.95
