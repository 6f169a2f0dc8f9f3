"""Dual-plane Linear (W4 draft / W8 target over the same nibble planes) and the A8 quantizer."""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .. import kernels

GROUP_SIZE = 128


def a8(x: mx.array, group: int = -1) -> mx.array:
    """Symmetric int8 fake-quantization per token (group=-1) or per `group` columns.

    scale = amax/127 (1 where amax == 0), q = clip(round_half_even(x/scale), -128, 127),
    returns q*scale. fp32 math; division (not multiplication by 127/amax) reproduces
    the reference rounding at ties.
    """
    shape, dtype = x.shape, x.dtype
    xf = x.astype(mx.float32)
    if group > 0:
        xf = xf.reshape(*shape[:-1], shape[-1] // group, group)
    amax = mx.abs(xf).max(axis=-1, keepdims=True)
    scale = mx.where(amax == 0, 1.0, amax / 127.0)
    q = mx.clip(mx.round(xf / scale), -128, 127)
    return (q * scale).reshape(shape).astype(dtype)


class A8Input(NamedTuple):
    """x with its A8 still pending (Metal kernel path): the kernel quantizes x with `scale`."""

    x: mx.array
    scale: mx.array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape


def a8_deferred(x: mx.array, group: int = -1) -> A8Input | None:
    """On the Metal kernel path, `a8(x, group)` left to the matmul kernel; else None.

    The per-token (or per-128-group) scale is computed once here, so q/k/v (or gate/up) share
    it, and each kernel quantizes x while loading it.
    """
    rows = x.size // x.shape[-1]
    if group in (-1, GROUP_SIZE) and rows <= kernels.MAX_M and kernels.use("dual_plane"):
        return A8Input(x, kernels.a8_scale(x, group))
    return None


_dense_rows = 0


@contextmanager
def dense_matmul(min_rows: int = 32):
    """Within the block, inputs of at least `min_rows` rows use a dense matmul on the dequantized
    planes. MLX's CPU quantized matmul has no blocked GEMM, so for long teacher-forced passes
    (perplexity) this is never slower and 28x faster with OpenBLAS. Off by default: the quantized
    matmul gives bit-identical rows whatever the batch, which exact cache rollback relies on."""
    global _dense_rows
    saved, _dense_rows = _dense_rows, min_rows
    try:
        yield
    finally:
        _dense_rows = saved


class DualPlaneLinear(nn.Module):
    """y = x·W4ᵀ (draft) or x·W8ᵀ (target), W8 = W4 + qr·s/16, from two 4-bit affine planes.

    `hi`/`lo` are the package's uint8 [N, K/2] planes viewed as uint32 [N, K/8] (zero copy),
    which is MLX's affine 4-bit packing with biases = -8·scales.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.hi = mx.zeros((out_features, in_features // 8), dtype=mx.uint32)
        self.lo = mx.zeros((out_features, in_features // 8), dtype=mx.uint32)
        self.scales = mx.ones((out_features, in_features // GROUP_SIZE))
        self.biases = -8 * self.scales
        if bias:
            self.bias = mx.zeros((out_features,))

    def _qmm(self, x: mx.array, plane: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x, plane, self.scales, self.biases, transpose=True, group_size=GROUP_SIZE, bits=4
        )

    def _pure(self, x: mx.array, draft: bool) -> mx.array:
        if _dense_rows and x.size >= _dense_rows * x.shape[-1]:
            return x @ self.dequantized(draft).astype(x.dtype).T
        y = self._qmm(x, self.hi)
        if not draft:
            # Two calls sharing scales/biases: never materialise s/16 in fp16 (subnormal risk).
            y = y + self._qmm(x, self.lo) * 0.0625
        return y

    def dequantized(self, draft: bool) -> mx.array:
        """W4 (draft) or W8 (target) as a dense [N, K] matrix in the scales' dtype."""
        w = mx.dequantize(self.hi, self.scales, self.biases, group_size=GROUP_SIZE, bits=4)
        if not draft:
            lo = mx.dequantize(self.lo, self.scales, self.biases, group_size=GROUP_SIZE, bits=4)
            w = w + lo * 0.0625
        return w

    def __call__(self, x: mx.array | A8Input, draft: bool = False) -> mx.array:
        if isinstance(x, A8Input):  # only produced when the kernel path is on
            kernels.record("dual_plane", "kernel")
            y = kernels.dual_plane_matmul(
                x.x, self.hi, self.lo, self.scales, draft=draft, a_scale=x.scale
            )
        elif kernels.use("dual_plane") and kernels.dual_plane_supported(x, self.hi):
            kernels.record("dual_plane", "kernel")
            y = kernels.dual_plane_matmul(x, self.hi, self.lo, self.scales, draft=draft)
        else:
            kernels.record("dual_plane", "pure")
            y = self._pure(x, draft)
        if "bias" in self:
            y = y + self.bias
        return y

    @staticmethod
    def prepare(tensors: dict, prefix: str, dtype: mx.Dtype) -> dict:
        """Package tensors of one Linear -> this module's parameters in `dtype`."""
        scales = tensors[f"{prefix}.scales"].astype(dtype)
        out = {
            f"{prefix}.hi": tensors[f"{prefix}.hi"].view(mx.uint32),
            f"{prefix}.lo": tensors[f"{prefix}.lo"].view(mx.uint32),
            f"{prefix}.scales": scales,
            f"{prefix}.biases": -8 * scales,
        }
        if f"{prefix}.bias" in tensors:
            out[f"{prefix}.bias"] = tensors[f"{prefix}.bias"].astype(dtype)
        return out
