"""The dual-plane (W4 draft / W8 target) small-M matmul, with A8 fused."""

from __future__ import annotations

import math

import mlx.core as mx

from ..formats.bitnest.numerics import WEIGHT_GROUPS
from .launch import KernelSpec, Launch, Runner, run

MAX_M = 8  # dual-plane small-M limit: decode (1) and γ+1 verification
# Columns one lane of the dual-plane kernel reads at a time under a single weight scale and A8
# scale: every weight group and fused A8 group must be a multiple of it.
LANE_COLS = 16

DUAL_PLANE = KernelSpec(
    "bitnest_dual_plane_qmv",
    "dual_plane_qmv.metal",
    ("x", "ascale", "hi", "lo", "scales", "N", "K"),
    ("y",),
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
    """Can the dual-plane kernel quantize x itself at A8 group `group` (-1: per token)?"""
    return group == -1 or (group > 0 and group % LANE_COLS == 0 and k % group == 0)


def dual_plane_matmul(
    x: mx.array,
    hi: mx.array,
    lo: mx.array,
    scales: mx.array,
    *,
    draft: bool,
    a_scale: mx.array | None = None,
    runner: Runner | None = None,
) -> mx.array:
    """x [..., K] (at most 8 rows) -> [..., N]: x·W4ᵀ (draft) or x·W8ᵀ (target) in one pass.

    The weight group (32, 64 or 128) is K / the scales' last dim. With `a_scale`
    (`numerics.a8_scale(x)` or `a8_scale(x, g)` for a g that `a8_fusable` accepts) x is quantized
    inside the kernel; the result equals the pure path on `a8(x, g)` up to float rounding.
    """
    k = x.shape[-1]
    n = hi.shape[0]
    m = math.prod(x.shape[:-1])
    dtype = scales.dtype
    xs = x.reshape(m, k).astype(dtype)
    # A8 group in columns, 0 for one scale per token (a single group of K is the same thing).
    a_group = 0 if a_scale is None or a_scale.shape[-1] == 1 else k // a_scale.shape[-1]
    if a_scale is None:
        ascale = mx.ones((m, 1), dtype=mx.float32)
    else:
        ascale = a_scale.reshape(m, -1).astype(mx.float32)
    launch = Launch(
        DUAL_PLANE,
        [xs, ascale, hi, lo, scales, n, k],
        [
            ("T", dtype),
            ("M", m),
            ("TARGET", not draft),
            ("GS", _weight_group(k, scales)),
            ("A8", a_scale is not None),
            ("AG", a_group),
        ],
        grid=(32, (n + 3) // 4, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(m, n)],
        output_dtypes=[dtype],
    )
    (y,) = run(launch, runner)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)
