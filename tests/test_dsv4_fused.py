"""DeepSeek-V4's decode step in fewer kernels (issue 51).

Pure path: every fused or rewritten piece gives the bits of the unfused ops it replaced, which
are written out here as the model computed them before (reference functions, `old_*`). Kernel
path: the demo bundle decodes through the emulated Metal kernels (one hc_pre and one hc_post
launch per hyper-connection, one routing launch per MoE layer) close to the pure path. Counts:
the GPU-basis kernels of the pieces, as `bench --dispatches` counts them.
"""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import tools
from metal_emu import emulator

from bitnest_mlx import kernels
from bitnest_mlx.layers import dsv4_hc, dsv4_route
from bitnest_mlx.layers.dsv4_ops import PartialRoPE, swiglu_clamped
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement import dispatch_graph as dg
from bitnest_mlx.runtime.demo import demo_bundle_path
from bitnest_mlx.runtime.loader import load_model

needs_cxx = tools.needs(emulator.cxx(), why="the Metal emulator compiles kernels with it")
SHAPE = dsv4_hc.HCShape(hc=4, iters=20, hc_eps=1e-6, norm_eps=1e-6)


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and np.array_equal(
        np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    )


# ---------------------------------------------------------------- the unfused reference


def old_sinkhorn(logits, iters, eps):
    c = mx.softmax(logits, axis=-1, precise=True) + eps
    c = c / (c.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(axis=-1, keepdims=True) + eps)
        c = c / (c.sum(axis=-2, keepdims=True) + eps)
    return c


def old_mix(streams, fn, eps):
    flat = streams.reshape(*streams.shape[:2], -1).astype(mx.float32)
    return mx.fast.rms_norm(flat, None, eps) @ fn.T


def old_pre(streams, fn, scale, base, s):
    hc = s.hc
    m = old_mix(streams, fn, s.norm_eps)
    pre = mx.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + s.hc_eps
    post = 2 * mx.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).reshape(*m.shape[:2], hc, hc)
    x = (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
    return x, post, old_sinkhorn(comb, s.iters, s.hc_eps)


def old_post(y, streams, post, comb):
    mixed = comb.swapaxes(-1, -2) @ streams.astype(mx.float32)
    return (post[..., None] * y[:, :, None].astype(mx.float32) + mixed).astype(streams.dtype)


def old_route(logits, top_k, route_scale, bias=None, table=None, ids=None):
    scores = mx.sqrt(nn.softplus(logits))
    if table is not None:
        idx = table[ids].astype(mx.uint32)
    else:
        idx = mx.argpartition(-(scores + bias), top_k - 1, axis=-1)[..., :top_k]
    w = mx.take_along_axis(scores, idx, axis=-1)
    return idx, w / w.sum(axis=-1, keepdims=True) * route_scale


# ---------------------------------------------------------------- pure path: the same bits


@pytest.mark.parametrize("hc,iters", [(4, 20), (4, 1), (2, 3)])
def test_sinkhorn_as_one_kernel_an_iteration_gives_the_unfused_bits(hc, iters):
    for seed, spread in ((0, 1.0), (1, 30.0)):
        logits = mx.random.normal((2, 3, hc, hc), key=mx.random.key(seed)) * spread
        assert same(dsv4_hc.sinkhorn(logits, iters, 1e-6), old_sinkhorn(logits, iters, 1e-6))


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
@pytest.mark.parametrize("d", [64, 4096])
def test_hyper_connection_pre_post_and_head_give_the_unfused_bits(dtype, d):
    streams, fn, scale, base = dsv4_hc.site(mx.random.key(d), d, SHAPE, dtype, tokens=3)
    got = dsv4_hc.pure_before(streams, fn, scale, base, SHAPE)
    want = old_pre(streams, fn, scale, base, SHAPE)
    assert all(same(g, w) for g, w in zip(got, want))
    y = mx.random.normal((1, 3, d), key=mx.random.key(1)).astype(dtype)
    assert same(dsv4_hc.pure_after(y, streams, *want[1:]), old_post(y, streams, *want[1:]))
    head_fn, head_base = fn[:4], base[:4]
    m = old_mix(streams, head_fn, SHAPE.norm_eps)
    pre = mx.sigmoid(m * scale[:1] + head_base) + SHAPE.hc_eps
    old_head = (pre[..., None] * streams).sum(axis=2).astype(streams.dtype)
    got_head = dsv4_hc.head(streams, head_fn, scale[:1], head_base, SHAPE.hc_eps, SHAPE.norm_eps)
    assert same(got_head, old_head)


@pytest.mark.parametrize("k,experts", [(4, 16), (6, 256)])
def test_routing_gives_the_unfused_experts_and_weights(k, experts):
    keys = mx.random.split(mx.random.key(k), 4)
    logits = mx.random.normal((1, 5, experts), key=keys[0]) * 3
    bias = mx.random.normal((experts,), key=keys[1])
    table = mx.random.randint(0, experts, (32, k), key=keys[2]).astype(mx.int32)
    ids = mx.random.randint(0, 32, (1, 5), key=keys[3]).astype(mx.uint32)
    for kw in ({"bias": bias}, {"table": table, "ids": ids}):
        got, want = dsv4_route.pure_route(logits, k, 1.5, **kw), old_route(logits, k, 1.5, **kw)
        assert all(same(g, w) for g, w in zip(got, want))


def test_one_rope_over_the_whole_head_rotates_the_rope_channels_only():
    yarn = {"factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32.0}
    rope = PartialRoPE(32, 160000.0, yarn)
    x = (mx.random.normal((1, 4, 5, 96), key=mx.random.key(2)) * 3).astype(mx.float16)
    for inverse in (False, True):
        for scale in (1.0, 4.0):
            got = rope(x, offset=7, scale=scale, inverse=inverse)
            rot = rope.rope(x[..., -32:], offset=7, scale=scale, inverse=inverse)
            assert same(got, mx.concatenate([x[..., :-32], rot], axis=-1))


def test_swiglu_with_the_route_weight_is_one_kernel_of_the_same_bits():
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    g, u = mx.random.normal((2, 3, 64), key=k1) * 4, mx.random.normal((2, 3, 64), key=k2) * 4
    w = mx.random.uniform(shape=(2, 3, 1), key=k3)
    want = nn.silu(mx.minimum(g, 1.5)) * mx.clip(u, -1.5, 1.5) * w
    assert same(swiglu_clamped(g, u, 1.5, w), want)
    assert dg.count([swiglu_clamped(g, u, 1.5, w)]) == 1


def test_the_demo_bundle_decodes_to_the_same_bits_compiled_or_not():
    """The fused pure path against its own functions run op by op (mx.disable_compile): fusing
    changes no bit of the logits (the rewrites themselves are checked above)."""
    model = load_model(demo_bundle_path(), dtype=mx.float16)
    tokens = np.random.default_rng(1).integers(2, 256, 16)

    def decode():
        cache, o = model.make_cache(), RunOptions(use_kernels=False)
        out = [model(mx.array(tokens[:12])[None], cache, options=o)]
        out += [model(mx.array(tokens[i : i + 1])[None], cache, options=o) for i in range(12, 16)]
        return mx.concatenate(out, axis=1)

    fused = decode()
    mx.eval(fused)
    mx.disable_compile()
    try:
        unfused = decode()
        mx.eval(unfused)
    finally:
        mx.enable_compile()
    assert same(fused, unfused)


# ---------------------------------------------------------------- kernel path (emulated Metal)


@needs_cxx
def test_the_demo_bundle_decodes_through_the_kernels_close_to_the_pure_path(monkeypatch):
    model = load_model(demo_bundle_path(), dtype=mx.float32)
    tokens = np.random.default_rng(2).integers(2, 256, 12)
    launches: list[kernels.Launch] = []

    def logits(use_kernels: bool) -> tuple[mx.array, list[int]]:
        cache, o = model.make_cache(), RunOptions(use_kernels=use_kernels)
        out = [model(mx.array(tokens[:10])[None], cache, options=o)]
        per_step = []
        for i in (10, 11):
            launches.clear()
            out.append(model(mx.array(tokens[i : i + 1])[None], cache, options=o))
            mx.eval(out[-1])
            per_step.append([la.spec.name for la in launches])
        return mx.concatenate(out, axis=1), per_step

    want, _ = logits(False)

    def run(launch, verbose=False):
        launches.append(launch)
        return emulator.run(launch)

    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels.launch, "metal_runner", run)
    monkeypatch.setattr(kernels.dispatch, "_state", kernels.dispatch._State())
    got, steps = logits(True)
    layers = model.args.num_hidden_layers
    for names in steps:
        assert names.count(kernels.HC_PRE.name) == 2 * layers
        assert names.count(kernels.HC_POST.name) == 2 * layers
        assert names.count(kernels.MOE_ROUTE.name) == layers
    err = float(mx.abs(got - want).max())
    assert err < 1e-4 * max(1.0, float(mx.abs(want).max())), err


# ---------------------------------------------------------------- kernels on the GPU basis


def _count(fn, *args) -> int:
    """GPU-basis kernels of a call after a first, uncounted one (as `bench --dispatches`: the
    constants made once per process are made there)."""
    with mock.patch.object(kernels, "use", lambda name, test: True):
        with dg.gpu_basis():
            mx.eval(fn(*args))
        with dg.gpu_basis() as ledger:
            out = fn(*args)
            return dg.count(dg.arrays_in(out)) + ledger.launched


@pytest.mark.parametrize("use_kernels,want", [(True, 3), (False, 27)])
def test_a_hyper_connection_pre_is_3_kernels_or_27_on_the_pure_path(use_kernels, want):
    """Kernel path: the float32 streams, their mix matmul, one launch (gates, Sinkhorn, the
    weighted sum, the sublayer's RMSNorm). Pure: those two, the RMS norm, the gates, the
    softmax, 20 Sinkhorn kernels, the weighted sum and the sublayer's norm."""
    streams, fn, scale, base = dsv4_hc.site(mx.random.key(0), 64, SHAPE, mx.float16, 1)
    norm = nn.RMSNorm(64)
    mx.eval(streams, fn, scale, base, norm.parameters())
    assert _count(dsv4_hc.before, streams, fn, scale, base, SHAPE, norm, use_kernels) == want


@pytest.mark.parametrize("use_kernels,want", [(True, 1), (False, 3)])
def test_a_hyper_connection_post_is_1_kernel_or_3_on_the_pure_path(use_kernels, want):
    streams, fn, scale, base = dsv4_hc.site(mx.random.key(0), 64, SHAPE, mx.float16, 1)
    _, post, comb = dsv4_hc.pure_before(streams, fn, scale, base, SHAPE)
    y = streams[:, :, 0]
    mx.eval(streams, post, comb, y)
    assert _count(dsv4_hc.after, y, streams, post, comb, use_kernels) == want


@pytest.mark.parametrize("use_kernels,want", [(True, 1), (False, 4)])
def test_routing_after_the_gate_matmul_is_1_kernel_or_4_on_the_pure_path(use_kernels, want):
    logits, bias = mx.random.normal((1, 1, 16)), mx.random.normal((16,))
    mx.eval(logits, bias)
    assert _count(dsv4_route.route, logits, 4, 1.5, bias, None, None, use_kernels) == want
