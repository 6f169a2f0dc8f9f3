"""The dual-plane (W4 draft / W8 target) small-M matmul: A8 quantized in the kernel."""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

from ..formats.bitnest.numerics import WEIGHT_GROUPS
from .launch import KernelSpec, Launch, Runner, run

MAX_M = 8  # dual-plane small-M limit: decode (1) and γ+1 verification
# Passes of at most this many rows quantize their input to A8 inside the matmul launch (one
# launch, no separate A8 kernel). Every simdgroup then quantizes all M·K inputs: about 3 more
# lane-cycles per weight·row in the emulator's counts (bench --kernels), which keeps a pass of
# 2 rows under the streaming budget of every chip in runtime/chips.py but not one of 3 on an
# M4 Max. Wider passes launch `a8_quantize` once and read its codes.
A8_IN_KERNEL_MAX_ROWS = 2
# Columns one lane of the dual-plane kernel reads at a time under a single weight scale and A8
# scale: every weight group and fused A8 group must be a multiple of it.
LANE_COLS = 16

DUAL_PLANE = KernelSpec(
    "bitnest_dual_plane_qmv",
    "dual_plane_qmv.metal",
    ("x", "ascale", "hi", "lo", "scales", "N", "K"),
    ("y",),
)
A8_QUANTIZE = KernelSpec(
    "bitnest_a8_quantize", "a8_quantize.metal", ("x", "K", "G"), ("q", "scale")
)


def _weight_group(k: int, scales: mx.array) -> int:
    """Columns per weight scale, as the scales' shape implies (0: they do not tile K)."""
    return k // scales.shape[-1] if k % scales.shape[-1] == 0 else 0


def dual_plane_supported(x: mx.array, hi: mx.array, scales: mx.array) -> bool:
    rows = math.prod(x.shape[:-1])
    k = x.shape[-1]
    return (
        1 <= rows <= MAX_M and hi.shape[-1] * 8 == k and _weight_group(k, scales) in WEIGHT_GROUPS
    )


def a8_fusable(group: int, k: int) -> bool:
    """Can the dual-plane kernel read A8 at group `group` (-1: per token) of K = `k` columns?
    Its lanes take 16 columns under one A8 scale."""
    return group == -1 or (group > 0 and group % LANE_COLS == 0 and k % group == 0)


def _a8_in_kernel(group: int, rows: int) -> bool:
    """Quantize inside the matmul launch? A group's scale is reduced over the lanes that hold
    it: an aligned run of 16-column lanes, a power of two of them within one 512-column block."""
    lanes = group // LANE_COLS
    aligned = group == -1 or (512 % group == 0 and lanes & (lanes - 1) == 0)
    return aligned and rows <= A8_IN_KERNEL_MAX_ROWS


def a8_quantize(
    x: mx.array, group: int = -1, runner: Runner | None = None
) -> tuple[mx.array, mx.array]:
    """(codes float32 [..., K], scales float32 [..., K / group or 1]): `numerics.a8_codes` in
    one launch, bit for bit."""
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    g = k if group == -1 else group
    launch = Launch(
        A8_QUANTIZE,
        [x.reshape(m, k), k, g],
        [],
        grid=(32, m * (k // g), 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(m, k), (m, k // g)],
        output_dtypes=[mx.float32, mx.float32],
    )
    q, scale = run(launch, runner)
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], k // g)


def dual_plane_matmul(
    x: mx.array,
    hi: mx.array,
    lo: mx.array,
    scales: mx.array,
    *,
    draft: bool,
    a8_group: int | None = None,
    gate_up: bool = False,
    runner: Runner | None = None,
) -> mx.array:
    """x [..., K] (at most 8 rows) -> [..., N]: x·W4ᵀ (draft) or x·W8ᵀ (target).

    The weight group (32, 64 or 128) is K / the scales' last dim. With `a8_group` (-1: per
    token, or a group `a8_fusable` accepts) x is quantized to A8 by the rule of `numerics.a8`
    (inside the launch for passes of up to A8_IN_KERNEL_MAX_ROWS rows, else by one
    `a8_quantize` launch first): the result equals the pure path on `a8(x, a8_group)` up to
    float rounding. With `gate_up`, the planes are [gate; up] stacked (N rows = 2 × outputs)
    and the result is silu(x·gateᵀ) · (x·upᵀ), [..., N / 2]. The result has x's dtype.
    """
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    if a8_group is None:
        return _launch(x, None, 0, 0, hi, lo, scales, draft, gate_up, x.dtype, runner)
    if not a8_fusable(a8_group, k):
        raise ValueError(f"dual_plane_matmul: A8 group {a8_group} does not fit K = {k}")
    ag = max(a8_group, 0)
    if _a8_in_kernel(a8_group, m):
        return _launch(x, None, 2, ag, hi, lo, scales, draft, gate_up, x.dtype, runner)
    codes, a_scale = a8_quantize(x, a8_group, runner)
    return _launch(codes, a_scale, 1, ag, hi, lo, scales, draft, gate_up, x.dtype, runner)


@cache
def _unused_scale() -> mx.array:
    """The `ascale` input of a launch that reads none: made and evaluated once, not a kernel
    per call."""
    one = mx.ones((1,), mx.float32)
    mx.eval(one)
    return one


def _launch(
    x, a_scale, a8: int, ag: int, hi, lo, scales, draft, gate_up, dtype, runner
) -> mx.array:
    """One dual-plane launch, y in `dtype`; a8: 0 (x as it is), 1 (x holds codes, a_scale
    their scales) or 2 (quantized in the launch), at A8 group `ag` (0: per token)."""
    k = x.shape[-1]
    n = hi.shape[0]
    m = math.prod(x.shape[:-1])
    n_out = n // 2 if gate_up else n
    per_sg = 2 if gate_up else 4
    ascale = _unused_scale() if a_scale is None else a_scale.reshape(m, -1)
    launch = Launch(
        DUAL_PLANE,
        [x.reshape(m, k), ascale, hi, lo, scales, n, k],
        [
            ("T", dtype),
            ("M", m),
            ("TARGET", not draft),
            ("GS", _weight_group(k, scales)),
            ("A8", a8),
            ("AG", ag),
            ("GATE_UP", gate_up),
        ],
        grid=(32, (n_out + per_sg - 1) // per_sg, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(m, n_out)],
        output_dtypes=[dtype],
    )
    (y,) = run(launch, runner)
    return y.reshape(*x.shape[:-1], n_out)
