"""Numeric building blocks DeepSeek-V4 uses that are not its architecture.

The reference runs FP8 / FP4 activations; a float model matches it only by simulating those
roundings (QAT), so they live here, next to the partial RoPE the DSV4 heads share. Nothing here
knows a layer schedule or a checkpoint name.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import YarnRoPE


class PartialRoPE(nn.Module):
    """Interleaved RoPE on the *last* `dims` channels (DSV4 heads are [nope | rope]).

    YaRN frequencies without the attention temperature: the reference rotates by unit-modulus
    factors, so mscale is pinned to 1. A plain table is YaRN with factor 1.
    """

    def __init__(self, dims: int, base: float, yarn: dict | None):
        super().__init__()
        yarn = yarn or {}
        self.dims = dims
        self.rope = YarnRoPE(
            dims,
            traditional=True,
            base=base,
            scaling_factor=yarn.get("factor", 1.0),
            original_max_position_embeddings=yarn.get("original_max_position_embeddings", 4096),
            beta_fast=yarn.get("beta_fast", 32),
            beta_slow=yarn.get("beta_slow", 1),
            mscale=1,
            mscale_all_dim=1,
        )
        self._freqs = {}  # (width, inverse) -> the periods of all width / 2 pairs

    def __call__(
        self, x: mx.array, offset: int, scale: float = 1.0, inverse: bool = False
    ) -> mx.array:
        """x [..., T, D]: row i is rotated at position (offset + i) · scale.

        One mx.fast.rope over all D channels, no slice and concatenation: the D - dims leading
        channels' pairs get an infinite period, so they turn by angle 0 (cos 1, sin 0) and keep
        their values (a zero may change sign)."""
        width = x.shape[-1]
        return mx.fast.rope(
            x,
            width,
            traditional=True,
            base=None,
            scale=scale,
            offset=offset,
            freqs=self.periods(width, inverse),
        )

    def periods(self, width: int, inverse: bool = False) -> mx.array:
        """The rope periods of a width-channel head (negated: the inverse rotation), made once
        per width: made per call, they would be a kernel a call."""
        key = (width, inverse)
        if key not in self._freqs:
            still = mx.full(((width - self.dims) // 2,), mx.inf)
            freqs = mx.concatenate([still, self.rope._freqs])
            self._freqs[key] = -freqs if inverse else freqs
        return self._freqs[key]


def fp8_fake_quant(x: mx.array, block: int = 64) -> mx.array:
    """QAT simulation of the reference's FP8 e4m3 activations (power-of-two block scales)."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block).astype(mx.float32)
    amax = mx.maximum(mx.abs(xb).max(axis=-1, keepdims=True), 1e-4)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 448.0)))
    q = mx.from_fp8(mx.to_fp8(mx.clip(xb / scale, -448.0, 448.0)), mx.float32) * scale
    return q.reshape(x.shape).astype(x.dtype)


def fp4_fake_quant(x: mx.array, block: int = 32) -> mx.array:
    """QAT simulation of FP4 e2m1 (grid 0, .5, 1, 1.5, 2, 3, 4, 6; round half to even)."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block).astype(mx.float32)
    amax = mx.maximum(mx.abs(xb).max(axis=-1, keepdims=True), 6.0 * 2.0**-126)
    scale = mx.power(2.0, mx.ceil(mx.log2(amax / 6.0)))
    y = mx.minimum(mx.abs(xb / scale), 6.0)
    # e2m1 spacing is 0.5 below 2, 1 below 4 and 2 up to 6; mx.round rounds half to even.
    step = mx.where(y < 2.0, 0.5, mx.where(y < 4.0, 1.0, 2.0))
    q = mx.sign(xb) * mx.round(y / step) * step * scale
    return q.reshape(x.shape).astype(x.dtype)


@partial(mx.compile, shapeless=True)  # one kernel for clamp, SiLU, product (and weight)
def swiglu_clamped(
    gate: mx.array, up: mx.array, limit: float, weight: mx.array | None = None
) -> mx.array:
    """The reference clamps gate from above only and up on both sides (none when limit <= 0);
    `weight` (a routed slot's route weight) scales the result.

    Here, not in the model, because the MXTQ experts' fused kernel and its pure path
    (layers/mxtq_linear.py) apply the same rule."""
    if limit > 0:
        gate, up = mx.minimum(gate, limit), mx.clip(up, -limit, limit)
    out = nn.silu(gate) * up
    return out if weight is None else out * weight


def unrolled_sum(parts: list[mx.array]) -> mx.array:
    """((p0 + p1) + p2) + ...: a short reduction as elementwise adds, in the order MLX's
    reductions accumulate, so a compiled chain gives `.sum(axis)`'s bits in one kernel."""
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def hadamard_fp4(x: mx.array) -> mx.array:
    """Indexer QAT: orthonormal Walsh-Hadamard rotation, then FP4 (only the FP4 changes q·k)."""
    return fp4_fake_quant(mx.hadamard_transform(x.astype(mx.float32)))


__all__ = [
    "PartialRoPE",
    "fp8_fake_quant",
    "fp4_fake_quant",
    "hadamard_fp4",
    "swiglu_clamped",
    "unrolled_sum",
]
