"""A draft that skips layers (`RunOptions.draft_skip`): its skipped layers' residual passes
through, their caches advance unwritten, and the verify pass writes every layer, so the
speculative output stays target-only's."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from factory import tiny_package
from mlx_lm.generate import generate_step
from test_kernels import emulated_metal, needs_cxx

import bitnest_mlx
from bitnest_mlx import kernels
from bitnest_mlx.runtime.demo import demo_path
from bitnest_mlx.runtime.speculative import (
    SpeculativeStats,
    make_sampler,
    speculative_generate_step,
)


def _pure(model):
    model.options = replace(model.options, use_kernels=False)
    return model


@pytest.fixture(scope="module")
def demo():
    return _pure(bitnest_mlx.load(demo_path())[0])


def test_a_skipped_layer_passes_the_residual_and_advances_its_cache_unwritten(demo):
    prompt = mx.array([[3, 17, 42, 5]])
    cache = demo.make_cache()
    demo(prompt, cache)  # target prefill: every layer written
    before = [np.array(c.state[0]) for c in cache]
    o = replace(demo.options, mode="draft")
    full = demo(mx.array([[9]]), demo.make_cache(), options=o)
    skipped = demo(mx.array([[9]]), cache, options=replace(o, draft_skip=frozenset({1})))
    assert not np.allclose(np.array(full), np.array(skipped))  # the option changes the draft
    assert [c.offset for c in cache] == [5] * len(cache)  # every cache advanced
    # The skipped layer's stored positions are untouched (nothing written at position 4).
    assert np.array_equal(np.array(cache[1].keys[0][:, :, :4]), before[1])


@pytest.mark.parametrize("skip", [{1}, {0, 2}])
def test_greedy_speculation_with_a_layer_skipping_draft_equals_target_only(demo, skip):
    prompt = mx.array(np.random.default_rng(7).integers(0, 300, 6), dtype=mx.uint32)
    ref = [t for t, _ in generate_step(prompt, demo, max_tokens=48)]
    model = _pure(bitnest_mlx.load(demo_path())[0])
    model.options = replace(model.options, draft_skip=frozenset(skip))
    stats = SpeculativeStats()
    out = speculative_generate_step(
        prompt, model, max_tokens=48, num_draft_tokens=3, adaptive=False, fallback=False,
        stats=stats,
    )  # fmt: skip
    assert [t for t, *_ in out] == ref
    assert 0 < stats.accepted < stats.drafted  # drafts both accepted and rejected


def test_seeded_sampling_with_a_layer_skipping_draft_is_the_target_only_sample(tmp_path):
    """Seeded (the Gumbel coupling): the output is target-only's sample for the seed."""
    model = _pure(tiny_package(tmp_path / "m", seed=3, layers=2))
    prompt = mx.array([5, 9, 77], dtype=mx.uint32)

    def run(**kw):
        stats = SpeculativeStats()
        out = speculative_generate_step(
            prompt, model, max_tokens=32, sampler=make_sampler(0.7), seed=11, stats=stats, **kw
        )
        return [t for t, *_ in out], stats

    target_only, _ = run(num_draft_tokens=0)
    model.options = replace(model.options, draft_skip=frozenset({0}))
    out, stats = run(num_draft_tokens=3, adaptive=False, fallback=False)
    assert out == target_only
    assert 0 < stats.accepted < stats.drafted


@needs_cxx
def test_on_the_kernel_path_a_layer_skipping_draft_gives_target_only_greedy_output(
    tmp_path, monkeypatch
):
    """The same through the Metal kernels (emulated): the skip is above the kernels, the verify
    pass writes the skipped layers' KV with the write kernel. `parity`: the verify pass one
    token a call, the kernels of target-only decoding (a multi-row launch rounds differently
    from a one-row one, with or without a skip)."""
    model = tiny_package(tmp_path / "m", seed=4, layers=2)
    emulated_metal(monkeypatch)
    prompt = mx.array([5, 9, 77, 3], dtype=mx.uint32)
    ref = [t for t, _ in generate_step(prompt, model, max_tokens=10)]
    model.options = replace(model.options, draft_skip=frozenset({1}))
    stats = SpeculativeStats()
    out = speculative_generate_step(
        prompt, model, max_tokens=10, num_draft_tokens=2, adaptive=False, fallback=False,
        parity=True, stats=stats,
    )  # fmt: skip
    assert [t for t, *_ in out] == ref
    assert stats.drafted > 0
    assert kernels.dispatch._state.calls["dual_plane", "kernel"] > 0  # the kernels ran
