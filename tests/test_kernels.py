"""Metal kernels (bitnest_mlx/kernels/ + metal_kernels/*.metal) against the pure-MLX path.

Everywhere: each kernel runs in the CPU emulator (tests/metal_emu), on random shapes with ragged
edges, and a planted bug in each kernel must make its test fail; the generated Metal source of
every kernel passes a clang/g++ syntax check that catches a planted typo. On a Mac the same
comparisons run on the GPU. Nothing here runs real Metal on Linux.
"""

from __future__ import annotations

import hashlib
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import mlx_lm  # noqa: F401  (its bitnest hook imports the model first: avoids an import cycle)
import numpy as np
import pytest
import tools
from dsv4_kernel_cases import DSV4_CASES, DSV4_MUTATIONS, DSV4_SELF_TESTS, LOW_PRECISION_REL
from factory import make_package
from metal_emu import emulator, syntax
from metal_emu.emulator import InlineSpec

import bitnest_mlx
from bitnest_mlx import kernels
from bitnest_mlx.formats.bitnest import a8_codes
from bitnest_mlx.kernels import nested_kv as kv_launch
from bitnest_mlx.layers import dual_plane, hadamard, mxtq_linear, nested_kv
from bitnest_mlx.layers.dsv4_ops import swiglu_clamped
from bitnest_mlx.layers.dual_plane import DualPlaneLinear
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear, rotate_input
from bitnest_mlx.layers.nested_kv import nest_dequantize, nest_quantize
from bitnest_mlx.layers.options import RunOptions

# Each layer's first-use self-test (kernel vs its own pure path), by kernel name.
SELF_TESTS = {
    "dual_plane": dual_plane.kernel_self_test,
    "nested_kv": nested_kv.kernel_self_test,
    "nested_kv_write": nested_kv.write_self_test,
    "head_hadamard": hadamard.head_hadamard_self_test,
    "mxtq_gather": mxtq_linear.gather_self_test,
    "mxtq_swiglu": mxtq_linear.swiglu_self_test,
    "hadamard": mxtq_linear.hadamard_self_test,
    **DSV4_SELF_TESTS,
}

needs_cxx = tools.needs(emulator.cxx(), why="the Metal emulator compiles kernels with it")
on_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (a Mac)")


def close(got: mx.array, want: mx.array, rel: float = 2e-5) -> bool:
    got, want = np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
    return bool(np.all(np.isfinite(got))) and np.allclose(
        got, want, rtol=rel, atol=rel * np.abs(want).max()
    )


# ---------------------------------------------------------------- cases (shared by emulator/Metal)


def dual_plane_case(m, n, k, weight_group, draft, act, dtype, seed):
    """(kernel call, pure reference) for one dual-plane matmul with one scale per `weight_group`
    columns; act: None (x as is), -1 (A8 per token) or the A8 group in columns."""
    keys = mx.random.split(mx.random.key(seed), 4)
    lin = DualPlaneLinear(k, n, group_size=weight_group)
    lin.hi = mx.random.randint(0, 2**31, (n, k // 8), key=keys[0]).astype(mx.uint32)
    lin.lo = mx.random.randint(0, 2**31, (n, k // 8), key=keys[1]).astype(mx.uint32)
    lin.scales = mx.random.uniform(0.002, 0.02, lin.scales.shape, key=keys[2]).astype(dtype)
    lin.biases = -8 * lin.scales
    x = (mx.random.normal((m, k), key=keys[3]) * 3).astype(dtype)
    group = act

    def call(runner, mutate=None):
        run = with_mutation(runner, mutate)  # a8_quantize's launch runs as it is
        if group is None:
            return kernels.dual_plane_matmul(x, lin.hi, lin.lo, lin.scales, draft=draft, runner=run)
        return kernels.dual_plane_matmul(
            x, lin.hi, lin.lo, lin.scales, draft=draft, a8_group=group, runner=run
        )

    pure = RunOptions("draft" if draft else "target", group is not None, use_kernels=False)
    return call, lin(x, pure, a8_group=-1 if group is None else group)


def with_mutation(runner, mutate):
    """`runner` with `mutate` applied to each launch whose source it changes; a call of several
    launches (attention + merge) runs the others as they are. A mutation that changes none of
    them leaves the result exact, so the planted-bug tests still notice a stale string."""
    if mutate is None:
        return runner

    def run(launch):
        try:
            return runner(launch, mutate)
        except ValueError as e:
            if "did not change" not in str(e):
                raise
            return runner(launch)

    return run


def nested_kv_case(
    b, hq, hkv, L, d, n_kv, t_cap, group, draft, dtype=mx.float32, splits=None, *, seed
):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((b, hq, L, d), key=keys[0]).astype(dtype)
    # Capacity-sized planes: positions past n_kv hold other data and must be ignored.
    kp = nest_quantize(mx.random.normal((b, hkv, t_cap, d), key=keys[1]) * 2, group)
    vp = nest_quantize(mx.random.normal((b, hkv, t_cap, d), key=keys[2]), group)
    scale = d**-0.5

    def call(runner, mutate=None):
        run = with_mutation(runner, mutate)
        return kernels.nested_kv_attention(
            q, kp, vp, draft=draft, scale=scale, group=group, n_kv=n_kv, splits=splits, runner=run
        )

    k, v = (nest_dequantize(*(a[:, :, :n_kv] for a in p), group, draft) for p in (kp, vp))
    rep = hq // hkv
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    mask = "causal" if L > 1 else None
    want = mx.fast.scaled_dot_product_attention(q.astype(k.dtype), k, v, scale=scale, mask=mask)
    return call, want.astype(dtype)


def nested_kv_write_case(shape, group, dtype, seed):
    """(kernel call, pure reference) for one K and V write: both planes and scales, compared
    as the KV8 they decode to (tests below compare the stored bits)."""
    k1, k2 = mx.random.split(mx.random.key(seed), 2)
    k = (mx.random.normal(shape, key=k1) * 3).astype(dtype)
    v = mx.random.normal(shape, key=k2).astype(dtype)

    def kv8(stored):
        return mx.concatenate([nest_dequantize(*p, group, draft=False).reshape(-1) for p in stored])

    def call(runner, mutate=None):
        run = runner if mutate is None else (lambda launch: runner(launch, mutate))
        return kv8(kernels.nested_kv_write(k, v, group, runner=run))

    return call, kv8((nest_quantize(k, group), nest_quantize(v, group)))


def head_hadamard_case(q_shape, k_shape, dtype, seed):
    k1, k2 = mx.random.split(mx.random.key(seed), 2)
    q = (mx.random.normal(q_shape, key=k1) * 3).astype(dtype)
    k = (mx.random.normal(k_shape, key=k2) * 3).astype(dtype)

    def call(runner, mutate=None):
        run = runner if mutate is None else (lambda launch: runner(launch, mutate))
        return mx.concatenate([a.reshape(-1) for a in kernels.head_hadamard(q, k, run)])

    return call, mx.concatenate([hadamard.r3(q).reshape(-1), hadamard.r3(k).reshape(-1)])


def mxtq_case(bits, n_in, n_out, experts, tokens, k, shared, seed):
    keys = mx.random.split(mx.random.key(seed), 4)
    sw = MXTQSwitchLinear(n_in, n_out, experts, bits=bits)
    sw.tq_packed = mx.random.randint(0, 2**31, sw.tq_packed.shape, key=keys[0]).astype(mx.uint32)
    sw.tq_norms = mx.random.uniform(0.5, 2.0, sw.tq_norms.shape, key=keys[1]).astype(mx.float16)
    x = mx.random.normal((tokens, 1 if shared else k, 1, n_in), key=keys[2])
    idx = mx.random.randint(0, experts, (tokens, k), key=keys[3]).astype(mx.uint32)

    def call(runner, mutate=None):
        run = runner if mutate is None else (lambda launch: runner(launch, mutate))
        return kernels.mxtq_gather_matvec(
            x[..., 0, :], idx, sw.tq_packed, sw.tq_norms, sw._codebook, bits, run
        )

    return call, sw.apply_rotated(x, idx, use_kernels=False)[..., 0, :]


def mxtq_swiglu_case(bits, n_in, n_out, experts, tokens, k, limit, seed):
    keys = mx.random.split(mx.random.key(seed), 6)
    gate, up = (MXTQSwitchLinear(n_in, n_out, experts, bits=bits) for _ in range(2))
    for sw, kp, kn in ((gate, keys[0], keys[1]), (up, keys[2], keys[3])):
        sw.tq_packed = mx.random.randint(0, 2**31, sw.tq_packed.shape, key=kp).astype(mx.uint32)
        sw.tq_norms = mx.random.uniform(0.5, 2.0, sw.tq_norms.shape, key=kn).astype(mx.float16)
    x = mx.random.normal((tokens, 1, 1, n_in), key=keys[4]) * 8
    idx = mx.random.randint(0, experts, (tokens, k), key=keys[5]).astype(mx.uint32)
    w = mx.random.uniform(0.1, 1.0, (tokens, k), key=keys[4])

    def call(runner, mutate=None):
        run = runner if mutate is None else (lambda launch: runner(launch, mutate))
        stacks = (gate.tq_packed, gate.tq_norms), (up.tq_packed, up.tq_norms)
        return kernels.mxtq_gather_swiglu(
            x[..., 0, :], idx, *stacks, gate._codebook, bits, limit, w, run
        )

    g, u = gate.apply_rotated(x, idx, use_kernels=False), up.apply_rotated(x, idx, False)
    return call, (swiglu_clamped(g, u, limit) * w[..., None, None])[..., 0, :]


def hadamard_case(rows, d, seed):
    k1, k2 = mx.random.split(mx.random.key(seed))
    x = mx.random.normal((rows, d), key=k1).astype(mx.float16)
    signs = mx.where(mx.random.uniform(shape=(d,), key=k2) < 0.5, -1.0, 1.0)

    def call(runner, mutate=None):
        run = runner if mutate is None else (lambda launch: runner(launch, mutate))
        return kernels.hadamard_rotate(x, signs, run)

    return call, rotate_input(x, signs)


# M, N, K, weight group, draft, A8 (None: off, -1: per token, else its group), dtype: N not a
# multiple of 4 rows per simdgroup / 8 per threadgroup, K not of 512 per sweep (nor of 128 at
# the smaller weight groups).
DUAL_PLANE = {
    "m1_draft_float_x": (1, 13, 384, 128, True, None, mx.float32),
    "m3_target_a8_token": (3, 13, 640, 128, False, -1, mx.float32),
    "m8_target_a8_group": (8, 9, 1152, 128, False, 128, mx.float32),
    "m2_draft_a8_group_fp16": (2, 6, 256, 128, True, 128, mx.float16),
    "m5_target_float_x_k128": (5, 3, 128, 128, False, None, mx.float32),
    "m4_target_a8_token_g64_k320": (4, 11, 320, 64, False, -1, mx.float32),
    "m1_target_float_x_g64_k576": (1, 6, 576, 64, False, None, mx.float32),
    "m2_draft_a8_head64_g32_k192": (2, 7, 192, 32, True, 64, mx.float32),
    "m3_target_a8_group_g32_fp16": (3, 9, 640, 32, False, 128, mx.float16),
    # Up to A8_IN_KERNEL_MAX_ROWS rows quantize inside the launch; the rest launch a8_quantize.
    "m1_draft_a8_token_in_launch_k640": (1, 13, 640, 128, True, -1, mx.float32),
    "m2_target_a8_token_in_launch_fp16": (2, 9, 1152, 64, False, -1, mx.float16),
    "m2_target_a8_head128_in_launch_k384": (2, 5, 384, 32, False, 128, mx.float32),
}
# B, Hq, Hkv, L, D, n_kv, t_cap, group, draft[, dtype, key splits (None: the launch's choice)]
F32 = mx.float32
NESTED_KV = {
    "decode_kv4_gqa2_d128": (1, 4, 2, 1, 128, 37, 40, 128, True),
    "verify4_kv8_gqa3_d64": (2, 6, 2, 4, 64, 19, 25, 64, False),
    "prefill_all_keys_kv8": (1, 2, 1, 8, 128, 8, 8, 128, False),
    # 18 rows over the 16 a threadgroup takes at head_dim 64: two chunks of 9.
    "rows_over_chunk_kv8_g32": (1, 18, 1, 1, 64, 11, 16, 32, False),
    # GQA 3 at L = 4: all 12 rows in one chunk (head_dim 128's most), KV4, 2 splits.
    "verify4_kv4_gqa3_d128_one_chunk": (1, 6, 2, 4, 128, 150, 160, 64, True, F32, 2),
    # GQA 3 at L = 5: 15 rows, chunks of 8 and 7 (the second starts at query 3 of its head).
    "verify5_kv8_gqa3_d128_ragged_chunk": (1, 3, 1, 5, 128, 70, 80, 64, False, F32, 2),
    # L = 8 at head_dim 256 (7 rows a threadgroup at most): two chunks of 4.
    "verify8_kv8_d256_two_chunks": (1, 1, 1, 8, 256, 40, 48, 128, False),
    "decode_kv8_fp16_d256": (1, 2, 1, 1, 256, 9, 12, 128, False, mx.float16),
    # 3 splits of 96 keys, the last one ragged (8 keys); KV4 at group 32.
    "decode_kv4_d128_g32_3_splits": (1, 6, 2, 1, 128, 200, 256, 32, True, F32, 3),
    # 5 splits of 32: the last holds only key 128, which 3 of the 4 causal rows cannot see.
    "verify4_kv8_d128_g64_5_splits": (1, 4, 1, 4, 128, 129, 160, 64, False, F32, 5),
    # The launch's own choice at one kv head: 3 splits (128, 128, 44 keys).
    "decode_kv8_d64_g32_chosen_splits": (1, 2, 1, 1, 64, 300, 320, 32, False),
}
# K/V shape [B, H, L, D], KV group, dtype
NESTED_KV_WRITE = {
    "decode_d128_g64": ((1, 8, 1, 128), 64, mx.float32),
    "verify3_d64_g32_fp16": ((2, 2, 3, 64), 32, mx.float16),
    "prefill_d256_g128_ragged_rows": ((1, 3, 5, 256), 128, mx.float32),
    "decode_d128_g128": ((1, 2, 1, 128), 128, mx.float32),
}
# q shape, k shape ([B, H, L, head_dim]), dtype
HEAD_HADAMARD = {
    "decode_d128_gqa3": ((1, 6, 1, 128), (1, 2, 1, 128), mx.float32),
    "verify4_d64_fp16": ((1, 4, 4, 64), (1, 2, 4, 64), mx.float16),
    "d256_batch2": ((2, 2, 3, 256), (2, 1, 3, 256), mx.float32),
    "d32_one_lane_each": ((1, 2, 1, 32), (1, 1, 1, 32), mx.float32),
}
# bits, in, out, experts, tokens, K, shared x (gate/up) vs one x per slot (down)
MXTQ = {
    "2bit_shared_ragged_out": (2, 384, 21, 5, 2, 3, True),
    "4bit_per_slot": (4, 256, 16, 4, 3, 2, False),
    "2bit_words_past_32_lanes": (2, 1024, 9, 3, 1, 2, False),
}
# bits, in, out, experts, tokens, K, SwiGLU limit (0: no clamp; small: both clamps bind)
MXTQ_SWIGLU = {
    "2bit_clamped_ragged_out": (2, 1024, 21, 5, 2, 3, 0.5),
    "4bit_no_clamp_two_simdgroups": (4, 256, 40, 4, 3, 2, 0.0),
    "4bit_limit_10_one_token": (4, 512, 16, 3, 1, 2, 10.0),
}
HADAMARD = {"d128_e1": (3, 128), "d512": (2, 512), "d2048": (2, 2048), "d4096": (1, 4096)}

CASES = {
    "dual_plane": (dual_plane_case, DUAL_PLANE, 2e-5),
    "nested_kv": (nested_kv_case, NESTED_KV, 2e-5),
    "nested_kv_write": (nested_kv_write_case, NESTED_KV_WRITE, 0.0),
    "head_hadamard": (head_hadamard_case, HEAD_HADAMARD, 2e-6),
    "mxtq_gather": (mxtq_case, MXTQ, 2e-5),
    "mxtq_swiglu": (mxtq_swiglu_case, MXTQ_SWIGLU, 2e-5),
    "hadamard": (hadamard_case, HADAMARD, 2e-5),
    **DSV4_CASES,
}
ALL = [(kind, name) for kind, (_, table, _) in CASES.items() for name in table]


def build(kind: str, name: str):
    make, table, rel = CASES[kind]
    case = table[name]
    call, want = make(*case, seed=ALL.index((kind, name)))
    if kind == "dual_plane" and case[-1] == mx.float16:
        rel = 5e-3  # the pure path rounds a8(x) to fp16 before the matmul; the kernel does not
    elif kind in ("nested_kv", "head_hadamard") and case[-1] == mx.float16:
        rel = 2e-3  # fp16 output rounding
    elif kind in DSV4_CASES:
        rel = max(rel, *(LOW_PRECISION_REL.get(a, 0) for a in case))
    return call, want, rel


# ---------------------------------------------------------------- emulator


@needs_cxx
@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_kernel_matches_pure_path_in_emulator(kind, name):
    call, want, rel = build(kind, name)
    got = call(emulator.run)
    assert got.shape == want.shape
    assert close(got, want, rel), float(mx.abs(got - want).max())


@needs_cxx
@pytest.mark.parametrize("group", [-1, 64, 96])
def test_a8_quantize_launch_equals_numerics_a8_codes_bit_for_bit(group):
    x = mx.random.normal((3, 384), key=mx.random.key(4)) * 5
    x[1, :] = 0  # an all-zero row: scale 1, codes 0
    want_q, want_scale = a8_codes(x, group)
    got_q, got_scale = kernels.a8_quantize(x, group, runner=emulator.run)
    assert mx.array_equal(got_q, want_q) and mx.array_equal(got_scale, want_scale)


@needs_cxx
def test_emulator_test_fails_when_a8_in_the_launch_rounds_half_away_from_zero():
    x = mx.full((2, 1152), 0.0)
    # One shared amax of 127 makes every x / a an exact k + 0.5 tie below it.
    x = x + mx.arange(1152).reshape(1, -1) % 7 + 0.5
    x[:, 0] = 127.0
    lin = dual_plane.random_linear(1152, 8, 64, seed=3)
    args = (x, lin.hi, lin.lo, lin.scales)
    want = lin(x, RunOptions("target", True, use_kernels=False))

    def run(mutate=None):
        runner = emulator.run if mutate is None else (lambda la: emulator.run(la, mutate))
        return kernels.dual_plane_matmul(*args, draft=False, a8_group=-1, runner=runner)

    assert close(run(), want)
    away = run(lambda s: s.replace("(v + 12582912.0f) - 12582912.0f", "metal::round(v)"))
    assert not close(away, want)


@needs_cxx
@pytest.mark.parametrize("name", list(NESTED_KV_WRITE))
def test_nested_kv_write_stores_the_bits_nest_quantize_stores(name):
    shape, group, dtype = NESTED_KV_WRITE[name]
    k1, k2 = mx.random.split(mx.random.key(7), 2)
    k = (mx.random.normal(shape, key=k1) * 3).astype(dtype)
    v = mx.random.normal(shape, key=k2).astype(dtype)
    k[..., 0, :] = 0  # an all-zero row: scale 1, every code 8
    stored = kernels.nested_kv_write(k, v, group, runner=emulator.run)
    for got, want in zip(stored, (nest_quantize(k, group), nest_quantize(v, group))):
        assert all(a.dtype == b.dtype and mx.array_equal(a, b) for a, b in zip(got, want))


# One planted bug per kernel: the comparison above must notice each.
MUTATIONS = {
    # The odd columns' lo nibbles are read one bit too high.
    "dual_plane": ("m3_target_a8_token", "((l >> 4) & 0x0F0F0F0Fu)", "((l >> 5) & 0x0F0F0F0Fu)"),
    # The causal test lets the newest query miss its own key.
    "nested_kv": ("verify4_kv8_gqa3_d64", "t < t_end && t <= last[j]", "t < t_end && t < last[j]"),
    # The low plane's step taken as s / 8: its residual codes clip.
    "nested_kv_write": ("decode_d128_g64", "s / 16.0f", "s / 8.0f"),
    # The cross-lane butterflies swap which partner subtracts.
    "head_hadamard": (
        "decode_d128_gqa3",
        "upper ? other - x[j] : x[j] + other",
        "upper ? x[j] - other : x[j] + other",
    ),
    # Codes read at the neighbouring field.
    "mxtq_gather": ("4bit_per_slot", "(code >> (i * BITS))", "(code >> ((i + 1) * BITS))"),
    # The gate is clamped at twice the limit.
    "mxtq_swiglu": ("2bit_clamped_ragged_out", "metal::min(g, limit)", "metal::min(g, 2 * limit)"),
    # The cross-simdgroup stage forgets the minus signs of H_4.
    "hadamard": ("d512", "? -t : t", "? t : t"),
    **DSV4_MUTATIONS,
}


@needs_cxx
@pytest.mark.parametrize("kind", list(MUTATIONS))
def test_emulator_test_fails_on_a_planted_kernel_bug(kind):
    name, old, new = MUTATIONS[kind]
    call, want, rel = build(kind, name)
    got = call(emulator.run, mutate=lambda src: src.replace(old, new))
    assert not close(got, want, rel)


@needs_cxx
@pytest.mark.parametrize(
    "L,d,group,draft",
    [(1, 64, 32, True), (4, 64, 64, False), (4, 128, 128, True), (1, 128, 32, False)],
)
def test_nested_kv_matches_pure_path_at_every_split_count(L, d, group, draft):
    """One compiled variant per shape; the split count is a run-time input. 161 keys: each
    count leaves a ragged last split (6 splits: five of 32 keys and one of 1)."""
    for splits in (1, 2, 3, 6):
        call, want = nested_kv_case(1, 6, 2, L, d, 161, 170, group, draft, F32, splits, seed=splits)
        got = call(emulator.run)
        assert close(got, want), (splits, float(mx.abs(got - want).max()))


@needs_cxx
def test_emulator_test_fails_when_a_ragged_chunk_loses_its_rows_query_index():
    """The second chunk of 15 rows at L = 5 starts at query 3 of its head: counted from 0 its
    causal limits are wrong."""
    call, want, rel = build("nested_kv", "verify5_kv8_gqa3_d128_ragged_chunk")
    got = call(emulator.run, mutate=lambda src: src.replace("int qi = j0 % L;", "int qi = 0;"))
    assert not close(got, want, rel)


@needs_cxx
def test_emulator_test_fails_when_the_split_merge_forgets_a_splits_weight():
    call, want, rel = build("nested_kv", "verify4_kv8_d128_g64_5_splits")
    got = call(emulator.run, mutate=lambda src: src.replace("l_part[at] * w;", "l_part[at];"))
    assert not close(got, want, rel)


def test_nested_kv_geometry_fits_threadgroup_memory_with_the_fewest_chunks(monkeypatch):
    """Every supported head_dim, GQA 1-8 and L 1-8: pass 1's threadgroup memory stays within
    Apple's 32 KB, rows go to the fewest chunks the limit allows, of equal size but the last;
    Llama-3.2-3B's verification (GQA 3, L = 4) reads each key once for its 12 rows."""
    for d in (64, 128, 256):
        for rep in range(1, 9):
            for L in range(1, 9):
                geo = kernels.kv_geometry(1, 2 * rep, 2, L, d, 4096)
                rows = rep * L
                assert kv_launch.kv_threadgroup_bytes(geo.qn, d) <= kv_launch.KV_TG_BYTES
                assert geo.chunks == -(-rows // kv_launch.kv_max_rows(d))
                assert geo.qn * (geo.chunks - 1) < rows <= geo.qn * geo.chunks
    assert kernels.kv_geometry(1, 24, 8, 4, 128, 4096).chunks == 1
    monkeypatch.setattr(kv_launch, "kv_max_rows", lambda d: 32)
    with pytest.raises(ValueError, match="threadgroup memory"):
        kernels.kv_geometry(1, 24, 8, 8, 128, 4096)


@pytest.mark.parametrize("L", [1, 4])
def test_llama_3b_decode_at_4k_context_spreads_keys_over_at_least_64_threadgroups(L):
    """24 query heads on 8 kv heads, head_dim 128: without key splits only 8 (L = 1) or 16
    (L = 4) threadgroups would run; the split launch covers every key exactly once."""
    launches = []

    def record(launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=t) for s, t in zip(launch.output_shapes, launch.output_dtypes)]

    planes = (mx.zeros((1, 8, 4096, 16), mx.uint32),) * 2 + (mx.ones((1, 8, 4096, 4)),)
    q = mx.zeros((1, 24, L, 128))
    kernels.nested_kv_attention(
        q, planes, planes, draft=True, scale=1.0, group=32, n_kv=4096, runner=record
    )
    attention = launches[0]
    groups = [g // t for g, t in zip(attention.grid, attention.threadgroup)]
    assert groups[0] * groups[1] * groups[2] >= 64
    split_len, splits = attention.inputs[-2:]
    assert splits == groups[0] and (splits - 1) * split_len < 4096 <= splits * split_len


@needs_cxx
def test_emulator_test_fails_when_the_kernel_assumes_128_column_groups():
    """The weight group comes from the template, not a 128 left in the body."""
    call, want, rel = build("dual_plane", "m4_target_a8_token_g64_k320")
    got = call(emulator.run, mutate=lambda src: src.replace("k0 / GS", "k0 / 128"))
    assert not close(got, want, rel)


def run_inline(body: str, inputs: list, n: int, grid, tg) -> np.ndarray:
    names = tuple(f"in{i}" for i in range(len(inputs)))
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    spec = InlineSpec(f"emu_probe_{digest}", "", names, ("out",), body=body)
    launch = kernels.Launch(spec, inputs, [], grid, tg, [(n,)], [mx.float32])
    return np.array(emulator.run(launch)[0])


@needs_cxx
def test_emulator_simd_ops_exchange_values_across_the_32_lanes():
    body = """
    const uint lane = thread_index_in_simdgroup;
    const uint i = thread_position_in_grid.x;
    const float v = in0[i];
    out[i] = metal::simd_sum(v) + 1000.0f * metal::simd_shuffle_xor(v, ushort(5))
             + 100000.0f * metal::simd_shuffle_down(v, ushort(3)) + 0.0f * lane;
    """
    v = np.arange(64, dtype=np.float32) % 7
    got = run_inline(body, [mx.array(v)], 64, (64, 1, 1), (64, 1, 1))
    lanes = np.arange(64) % 32
    base = np.arange(64) - lanes
    down = np.where(lanes + 3 < 32, v[np.minimum(base + lanes + 3, 63)], v)
    want = v.reshape(2, 32).sum(1).repeat(32) + 1000 * v[base + (lanes ^ 5)] + 100000 * down
    np.testing.assert_array_equal(got, want)


@needs_cxx
def test_emulator_threadgroup_memory_is_shared_within_a_group_only():
    # Each thread reads the value its mirror thread wrote before the barrier; groups of 48 threads
    # (1.5 simdgroups) over a grid of 120 (the last group has 24 threads).
    body = """
    threadgroup float buf[48];
    const uint t = thread_index_in_threadgroup;
    const uint n = threads_per_threadgroup.x;
    buf[t] = in0[thread_position_in_grid.x];
    metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[n - 1 - t];
    """
    v = np.arange(120, dtype=np.float32)
    got = run_inline(body, [mx.array(v)], 120, (120, 1, 1), (48, 1, 1))
    want = np.concatenate([v[:48][::-1], v[48:96][::-1], v[96:][::-1]])
    np.testing.assert_array_equal(got, want)


@needs_cxx
def test_emulator_rejects_a_barrier_in_divergent_code():
    body = """
    if (thread_index_in_threadgroup < 16)
      metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = in0[0];
    """
    with pytest.raises(emulator.EmulatorError, match="barrier"):
        run_inline(body, [mx.zeros((8,))], 32, (32, 1, 1), (32, 1, 1))


# ---------------------------------------------------------------- model routing (emulated Metal)


class LaunchLog:
    """The emulator as the Metal runner, keeping every launch it is handed."""

    def __init__(self):
        self.launches: list[kernels.Launch] = []

    def __call__(self, launch: kernels.Launch, verbose: bool = False) -> list[mx.array]:
        self.launches.append(launch)
        return emulator.run(launch)

    def dual_plane(self) -> list[kernels.Launch]:
        return [la for la in self.launches if la.spec is kernels.DUAL_PLANE]


def launch_n(launch: kernels.Launch) -> int:
    return launch.inputs[DUAL_PLANE_ARGS.index("N")]


def gate_up_flag(launch: kernels.Launch) -> bool:
    return dict(launch.template)["GATE_UP"]


DUAL_PLANE_ARGS = kernels.DUAL_PLANE.input_names


def emulated_metal(monkeypatch) -> LaunchLog:
    """Kernels on, through the emulator, with a fresh dispatch state; returns the launch log."""
    log = LaunchLog()
    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels.launch, "metal_runner", log)
    monkeypatch.setattr(kernels.dispatch, "_state", kernels.dispatch._State())
    return log


def per_position_close(got: mx.array, want: mx.array) -> None:
    """Float-rounding differences per position, except where one lands an A8 or KV code on the
    other side of a rounding boundary (one code step, seen at <= 1 position here)."""
    err = np.abs(np.array(got - want)).max(axis=-1)[0]
    scale = float(mx.abs(want).max())
    assert np.isfinite(err).all() and err.max() < 1e-2 * scale, err
    assert np.sort(err)[-2] < 1e-5 * scale, err


@needs_cxx
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_decode_uses_one_launch_for_qkv_and_one_for_gate_up_and_matches(
    tmp_path, monkeypatch, arch
):
    """Prefill (M = 4) + 2 decode steps with every kernel on (emulated), 2 layers: per layer and
    step q/k/v is one launch and gate/up one launch with SiLU·up in its epilogue (4 dual-plane
    launches per layer, 7 per-Linear); the logits equal the per-Linear kernels' and the pure
    model's. Qwen2 has q/k/v biases, added after the kernel."""
    pkg, _, config = make_package(tmp_path / "pkg", arch, tokenizer=True, n_layers=2)
    with mock.patch("mlx_lm.tokenizer_utils.load", return_value=None):
        model, _ = bitnest_mlx.load(pkg, mode="target", dtype=mx.float32)
    layers = config["num_hidden_layers"]
    hd = config["head_dim"]
    qkv_rows = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * hd
    tokens = mx.array([[5, 9, 77, 3]])

    def logits(draft: bool, log: LaunchLog) -> tuple[mx.array, list[list[kernels.Launch]]]:
        cache = model.make_cache()
        mode = "draft" if draft else "target"
        out, steps = [], []
        for step in (tokens, mx.array([[11]]), mx.array([[42]])):
            log.launches.clear()
            out.append(model(step, cache, mode=mode))
            mx.eval(out[-1])
            steps.append(log.dual_plane())
        return mx.concatenate(out, axis=1), steps

    want = {d: logits(d, LaunchLog())[0] for d in (True, False)}
    log = emulated_metal(monkeypatch)
    # The first-use self-tests run here, so the launches counted below are the model's own.
    assert kernels.use("dual_plane", dual_plane.kernel_self_test)
    assert kernels.use("nested_kv", nested_kv.kernel_self_test)
    with mock.patch.object(dual_plane.plane_stack, "stackable", return_value=False):
        per_linear = {d: logits(d, log) for d in (True, False)}
    grouped = {d: logits(d, log) for d in (True, False)}

    for d in (True, False):
        for steps, per_layer in ((per_linear[d][1], 7), (grouped[d][1], 4)):
            assert [len(s) for s in steps] == [layers * per_layer + 1] * 3  # + lm_head
        for step in grouped[d][1]:
            assert sum(launch_n(la) == qkv_rows for la in step) == layers
            assert sum(gate_up_flag(la) for la in step) == layers
        for step in per_linear[d][1]:
            assert not any(gate_up_flag(la) for la in step)
        # q/k/v stacked are bit-identical; gate/up differ by the epilogue's float rounding.
        per_position_close(grouped[d][0], per_linear[d][0])
        per_position_close(grouped[d][0], want[d])
    if arch == "llama":  # Qwen2's k-bias offset keeps attention on the pure path
        assert kernels.report()["nested_kv"]["kernel"] > 0


def random_dual_plane(k, n, group, seed, dtype=mx.float32, bias=False) -> DualPlaneLinear:
    keys = mx.random.split(mx.random.key(seed), 4)
    lin = DualPlaneLinear(k, n, bias, group_size=group)
    lin.hi = mx.random.randint(0, 2**31, (n, k // 8), key=keys[0]).astype(mx.uint32)
    lin.lo = mx.random.randint(0, 2**31, (n, k // 8), key=keys[1]).astype(mx.uint32)
    lin.scales = mx.random.uniform(0.002, 0.02, lin.scales.shape, key=keys[2]).astype(dtype)
    lin.biases = -8 * lin.scales
    if bias:  # Qwen2-sized: large next to the products, so a bias added twice or not shows
        lin.bias = (mx.random.normal((n,), key=keys[3]) * 20).astype(dtype)
    return lin


GROUPED_CASES = [
    (group, m, draft, mx.float32) for group in (128, 64, 32) for m in (1, 4) for draft in (1, 0)
] + [(128, 4, False, mx.float16), (32, 1, True, mx.float16)]


@needs_cxx
@pytest.mark.parametrize(
    "group,m,draft,dtype",
    GROUPED_CASES,
    ids=[f"g{g}-M{m}-{'draft' if d else 'target'}-{str(t)[9:]}" for g, m, d, t in GROUPED_CASES],
)
def test_grouped_launches_equal_per_linear_launches_in_emulator(
    monkeypatch, group, m, draft, dtype
):
    """q/k/v (biased, different widths, ragged N) in one launch is bit-identical to three
    launches; gate/up in one launch with SiLU·up in the epilogue equals silu(gate)·up of two
    launches within float rounding: float32 at ~1e-6 of max |y| (the SiLU's own rounding);
    fp16 at 2e-3 (the per-Linear path also rounds gate and up to fp16 before the SiLU)."""
    k = 640  # one full 512-column sweep and a ragged second
    q, kp, v = (
        random_dual_plane(k, n, group, i, dtype, bias=True) for i, n in enumerate((20, 6, 6))
    )
    gate, up = (random_dual_plane(k, 22, group, 5 + i, dtype) for i in range(2))
    x = (mx.random.normal((1, m, k), key=mx.random.key(9)) * 3).astype(dtype)
    o = RunOptions("draft" if draft else "target")
    log = emulated_metal(monkeypatch)
    monkeypatch.setattr(kernels, "use", lambda name, self_test: True)
    per_linear = [lin(x, o) for lin in (q, kp, v)]
    gate_y, up_y = gate(x, o), up(x, o)
    swiglu_per_linear = nn.silu(gate_y) * up_y
    log.launches.clear()
    grouped = dual_plane.project(x, (q, kp, v), o)
    assert [launch_n(la) for la in log.dual_plane()] == [32]
    log.launches.clear()
    fused = dual_plane.swiglu(x, gate, up, o)
    assert [(launch_n(la), gate_up_flag(la)) for la in log.dual_plane()] == [(44, True)]
    for a, b in zip(grouped, per_linear):
        assert a.dtype == b.dtype and np.array_equal(np.array(a), np.array(b))
    assert close(fused, swiglu_per_linear, rel=1e-6 if dtype == mx.float32 else 2e-3), float(
        mx.abs(fused - swiglu_per_linear).max()
    )


@needs_cxx
def test_per_head_a8_of_64_is_fused_into_the_kernel_at_a_32_column_weight_group(monkeypatch):
    """Qwen2.5-0.5B's o_proj (A8 per head_dim 64) on a group-32 package: the kernel quantizes x
    itself (no separate a8 pass) and gives the pure path's result."""
    keys = mx.random.split(mx.random.key(7), 3)
    lin = DualPlaneLinear(192, 7, group_size=32)
    lin.hi = mx.random.randint(0, 2**31, (7, 24), key=keys[0]).astype(mx.uint32)
    lin.lo = mx.random.randint(0, 2**31, (7, 24), key=keys[1]).astype(mx.uint32)
    lin.scales = mx.random.uniform(0.002, 0.02, (7, 6), key=keys[2])
    lin.biases = -8 * lin.scales
    x = mx.random.normal((1, 2, 192), key=keys[0]) * 3
    want = lin(x, RunOptions("draft", use_kernels=False), a8_group=64)
    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels.launch, "metal_runner", emulator.run)
    monkeypatch.setattr(kernels, "use", lambda name, self_test: True)
    monkeypatch.setattr(kernels.dispatch, "_state", kernels.dispatch._State())
    with mock.patch.object(dual_plane, "a8", wraps=dual_plane.a8) as a8_spy:
        got = lin(x, RunOptions("draft"), a8_group=64)
    a8_spy.assert_not_called()
    assert kernels.report()["dual_plane"]["kernel"] == 1
    assert close(got, want), float(mx.abs(got - want).max())


@needs_cxx
def test_failed_self_test_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(kernels.dispatch, "_metal", lambda: True)
    monkeypatch.setattr(kernels.dispatch, "_state", kernels.dispatch._State())

    def broken(launch, verbose=False):
        return emulator.run(launch, mutate=lambda s: s.replace("? -t : t", "? t : t"))

    monkeypatch.setattr(kernels.launch, "metal_runner", broken)
    with pytest.warns(RuntimeWarning, match="hadamard"):
        assert kernels.use("hadamard", SELF_TESTS["hadamard"]) is False
    # Decided once: no second warning, no rerun.
    assert kernels.use("hadamard", SELF_TESTS["hadamard"]) is False
    assert kernels.report()["hadamard"]["status"].startswith("max error")


# ---------------------------------------------------------------- Metal syntax check


@pytest.fixture(scope="module")
def generated_sources() -> dict[str, str]:
    """The exact Metal source MLX generates for every case above (one per kernel variant)."""
    sources = {}

    def grab(launch, mutate=None):
        src = emulator.capture(launch)
        sources[src.split("[[kernel]] void ")[1].split("(")[0]] = src
        return [mx.zeros(s, dtype=t) for s, t in zip(launch.output_shapes, launch.output_dtypes)]

    for kind, name in ALL:
        build(kind, name)[0](grab)
    return sources


@pytest.fixture(scope="module")
def msl_checker():
    tool = syntax.compiler()
    if tool is None:
        tools.missing("clang++", "g++", why="the Metal syntax check")
    return tool


def test_syntax_check_passes_every_generated_kernel(generated_sources, msl_checker):
    for spec in kernels.SPECS:  # every kernel is among the cases (names: spec, then types)
        assert any(f"custom_kernel_{spec.name}_" in name for name in generated_sources), spec.name
    for name, src in generated_sources.items():
        r = syntax.check(src, msl_checker)
        assert r.returncode == 0, f"{name} ({msl_checker[0]}):\n{r.stderr[-3000:]}"


@pytest.mark.parametrize("spec", kernels.SPECS, ids=lambda s: s.name)
def test_syntax_check_catches_a_planted_typo(generated_sources, msl_checker, spec):
    src = next(s for s in generated_sources.values() if f"custom_kernel_{spec.name}_" in s)
    # A misspelt builtin, its semicolon dropped, in the kernel's first simd_sum, barrier, exp,
    # simd_max or shuffle.
    builtins = (
        "metal::simd_sum(",
        "metal::threadgroup_barrier(",
        "metal::exp(",
        "metal::simd_max(",
        "metal::simd_shuffle_xor(",
        "metal::fma(",
    )
    call = next(b for b in builtins if b in src)
    start = src.index(call)
    end = src.index(";", start)
    typo = src[:start] + src[start:end].replace(call, call[:-1] + "m(") + src[end + 1 :]
    r = syntax.check(typo, msl_checker)
    assert r.returncode != 0 and "error" in r.stderr


def test_syntax_check_catches_an_address_space_error(generated_sources, msl_checker):
    if msl_checker[0] != "clang":
        tools.missing("clang++", why="address spaces are only modelled with clang")
    src = next(s for s in generated_sources.values() if "custom_kernel_bitnest_hadamard" in s)
    bad = src.replace("const float norm =", "float* alias = &buf[0][0];\nconst float norm =", 1)
    assert bad != src
    r = syntax.check(bad, msl_checker)
    assert r.returncode != 0 and "address_space" in r.stderr


# ---------------------------------------------------------------- real Metal (Macs only)


@on_metal
@pytest.mark.parametrize("kind,name", ALL, ids=[f"{k}-{n}" for k, n in ALL])
def test_kernel_matches_pure_path_on_metal(kind, name):
    call, want, rel = build(kind, name)
    got = call(kernels.metal_runner)
    assert close(got, want, max(rel, 1e-4)), float(mx.abs(got - want).max())


@on_metal
def test_every_kernel_passes_its_self_test_on_metal():
    for name, self_test in SELF_TESTS.items():
        assert kernels.check(self_test) == "ok", name


@needs_cxx
@pytest.mark.parametrize("name", list(SELF_TESTS))
def test_every_layer_self_test_passes_in_emulator_and_catches_its_planted_bug(name):
    assert kernels.check(SELF_TESTS[name], emulator.run) == "ok"
    _, old, new = MUTATIONS[name]

    broken = with_mutation(emulator.run, lambda src: src.replace(old, new))
    assert kernels.check(SELF_TESTS[name], broken) != "ok"
