"""The dual-plane (W4 draft / W8 target) small-M matmul: A8 codes against nibble planes."""

from __future__ import annotations

import math
from functools import cache

import mlx.core as mx

from ..formats.bitnest.numerics import WEIGHT_GROUPS, a8_codes
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
    """Can the dual-plane kernel take A8 codes at A8 group `group` (-1: per token)?"""
    return group == -1 or (group > 0 and group % LANE_COLS == 0 and k % group == 0)


@cache
def _prescale(draft: bool) -> mx.array:
    """Per column of each 8: the inverse of the power of two at which the kernel decodes its
    code (dual_plane_qmv.metal): 16^-(c % 4) for W4 nibbles, 256^-((c // 2) % 2) for W8 bytes."""
    shift = [4 * (c % 4) if draft else 8 * ((c // 2) % 2) for c in range(8)]
    return mx.array([2.0**-s for s in shift], dtype=mx.float32)


def dual_plane_matmul(
    x: mx.array,
    hi: mx.array,
    lo: mx.array,
    scales: mx.array,
    *,
    draft: bool,
    a_scale: mx.array | None = None,
    gate_up: bool = False,
    runner: Runner | None = None,
) -> mx.array:
    """x [..., K] (at most 8 rows) -> [..., N]: x·W4ᵀ (draft) or x·W8ᵀ (target) in one pass.

    The weight group (32, 64 or 128) is K / the scales' last dim. With `a_scale`, x holds A8
    codes and a_scale their scale per token or per group (`numerics.a8_codes(x, g)`, for a g
    that `a8_fusable` accepts): the result equals the pure path on `a8(x, g)` up to float
    rounding. With `gate_up`, the planes are [gate; up] stacked (N rows = 2 × outputs) and the
    result is silu(x·gateᵀ) · (x·upᵀ), [..., N / 2].
    """
    k = x.shape[-1]
    n = hi.shape[0]
    m = math.prod(x.shape[:-1])
    dtype = scales.dtype
    # Pre-scaled in float32: a power of two times a code (or an x) is exact there, never in fp16.
    xs = (x.reshape(m, k // 8, 8).astype(mx.float32) * _prescale(draft)).reshape(m, k)
    # A8 group in columns, 0 for one scale per token (a single group of K is the same thing).
    a_group = 0 if a_scale is None or a_scale.shape[-1] == 1 else k // a_scale.shape[-1]
    if a_scale is None:
        ascale = mx.ones((m, 1), dtype=mx.float32)
    else:
        ascale = a_scale.reshape(m, -1).astype(mx.float32)
    n_out = n // 2 if gate_up else n
    per_sg = 2 if gate_up else 4
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
            ("GATE_UP", gate_up),
        ],
        grid=(32, (n_out + per_sg - 1) // per_sg, 1),
        threadgroup=(32, 2, 1),
        output_shapes=[(m, n_out)],
        output_dtypes=[dtype],
    )
    (y,) = run(launch, runner)
    # Codes carry no dtype of their own: with A8 the result is in the scales' dtype.
    return y.reshape(*x.shape[:-1], n_out).astype(x.dtype if a_scale is None else dtype)


def dual_plane_a8_matmul(
    x: mx.array,
    hi: mx.array,
    lo: mx.array,
    scales: mx.array,
    *,
    draft: bool,
    group: int = -1,
    gate_up: bool = False,
    runner: Runner | None = None,
) -> mx.array:
    """A8(x) (per token, or per `group` columns) through the kernel: x quantized once, here,
    for every row of the matmul."""
    codes, a_scale = a8_codes(x, group)
    y = dual_plane_matmul(
        codes, hi, lo, scales, draft=draft, a_scale=a_scale, gate_up=gate_up, runner=runner
    )
    return y.astype(x.dtype)
