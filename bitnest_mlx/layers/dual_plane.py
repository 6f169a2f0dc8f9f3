"""Dual-plane Linear: W4 (draft) or W8 (target) over the same two nibble planes, A8 included."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..formats.bitnest.numerics import GROUP_SIZE, WEIGHT_GROUPS, a8, a8_scale, nested
from .options import RunOptions

_DEFAULT = RunOptions()


class DualPlaneLinear(nn.Module):
    """y = A8(x)·W4ᵀ (draft) or A8(x)·W8ᵀ (target), W8 = W4 + lo/16, from two 4-bit planes.

    `hi`/`lo` are the package's uint8 [N, K/2] planes viewed as uint32 [N, K/8] (zero copy),
    which is MLX's affine 4-bit packing with biases = -8·scales, one scale per `group_size`
    columns. The call decides once between the Metal kernel (A8 fused into it) and the pure-MLX
    path (the reference).
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, group_size: int = GROUP_SIZE
    ):
        super().__init__()
        if group_size not in WEIGHT_GROUPS or in_features % group_size:
            raise ValueError(
                f"DualPlaneLinear: group_size {group_size} must be one of {WEIGHT_GROUPS} and "
                f"divide in_features {in_features}"
            )
        self.group_size = group_size
        self.hi = mx.zeros((out_features, in_features // 8), dtype=mx.uint32)
        self.lo = mx.zeros((out_features, in_features // 8), dtype=mx.uint32)
        self.scales = mx.ones((out_features, in_features // group_size))
        self.biases = -8 * self.scales
        if bias:
            self.bias = mx.zeros((out_features,))

    def __call__(
        self, x: mx.array, options: RunOptions | None = None, a8_group: int = -1
    ) -> mx.array:
        """x [..., K] -> [..., N]. With A8 on (options.quantize_activations), x is quantized per
        token (a8_group = -1) or per `a8_group` columns first."""
        return project(x, (self,), options, a8_group)[0]

    def _kernel(self, x: mx.array, a_scale: mx.array | None, draft: bool) -> mx.array:
        return kernels.dual_plane_matmul(
            x, self.hi, self.lo, self.scales, draft=draft, a_scale=a_scale
        )

    def _qmm(self, x: mx.array, plane: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x, plane, self.scales, self.biases, transpose=True, group_size=self.group_size, bits=4
        )

    def _pure(self, x: mx.array, draft: bool, dense_min_rows: int = 0) -> mx.array:
        if dense_min_rows and x.size >= dense_min_rows * x.shape[-1]:
            return x @ self.dequantized(draft).astype(x.dtype).T
        y = self._qmm(x, self.hi)
        # Two calls sharing scales/biases: never materialise s/16 in fp16 (subnormal risk).
        return y if draft else nested(y, self._qmm(x, self.lo))

    def dequantized(self, draft: bool) -> mx.array:
        """W4 (draft) or W8 (target) as a dense [N, K] matrix in the scales' dtype."""
        kw = dict(group_size=self.group_size, bits=4)
        w = mx.dequantize(self.hi, self.scales, self.biases, **kw)
        return w if draft else nested(w, mx.dequantize(self.lo, self.scales, self.biases, **kw))

    def _biased(self, y: mx.array) -> mx.array:
        return y + self.bias if "bias" in self else y

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


def project(
    x: mx.array,
    linears: Sequence[DualPlaneLinear],
    options: RunOptions | None = None,
    a8_group: int = -1,
) -> list[mx.array]:
    """x through Linears that all read it (q/k/v, gate/up): A8 applied once (on the kernel path,
    its scale computed once and x quantized inside each kernel) and one kernel-or-pure decision.
    """
    o = options or _DEFAULT
    group = a8_group if o.quantize_activations else None
    if (
        o.use_kernels
        and kernels.use("dual_plane", kernel_self_test)
        and kernels.dual_plane_supported(x, linears[0].hi, linears[0].scales)
    ):
        path = "kernel"
        fused = group is not None and kernels.a8_fusable(group, x.shape[-1])
        x_in = x if fused or group is None else a8(x, group)
        a_scale = a8_scale(x, group) if fused else None
        ys = [lin._kernel(x_in, a_scale, o.draft) for lin in linears]
    else:
        path = "pure"
        x_in = x if group is None else a8(x, group)
        ys = [lin._pure(x_in, o.draft, o.dense_min_rows) for lin in linears]
    for _ in linears:
        kernels.record("dual_plane", path)
    return [lin._biased(y) for lin, y in zip(linears, ys)]


def kernel_self_test(runner: kernels.Runner | None = None) -> tuple[mx.array, mx.array]:
    """(kernel, pure) on small random Linears with target planes, one per weight group size;
    A8 per token at 128, per 64 and per 128 columns (o_proj's per-head groups) at 64 and 32."""
    got, want = [], []
    cases = ((128, -1), (64, 64), (32, 128))  # (weight group, A8 group): every WEIGHT_GROUPS
    for i, (group_size, a_group) in enumerate(cases):
        k1, k2, k3, k4 = mx.random.split(mx.random.key(1 + i), 4)
        lin = DualPlaneLinear(256, 12, group_size=group_size)
        lin.hi = mx.random.randint(0, 2**31, (12, 32), key=k1).astype(mx.uint32)
        lin.lo = mx.random.randint(0, 2**31, (12, 32), key=k2).astype(mx.uint32)
        # A different scale per group, so that reading the wrong group shows.
        lin.scales = mx.random.uniform(0.005, 0.02, lin.scales.shape, key=k3)
        lin.biases = -8 * lin.scales
        x = mx.random.normal((3, 256), key=k4)
        a_scale = a8_scale(x, a_group)
        got.append(
            kernels.dual_plane_matmul(
                x, lin.hi, lin.lo, lin.scales, draft=False, a_scale=a_scale, runner=runner
            )
        )
        want.append(lin._pure(a8(x, a_group), draft=False))
    return mx.concatenate(got, axis=-1), mx.concatenate(want, axis=-1)
