"""Dual-plane Linear: W4 (draft) or W8 (target) over the same two nibble planes, A8 included."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from ..formats.bitnest.numerics import SEED_GROUP_SIZE, WEIGHT_GROUPS, a8, nested
from . import plane_stack
from .options import RunOptions

_DEFAULT = RunOptions()
_PURE = RunOptions(use_kernels=False)  # the self-tests' reference
# The dense path dequantizes at most this many weights at a time (64 MB in float32).
DENSE_BLOCK_WEIGHTS = 2**24


class DualPlaneLinear(nn.Module):
    """y = A8(x)·W4ᵀ (draft) or A8(x)·W8ᵀ (target), W8 = W4 + lo/16, from two 4-bit planes.

    `hi`/`lo` are the package's uint8 [N, K/2] planes viewed as uint32 [N, K/8] (zero copy),
    which is MLX's affine 4-bit packing with biases = -8·scales, one scale per `group_size`
    columns. The call decides once between the Metal kernel (A8 fused into it) and the pure-MLX
    path (the reference).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        group_size: int = SEED_GROUP_SIZE,
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
        self,
        x: mx.array,
        options: RunOptions | None = None,
        a8_group: int = -1,
        residual: mx.array | None = None,
    ) -> mx.array:
        """x [..., K] -> [..., N] (+ `residual` [..., N]). With A8 on
        (options.quantize_activations), x is quantized per token (a8_group = -1) or per
        `a8_group` columns first. The residual is added in the pure target path's epilogue (one
        kernel with W8 = hi + lo/16), else after."""
        return project(x, (self,), options, a8_group, residual=residual)[0]

    def _kernel(self, x: mx.array, a8_group: int | None, draft: bool) -> mx.array:
        return kernels.dual_plane_matmul(
            x, self.hi, self.lo, self.scales, draft=draft, a8_group=a8_group
        )

    def _pure(self, x: mx.array, draft: bool, dense_min_rows: int = 0) -> mx.array:
        kept = getattr(self, "kept_dense", None)  # `keep_dense`: W4 and W8 as float matrices
        if kept is not None:
            return x @ kept[draft].astype(x.dtype).T
        if dense_min_rows and x.size >= dense_min_rows * x.shape[-1]:
            # The input first: in one lazy graph of a whole model MLX computes the weight-only
            # dequantizations early, so every layer's dense weights would be alive at once
            # (GBs for a 0.5B). Long teacher-forced passes do not notice the sync.
            mx.eval(x)
            n = self.hi.shape[0]
            block = max(1, DENSE_BLOCK_WEIGHTS // x.shape[-1])
            ys = []
            for r in range(0, n, block):  # an lm_head's rows a block at a time, same reason
                rows = slice(r, min(r + block, n))
                ys.append(x @ self.dequantized(draft, rows).astype(x.dtype).T)
                if n > block:
                    mx.eval(ys[-1])
            return ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=-1)
        return planes_matmul(x, self, self.group_size, draft)

    def dequantized(self, draft: bool, rows: slice = slice(None)) -> mx.array:
        """W4 (draft) or W8 (target) as a dense [N, K] matrix (those `rows`) in the scales'
        dtype."""
        kw = dict(group_size=self.group_size, bits=4)
        scales, biases = self.scales[rows], self.biases[rows]
        w = mx.dequantize(self.hi[rows], scales, biases, **kw)
        return w if draft else nested(w, mx.dequantize(self.lo[rows], scales, biases, **kw))

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


def planes_matmul(x: mx.array, planes, group_size: int, draft: bool) -> mx.array:
    """x·W4ᵀ or x·W8ᵀ by MLX's quantized matmul on `planes` (hi, lo, scales, biases: a
    Linear's or a stack's): two calls sharing scales and biases for W8, so that s/16 is never
    materialised in fp16 (subnormal risk)."""
    y_hi, y_lo = plane_products(x, planes, group_size, draft)
    return y_hi if y_lo is None else nested(y_hi, y_lo)


def plane_products(
    x: mx.array, planes, group_size: int, draft: bool
) -> tuple[mx.array, mx.array | None]:
    """(x·hiᵀ, x·loᵀ) as `planes_matmul` computes them before nesting (lo None: the draft)."""

    def qmm(plane: mx.array) -> mx.array:
        return mx.quantized_matmul(
            x, plane, planes.scales, planes.biases, transpose=True, group_size=group_size, bits=4
        )

    return qmm(planes.hi), None if draft else qmm(planes.lo)


# SiLU(gate)·up after the matmuls as one kernel (nn.silu and the product would be two), and on the
# pure target path with W8 = hi + lo/16 of both outputs inside it too: the same ops in the same
# dtypes, so the same bits.
@partial(mx.compile, shapeless=True)
def _silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _silu_mul_nested(gate_hi, up_hi, gate_lo, up_lo) -> mx.array:
    return nn.silu(nested(gate_hi, gate_lo)) * nested(up_hi, up_lo)


@partial(mx.compile, shapeless=True)
def _nested_plus(y_hi: mx.array, y_lo: mx.array, residual: mx.array) -> mx.array:
    return residual + nested(y_hi, y_lo)


def keep_dense(model: nn.Module) -> int:
    """Keep every DualPlaneLinear's W4 and W8 as dense float32 matrices (8 bytes per weight)
    for the pure path to multiply: on a CPU a matmul of M rows then costs one read of floats
    whatever M, instead of M quantized matvecs. Same numerics as the dense path
    (`RunOptions.dense_min_rows`): equal to the quantized path up to float rounding. For long
    CPU measurements (`bench --workloads --dense-weights`); returns the bytes kept."""
    kept = 0
    for m in model.modules():
        if isinstance(m, DualPlaneLinear):
            weights = {d: m.dequantized(d).astype(mx.float32) for d in (True, False)}
            mx.eval(weights)
            object.__setattr__(m, "kept_dense", weights)  # not a parameter: never saved
            kept += sum(w.nbytes for w in weights.values())
    return kept


def project(
    x: mx.array,
    linears: Sequence[DualPlaneLinear],
    options: RunOptions | None = None,
    a8_group: int = -1,
    groups: Sequence[int] | None = None,
    residual: mx.array | None = None,
) -> list[mx.array]:
    """x through Linears that all read it (q/k/v): A8 applied once and one kernel-or-pure
    decision. On the kernel path x is quantized to A8 codes once per call (per token, not per
    row) and the Linears' planes, stacked along N (`plane_stack`), are one launch.

    `groups`: how many consecutive Linears each returned array holds, their outputs side by side
    along the last axis (q and k as one array for one RoPE launch); None: one each. Stacked
    outputs come back as slices of the one result, so a group costs no copy. `residual`: added
    to the one Linear's output (see `DualPlaneLinear.__call__`)."""
    assert residual is None or len(linears) == 1, "a residual is added to one Linear's output"
    return _through(x, linears, options, a8_group, False, groups, residual)


def swiglu(
    x: mx.array,
    gate: DualPlaneLinear,
    up: DualPlaneLinear,
    options: RunOptions | None = None,
) -> mx.array:
    """silu(x·gateᵀ) · (x·upᵀ), A8 on x once. On the kernel path gate and up are one launch on
    their stacked planes with the SiLU and the product in its epilogue."""
    return _through(x, (gate, up), options, -1, gate_up=True)[0]


def _through(
    x: mx.array,
    linears: Sequence[DualPlaneLinear],
    options: RunOptions | None,
    a8_group: int,
    gate_up: bool,
    groups: Sequence[int] | None = None,
    residual: mx.array | None = None,
) -> list[mx.array]:
    """The Linears' outputs (gate_up: [silu(gate)·up]; `groups` and `residual` as `project`
    takes them) by the kernel or the pure path."""
    o = options or _DEFAULT
    group = a8_group if o.quantize_activations else None
    if not _kernel_path(x, linears, o):
        x_in = x if group is None else a8(x, group)
        if residual is not None and _residual_fusable(linears[0], o):
            (lin,) = linears
            _record(linears, "pure")
            return [_nested_plus(*plane_products(x_in, lin, lin.group_size, False), residual)]
        if not _pure_stackable(x_in, linears, o.dense_min_rows):
            ys = [lin._pure(x_in, o.draft, o.dense_min_rows) for lin in linears]
            return _finish(linears, ys, "pure", gate_up, groups, residual)
        # One quantized matmul per plane for the group: each output row is computed as the
        # Linear's own call computes it, so the values are the same.
        stack = plane_stack.stacked_planes(linears)
        y_hi, y_lo = plane_products(x_in, stack, linears[0].group_size, o.draft)
        if gate_up and _epilogue_fusable(linears):
            _record(linears, "pure")
            if y_lo is None:
                return [_silu_mul(*_split_rows(y_hi, linears))]
            return [_silu_mul_nested(*_split_rows(y_hi, linears), *_split_rows(y_lo, linears))]
        y = y_hi if y_lo is None else nested(y_hi, y_lo)
        return _finish(linears, y, "pure", gate_up, groups, residual)
    # A8 inside the launch where the kernel can reduce the group's scale, else quantized first.
    fusable = group is not None and kernels.a8_fusable(group, x.shape[-1])
    x_in = x if fusable or group is None else a8(x, group)
    a8_group = group if fusable else None
    if not plane_stack.stackable(linears):
        ys = [lin._kernel(x_in, a8_group, o.draft) for lin in linears]
        return _finish(linears, ys, "kernel", gate_up, groups, residual)
    s = plane_stack.stacked_planes(linears)
    fused = gate_up and _epilogue_fusable(linears)
    y = kernels.dual_plane_matmul(
        x_in, s.hi, s.lo, s.scales, draft=o.draft, a8_group=a8_group, gate_up=fused
    )
    if fused:
        _record(linears, "kernel")
        return [y]
    return _finish(linears, y, "kernel", gate_up, groups, residual)


def _kernel_path(x: mx.array, linears: Sequence[DualPlaneLinear], o: RunOptions) -> bool:
    """Whether the call runs the Metal kernel (allowed, self-tested, a shape it serves)."""
    return (
        o.use_kernels
        and kernels.use("dual_plane", kernel_self_test)
        and kernels.dual_plane_supported(x, linears[0].hi, linears[0].scales)
    )


def _residual_fusable(lin: DualPlaneLinear, o: RunOptions) -> bool:
    """Can the pure path add a residual in W8's epilogue: a target call, the Linear's own planes
    (not a stand-in with its own `_pure`, not dense weights or a dense pass), no bias between."""
    planes = all(p in lin for p in plane_stack.PLANES)
    dense = o.dense_min_rows or hasattr(lin, "kept_dense")
    return planes and not (o.draft or dense or "bias" in lin)


def _epilogue_fusable(linears: Sequence[DualPlaneLinear]) -> bool:
    """SiLU·up right after the matmul needs gate and up of one width and no bias between the
    dot and the SiLU."""
    return linears[0].hi.shape == linears[1].hi.shape and not any("bias" in lin for lin in linears)


def _record(linears: Sequence[DualPlaneLinear], path: str) -> None:
    for _ in linears:
        kernels.record("dual_plane", path)


def _split_rows(
    y: mx.array, linears: Sequence[DualPlaneLinear], groups: Sequence[int] | None = None
) -> list[mx.array]:
    """A stacked launch's output [..., ΣN] -> each Linear's [..., N] (or each group's: their
    outputs side by side)."""
    rows = [lin.hi.shape[0] for lin in linears]
    ends = _group_ends(len(linears), groups)
    return mx.split(y, [sum(rows[:e]) for e in ends[:-1]], axis=-1)


def _group_ends(n: int, groups: Sequence[int] | None) -> list[int]:
    """The index after each group's last Linear (one group per Linear for None)."""
    sizes = groups or [1] * n
    assert sum(sizes) == n, f"groups {list(sizes)} do not add up to {n} Linears"
    return [sum(sizes[: i + 1]) for i in range(len(sizes))]


def _pure_stackable(x: mx.array, linears: Sequence[DualPlaneLinear], dense_min_rows: int) -> bool:
    """Can the pure path run the group as one stack: quantized matmuls on both (no dense
    weights kept, no dense pass) and planes of one shape and group."""
    dense = dense_min_rows and x.size >= dense_min_rows * x.shape[-1]
    return (
        not dense
        and plane_stack.stackable(linears)
        and all(lin.group_size == linears[0].group_size for lin in linears)
        and not any(hasattr(lin, "kept_dense") for lin in linears)
    )


def _finish(
    linears: Sequence[DualPlaneLinear],
    y: mx.array | Sequence[mx.array],
    path: str,
    gate_up: bool,
    groups: Sequence[int] | None = None,
    residual: mx.array | None = None,
) -> list[mx.array]:
    """`_outputs`, and `residual` added to the one Linear's output when given."""
    _record(linears, path)
    out = _outputs(linears, y, gate_up, groups)
    return out if residual is None else [residual + out[0]]


def _outputs(
    linears: Sequence[DualPlaneLinear],
    y: mx.array | Sequence[mx.array],
    gate_up: bool,
    groups: Sequence[int] | None,
) -> list[mx.array]:
    """Each Linear's bias added to its own output (after the kernel), then silu(gate)·up or
    the outputs joined in `groups`. `y`: the stacked output [..., ΣN] or one per Linear."""
    biased = any("bias" in lin for lin in linears)
    if isinstance(y, mx.array) and not (biased or gate_up):
        return _split_rows(y, linears, groups)
    ys = _split_rows(y, linears) if isinstance(y, mx.array) else list(y)
    ys = [lin._biased(y) for lin, y in zip(linears, ys)]
    if gate_up:
        return [_silu_mul(ys[0], ys[1])]
    starts = [0, *_group_ends(len(linears), groups)]
    return [
        ys[a] if b - a == 1 else mx.concatenate(ys[a:b], axis=-1)
        for a, b in zip(starts, starts[1:])
    ]


def matmul_self_test(
    runner: kernels.Runner | None = None,
    *,
    rows: int = 1,
    group_size: int = 128,
    a_group: int = -1,
    draft: bool = False,
    seed: int = 1,
    big: bool = False,
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) one dual-plane A8 matmul of `rows` tokens: K = 1152 (two full 512-column
    sweeps and a ragged third, several weight groups per lane), N = 12; A8 per token
    (a_group -1) or per group of columns; big is the timed shape (4096 x 4096)."""
    k, n = (4096, 4096) if big else (1152, 12)
    lin = random_linear(k, n, group_size, seed=seed)
    x = mx.random.normal((rows, k), key=mx.random.key(10 + seed))
    got = kernels.dual_plane_matmul(
        x, lin.hi, lin.lo, lin.scales, draft=draft, a8_group=a_group, runner=runner
    )
    return got, lin._pure(a8(x, a_group), draft=draft)


def grouped_self_test(
    runner: kernels.Runner | None = None, *, gate_up: bool = False, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) one launch over stacked Linears, 4 tokens: q/k/v stacked along N (split
    after), or [gate; up] with the silu(gate)·up epilogue fused."""
    k = 3072 if big else 1152
    small = (6, 6) if gate_up else (16, 8, 8)
    widths = ((8192, 8192) if gate_up else (3072, 1024, 1024)) if big else small
    lins = [random_linear(k, n, 128, seed=20 + i) for i, n in enumerate(widths)]
    x = mx.random.normal((4, k), key=mx.random.key(30))
    got = kernels.dual_plane_matmul(
        x,
        mx.concatenate([lin.hi for lin in lins]),
        mx.concatenate([lin.lo for lin in lins]),
        mx.concatenate([lin.scales for lin in lins]),
        draft=False,
        a8_group=-1,
        gate_up=gate_up,
        runner=runner,
    )
    if gate_up:
        return got, swiglu(x, *lins, _PURE)
    return got, mx.concatenate(project(x, lins, _PURE), axis=-1)


def kernel_self_test(runner: kernels.Runner | None = None) -> tuple[mx.array, mx.array]:
    """(kernel, pure) as a real model calls it, small enough for the first use on a base M1:
    M = 1 and 4 tokens, draft and target, per-token A8 at group 128, per-group A8 (64 and 128
    columns, o_proj's per-head groups) at groups 64 and 32, and the fused gate/up epilogue."""
    # (M, weight group, A8 group, draft): every WEIGHT_GROUPS, both A8 kinds, both planes.
    cases = ((1, 128, -1, True), (4, 128, -1, False), (4, 64, 64, False), (1, 32, 128, True))
    pairs = [
        matmul_self_test(runner, rows=m, group_size=g, a_group=a, draft=d, seed=1 + i)
        for i, (m, g, a, d) in enumerate(cases)
    ]
    pairs.append(grouped_self_test(runner, gate_up=True))
    got, want = zip(*pairs)
    return mx.concatenate([a.reshape(-1) for a in got]), mx.concatenate(
        [a.reshape(-1) for a in want]
    )


def random_linear(k: int, n: int, group_size: int, seed: int) -> DualPlaneLinear:
    """Random planes and a different scale per group (reading the wrong group shows)."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    lin = DualPlaneLinear(k, n, group_size=group_size)
    lin.hi = mx.random.randint(0, 2**31, (n, k // 8), key=k1).astype(mx.uint32)
    lin.lo = mx.random.randint(0, 2**31, (n, k // 8), key=k2).astype(mx.uint32)
    lin.scales = mx.random.uniform(0.005, 0.02, lin.scales.shape, key=k3)
    lin.biases = -8 * lin.scales
    return lin
