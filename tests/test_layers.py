"""Exact tests of the integer maps and the layers (docs/bitnest-package.md §2-§6), against
numpy written from the spec.

Codes are compared exactly (spec §6: packing, A8 and the KV rule are exact integer maps); float
outputs of float math (Hadamard, matmuls) with a tolerance.
"""

from __future__ import annotations

from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from numpy_reference import a8_codes, dequant, kv_codes, r4_matrix, unpack_codes

from bitnest_mlx.formats import bitnest
from bitnest_mlx.formats.bitnest import a8
from bitnest_mlx.formats.hadamard import hadamard_k, r4_transform
from bitnest_mlx.layers import dual_plane, plane_stack
from bitnest_mlx.layers.dual_plane import DualPlaneLinear, project, swiglu
from bitnest_mlx.layers.hadamard import OnlineHadamard
from bitnest_mlx.layers.nested_kv import NestedKVCache, nest_dequantize, nest_quantize
from bitnest_mlx.layers.options import RunOptions

F32 = np.float32


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def mlx_words_to_codes(words: mx.array) -> np.ndarray:
    """uint32 [..., D/8] MLX 4-bit words -> codes [..., D]; little-endian bytes are the package's
    nibble layout, so this goes through the independent numpy unpacker."""
    w = np.ascontiguousarray(np.array(words, dtype=np.uint32))
    return unpack_codes(w.view(np.uint8))


# ---------------------------------------------------------------------------------------------
# Plane packing


def test_nibble_layout_puts_even_column_in_low_nibble():
    u = np.array([[1, 2, 3, 4, 15, 0]], dtype=np.uint8)
    assert bitnest.pack_nibbles(u).tolist() == [[0x21, 0x43, 0x0F]]


def test_pack_unpack_round_trip_is_exact():
    u = rng().integers(0, 16, (7, 256), dtype=np.uint8)
    packed = bitnest.pack_nibbles(u)
    assert packed.shape == (7, 128) and packed.dtype == np.uint8
    assert np.array_equal(bitnest.unpack_nibbles(packed), u)
    assert np.array_equal(unpack_codes(packed), u)  # agrees with the independent unpacker
    every_byte = np.arange(256, dtype=np.uint8)[None]  # and pack is onto: all bytes come back
    assert np.array_equal(bitnest.pack_nibbles(bitnest.unpack_nibbles(every_byte)), every_byte)


def test_uint32_view_of_planes_is_mlx_affine_4bit_with_bias_minus_8s():
    """Spec §2: the uint8 [N, K/2] plane viewed as uint32 [N, K/8] is MLX's 4-bit packing, so
    mx.dequantize(view, s, -8 s) == (u - 8) s exactly."""
    n, k = 6, 384
    u = rng(1).integers(0, 16, (n, k), dtype=np.uint8)
    s = rng(2).uniform(0.01, 2.0, (n, k // 128)).astype(np.float16)
    words = mx.array(bitnest.pack_nibbles(u)).view(mx.uint32)
    assert words.shape == (n, k // 8)
    scales = mx.array(s).astype(mx.float32)
    got = mx.dequantize(words, scales, -8 * scales, group_size=128, bits=4)
    want = (u.astype(F32) - 8) * np.repeat(s.astype(F32), 128, axis=1)
    assert np.array_equal(np.array(got), want)
    # DualPlaneLinear.prepare hands the model exactly this view.
    tensors = {"x.hi": mx.array(bitnest.pack_nibbles(u)), "x.lo": mx.array(bitnest.pack_nibbles(u))}
    tensors["x.scales"] = mx.array(s)
    params = DualPlaneLinear.prepare(tensors, "x", mx.float32)
    assert np.array_equal(np.array(params["x.hi"]), np.array(words))
    assert np.array_equal(np.array(params["x.biases"]), -8 * np.array(params["x.scales"]))


# ---------------------------------------------------------------------------------------------
# Weight planes


def spec_lo_codes(w: np.ndarray, q4: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Spec §2: qr = clip(round((w - q4 s)/(s/16)), -8, 7), and qr >= 0 where q4 = -8, per
    group of K / s.shape[1] columns with the stored fp16 scale s (fp32 math)."""
    n, k = w.shape
    wg = w.astype(F32).reshape(n, s.shape[1], k // s.shape[1])
    sg = s.astype(F32)[..., None]
    q4g = q4.astype(F32).reshape(wg.shape)
    qr = np.clip(np.rint((wg - q4g * sg) / (sg / F32(16))), -8, 7)
    return np.where(q4g == -8, np.maximum(qr, 0), qr).reshape(n, k)


@pytest.mark.parametrize("group", bitnest.WEIGHT_GROUPS)
def test_quantize_planes_codes_follow_the_rtn_and_lo_formulas(group):
    w = rng(3).normal(0, 0.05, (8, 512)).astype(F32)
    w[0, :128] = 0  # an all-zero group: scale 1, codes 0
    w[1, 130] = 3.0  # an outlier group: most residuals in it are small codes
    planes = bitnest.quantize_planes(w, group)
    q4 = unpack_codes(planes.hi).astype(F32) - 8
    qr = unpack_codes(planes.lo).astype(F32) - 8
    s = planes.scales
    assert s.dtype == np.float16 and np.all(s > 0)
    assert s.shape == (8, 512 // group)
    wg = w.reshape(8, 512 // group, group)
    nonzero = np.abs(wg).max(-1) > 0
    # fp16 of the smallest scale whose W8 range [-8 s, 119/16 s] holds the group.
    want = np.maximum(wg.max(-1) * 16 / 119, -wg.min(-1) / 8)
    assert np.allclose(s[nonzero].astype(F32), want[nonzero], rtol=2**-11, atol=0)
    assert s[0, 0] == 1
    sg = np.repeat(s.astype(F32), group, axis=1)
    # hi = the hi nibble of the W8 RTN code; within s/32 of a midpoint that is not round(w/s).
    q8 = np.clip(np.rint(w / (sg / 16)), -128, 119)
    assert np.array_equal(q4, np.floor((q8 + 8) / 16))
    assert np.mean(q4 != np.rint(w / sg)) < 0.05
    assert np.array_equal(qr, spec_lo_codes(w, q4, s))
    assert np.all(16 * q4 + qr >= -128)
    # W8 is RTN on the s/16 grid: within half a step everywhere (fp16 scale rounding aside).
    w8 = bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=False)
    assert np.all(np.abs(w8 - w) <= sg / 32 * (1 + 1e-2))


def test_lo_plane_is_nonnegative_where_hi_code_is_minus_8():
    """RTN's scales keep w >= -8 s, but given hi codes and scales (GPTQ with clipped scales) can
    put w below -8 s with q4 = -8: there the residual is clipped at 0, not -8, so the int8 code
    16 q4 + qr stays >= -128."""
    w = rng(4).normal(0, 0.05, (4, 256)).astype(F32)
    amax = np.abs(w.reshape(4, 2, 128)).max(-1)
    scales = (amax / 14).astype(np.float16)  # half the RTN scale: the tails clip at -8 / 7
    sg = np.repeat(scales.astype(F32), 128, axis=1)
    q4 = np.clip(np.rint(w / sg), -8, 7)
    below = (q4 == -8) & (w < -8 * sg)  # raw residual negative: the rule must act here
    assert below.sum() >= 4
    planes = bitnest.planes_from_codes(w, codes=q4, scales=scales)
    got_q4 = unpack_codes(planes.hi).astype(F32) - 8
    qr = unpack_codes(planes.lo).astype(F32) - 8
    assert np.array_equal(got_q4, q4) and np.array_equal(planes.scales, scales)
    assert np.array_equal(qr, spec_lo_codes(w, q4, scales))
    assert np.all(qr[below] == 0)
    assert np.all(16 * got_q4 + qr >= -128)


@pytest.mark.parametrize("group", bitnest.WEIGHT_GROUPS)
def test_dequantize_planes_agrees_with_independent_numpy(group):
    """dequantize_planes reads the group from the shapes (K / scale columns)."""
    planes = bitnest.quantize_planes(rng(5).normal(0, 0.1, (5, 256)).astype(F32), group)
    for draft in (True, False):
        a = bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=draft)
        assert np.array_equal(a, dequant(planes.hi, planes.lo, planes.scales, draft, group))


@pytest.mark.parametrize("group", bitnest.WEIGHT_GROUPS)
@pytest.mark.parametrize("draft", [True, False])
def test_dual_plane_linear_equals_matmul_with_dequantized_weights(draft, group):
    n, k = 24, 384
    w = rng(6).normal(0, 0.1, (n, k)).astype(F32)
    planes = bitnest.quantize_planes(w, group)
    bias = rng(7).normal(0, 1, n).astype(F32)
    tensors = {
        "l.hi": mx.array(planes.hi),
        "l.lo": mx.array(planes.lo),
        "l.scales": mx.array(planes.scales),
        "l.bias": mx.array(bias),
    }
    layer = DualPlaneLinear(k, n, bias=True, group_size=group)
    params = DualPlaneLinear.prepare(tensors, "l", mx.float32)
    layer.load_weights([(name.removeprefix("l."), a) for name, a in params.items()])
    x = rng(8).normal(0, 1, (3, 5, k)).astype(F32)
    want = x.astype(np.float64) @ dequant(planes.hi, planes.lo, planes.scales, draft, group).T
    want += bias
    mode = "draft" if draft else "target"
    got = np.array(layer(mx.array(x), RunOptions(mode, quantize_activations=False)))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    # 15 rows: the dense path serves the same product.
    dense_options = RunOptions(mode, quantize_activations=False, dense_min_rows=8)
    with mock.patch.object(DualPlaneLinear, "dequantized", wraps=layer.dequantized) as spy:
        dense = np.array(layer(mx.array(x), dense_options))
    spy.assert_called_once_with(draft, slice(0, n))
    assert np.abs(dense - want).max() <= 1e-5 * np.abs(want).max()
    # A weight over the dense block (an lm_head) is dequantized 10 rows at a time: same product.
    with mock.patch.object(dual_plane, "DENSE_BLOCK_WEIGHTS", 10 * k):
        with mock.patch.object(DualPlaneLinear, "dequantized", wraps=layer.dequantized) as spy:
            blocked = np.array(layer(mx.array(x), dense_options))
    assert [c.args[1] for c in spy.call_args_list] == [slice(0, 10), slice(10, 20), slice(20, 24)]
    assert np.abs(blocked - dense).max() <= 1e-6 * np.abs(want).max()


def planes_linear(n: int, k: int, seed: int) -> DualPlaneLinear:
    w = rng(seed).normal(0, 0.1, (n, k)).astype(F32)
    planes = bitnest.quantize_planes(w, 64)
    tensors = {"l.hi": mx.array(planes.hi), "l.lo": mx.array(planes.lo)}
    tensors["l.scales"] = mx.array(planes.scales)
    layer = DualPlaneLinear(k, n, group_size=64)
    params = DualPlaneLinear.prepare(tensors, "l", mx.float32)
    layer.load_weights([(name.removeprefix("l."), a) for name, a in params.items()])
    mx.eval(layer.parameters())
    return layer


def address(a: mx.array) -> int:
    return np.asarray(memoryview(a)).__array_interface__["data"][0]


def test_stacked_planes_are_the_only_copy_and_the_linears_hold_row_slices_of_it():
    """q/k/v stacked for one launch: each Linear's hi/lo/scales is a view into the stacked
    buffer at its row offset (no second copy at rest), with the same values and names."""
    linears = [planes_linear(n, 128, seed) for n, seed in ((16, 1), (8, 2), (8, 3))]
    before = [{p: np.array(getattr(lin, p)) for p in plane_stack.PLANES} for lin in linears]
    x = mx.array(rng(4).normal(0, 1, (2, 128)).astype(F32))
    want = [lin(x, RunOptions("target", use_kernels=False)) for lin in linears]
    stack = plane_stack.stacked_planes(linears)
    row = 0
    for lin, values in zip(linears, before):
        for p in plane_stack.PLANES:
            stacked = getattr(stack, p)
            offset = row * stacked.shape[1] * stacked.itemsize
            assert address(getattr(lin, p)) == address(stacked) + offset
            assert np.array_equal(np.array(getattr(lin, p)), values[p])
        assert set(lin.parameters()) == {"hi", "lo", "scales", "biases"}
        row += lin.hi.shape[0]
    got = [lin(x, RunOptions("target", use_kernels=False)) for lin in linears]
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, want))
    assert plane_stack.stacked_planes(linears) is stack  # cached: built once


def test_stack_is_rebuilt_when_a_linear_is_loaded_again():
    """Calibration loads planes into a Linear by name: the cached stack must not serve stale
    planes after that."""
    linears = [planes_linear(8, 128, seed) for seed in (1, 2)]
    plane_stack.stacked_planes(linears)
    fresh = planes_linear(8, 128, seed=5)
    linears[1].load_weights(list(fresh.parameters().items()))
    stack = plane_stack.stacked_planes(linears)
    assert np.array_equal(np.array(stack.hi[8:]), np.array(fresh.hi))


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_pure_path_grouped_matmul_equals_each_linear_bit_for_bit(mode):
    """The pure path runs q/k/v (or gate/up) as one quantized matmul per plane on the stacked
    planes: every output equals its Linear's own call exactly, A8 included."""
    opts = RunOptions(mode, use_kernels=False)
    x = mx.array(rng(4).normal(0, 1, (3, 128)).astype(F32))
    alone = [planes_linear(8, 128, seed) for seed in (1, 2, 3)]
    want = [lin(x, opts) for lin in alone]
    want_mlp = nn.silu(want[0]) * want[1]
    grouped = [planes_linear(8, 128, seed) for seed in (1, 2, 3)]
    got = project(x, grouped, opts)
    assert getattr(grouped[0], "_plane_stack", None) is not None
    assert all(mx.array_equal(g, w) for g, w in zip(got, want))
    assert mx.array_equal(swiglu(x, *grouped[:2], opts), want_mlp)


# ---------------------------------------------------------------------------------------------
# A8


def a8_inputs() -> np.ndarray:
    x = rng(9).normal(0, 1, (6, 256)).astype(F32)
    x[1] = 0  # zero row: scale 1, codes 0
    # amax 127 -> scale exactly 1: x/scale are exact .5 ties, which round half to even.
    x[2] = 0
    x[2, :6] = [127, 0.5, 1.5, 2.5, -0.5, -3.5]
    x[3] *= 1e-30  # tiny magnitudes: the scale is computed, not floored
    x[4] *= 1e4
    x[5, 128:] = 0  # a zero 128-group inside a nonzero row (group = 128)
    return x


@pytest.mark.parametrize("group", [-1, 128])
def test_a8_codes_equal_numpy_exactly(group):
    x = a8_inputs()
    codes, scale = a8_codes(x, group)
    got = np.array(a8(mx.array(x), group))
    g = 128 if group > 0 else x.shape[1]
    want = (codes.reshape(6, -1, g) * scale[..., None]).reshape(x.shape)
    assert np.array_equal(got, want)  # same scale and same integer code, element by element
    if group == -1:
        assert codes[2, :6].tolist() == [127, 0, 2, 2, -0.0, -4]  # half to even
    assert np.all(codes[1] == 0) and np.all(got[1] == 0)


def test_a8_in_half_precision_uses_fp32_math():
    x = a8_inputs()[[0, 2, 5]].astype(np.float16)
    got = np.array(a8(mx.array(x)).astype(mx.float32))
    codes, scale = a8_codes(x.astype(F32))
    assert np.array_equal(got, (codes * scale).astype(np.float16).astype(F32))


# ---------------------------------------------------------------------------------------------
# Nested KV


def kv_inputs() -> np.ndarray:
    """[B=1, H=2, T=5, D=128] with a zero vector and exact ties (amax 7 -> s = 1)."""
    x = rng(10).normal(0, 2, (1, 2, 5, 128)).astype(F32)
    x[0, 0, 1] = 0
    x[0, 1, 2] = 0
    x[0, 1, 2, :5] = [7, 0.5, 1.5, -2.5, 0.03125]  # q4 ties; 0.03125 = s/32 is a qr tie
    return x


def test_nest_quantize_codes_and_scales_equal_numpy_exactly():
    x = kv_inputs()
    hi, lo, s = nest_quantize(mx.array(x), 128)
    q4, qr, s_ref = kv_codes(x, 128)
    assert np.array_equal(mlx_words_to_codes(hi).astype(F32) - 8, q4)
    assert np.array_equal(mlx_words_to_codes(lo).astype(F32) - 8, qr)
    assert np.array_equal(np.array(s), s_ref)
    assert q4[0, 1, 2, :5].tolist() == [7, 0, 2, -2, 0] and qr[0, 1, 2, 4] == 0
    assert np.array(s)[0, 0, 1, 0] == 1  # zero vector: scale 1


@pytest.mark.parametrize("draft", [True, False])
def test_nest_dequantize_reads_kv4_or_kv8(draft):
    x = kv_inputs()
    q4, qr, s = kv_codes(x, 128)
    sg = s.astype(np.float64)
    want = q4 * sg if draft else (16 * q4.astype(np.float64) + qr) * sg / 16
    got = np.array(nest_dequantize(*nest_quantize(mx.array(x), 128), 128, draft))
    assert np.abs(got - want).max() <= 1e-6 * np.abs(x).max()


def test_nested_cache_overwrites_trimmed_draft_entries():
    """Spec §5: a draft round writes P..P+γ-1 (hi planes and scales only: it reads KV4), the
    cache is trimmed, the verify pass rewrites those positions; reads then see only the verify
    pass's values (plus the prefix), the lo planes included."""
    r = rng(11)
    k = [r.normal(0, 1, (1, 1, n, 128)).astype(F32) for n in (3, 2, 2)]
    v = [r.normal(0, 1, (1, 1, n, 128)).astype(F32) for n in (3, 2, 2)]
    cache = NestedKVCache(128)
    cache.update_and_fetch(mx.array(k[0]), mx.array(v[0]))
    cache.update_and_fetch(mx.array(k[1]), mx.array(v[1]), draft=True)
    assert cache.trim(2) == 2 and cache.offset == 3
    got_k, got_v = cache.update_and_fetch(mx.array(k[2]), mx.array(v[2]), draft=False)
    for got, parts in ((got_k, k), (got_v, v)):
        x = np.concatenate([parts[0], parts[2]], axis=2)
        q4, qr, s = kv_codes(x, 128)
        want = (16 * q4.astype(np.float64) + qr) * s / 16
        assert got.shape == (1, 1, 5, 128)
        assert np.abs(np.array(got) - want).max() <= 1e-6 * np.abs(x).max()


def test_unquantized_cache_returns_values_unchanged():
    x = kv_inputs()
    cache = NestedKVCache(128, quantized=False)
    k, v = cache.update_and_fetch(mx.array(x), mx.array(-x))
    assert np.array_equal(np.array(k), x) and np.array_equal(np.array(v), -x)


# ---------------------------------------------------------------------------------------------
# R4 online Hadamard


def online(n: int, had: np.ndarray | None) -> OnlineHadamard:
    k = 1 if had is None else had.shape[0]
    m = OnlineHadamard(n, k)
    if had is not None:
        m.load_weights([("had_k", mx.array(had.astype(F32)))])
    return m


@pytest.mark.parametrize(("n", "k"), [(512, 1), (384, 12)])
def test_online_hadamard_equals_numpy_r4_transform(n, k):
    had = hadamard_k(k) if k > 1 else None
    x = rng(12).normal(0, 1, (2, 3, n)).astype(F32)
    got = np.array(online(n, had)(mx.array(x)))
    want = r4_transform(x, had)
    assert np.abs(got - want).max() <= 1e-5
    # r4_transform itself is the spec's (hadK ⊗ H_{n/K}) / sqrt(n), built independently here.
    assert np.allclose(want, x.astype(np.float64) @ r4_matrix(n, had).T, atol=1e-12)


def test_mlx_builtin_hadamard_12_is_not_the_shipped_matrix():
    """Why the K = 12 case loads the package's matrix: MLX's own 12·2^k transform differs."""
    had = hadamard_k(12)
    x = rng(13).normal(0, 1, (4, 384)).astype(F32)
    builtin = np.array(mx.hadamard_transform(mx.array(x), scale=384**-0.5))
    assert np.abs(builtin - r4_transform(x, had)).max() > 0.1
