"""Metal kernels for the decode hot paths, with the pure-MLX path as reference and fallback.

Each kernel's body lives in `bitnest_mlx/metal_kernels/<file>.metal` (helpers in `common.metal`)
and is built into an `mx.fast.metal_kernel` once per process. Every public function here plans a
launch (`Launch`: inputs, template, grid, output shapes) and hands it to a runner: on Metal the
real kernel; in the test suite the CPU emulator (tests/metal_emu), which compiles the exact
source MLX generates. Layers ask `use(name, self_test)` before routing here; it is true only on
Metal, when `BITNEST_MLX_KERNELS` is not "0", and after the layer's first-use self-test (its kernel
against its own pure path, passed in by the layer: this module knows no layer) passed. On a
mismatch it warns once and the pure path is used for the rest of the process.
"""

from __future__ import annotations

import math
import os
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources

import mlx.core as mx

from .formats.bitnest.numerics import WEIGHT_GROUPS

MAX_M = 8  # dual-plane small-M limit: decode (1) and γ+1 verification
# Columns one lane of the dual-plane kernel reads at a time under a single weight scale and A8
# scale: every weight group and fused A8 group must be a multiple of it.
LANE_COLS = 16
KV_NSG = 4  # simdgroups per threadgroup in the attention read
KV_MAX_ROWS = 1024  # QN · D floats per simdgroup in threadgroup memory (16 KB for 4 simdgroups)


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its .metal body, argument names and the attributes of the generated source."""

    name: str
    file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    @property
    def source(self) -> str:
        return _read(self.file)

    @property
    def header(self) -> str:
        return _read("common.metal")

    def build(self):
        return _build(self)


@cache
def _read(file: str) -> str:
    return resources.files("bitnest_mlx.metal_kernels").joinpath(file).read_text()


@cache
def _build(spec: KernelSpec):
    # Built once per process: MLX caches the compiled library by name + source hash.
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        header=spec.header,
    )


DUAL_PLANE = KernelSpec(
    "bitnest_dual_plane_qmv",
    "dual_plane_qmv.metal",
    ("x", "ascale", "hi", "lo", "scales", "N", "K"),
    ("y",),
)
NESTED_KV = KernelSpec(
    "bitnest_nested_kv_attention",
    "nested_kv_attention.metal",
    (
        "q",
        "k_hi",
        "k_lo",
        "k_scales",
        "v_hi",
        "v_lo",
        "v_scales",
        "n_q_heads",
        "n_kv_heads",
        "L",
        "n_kv",
        "t_cap",
        "scale",
    ),
    ("o",),
)
MXTQ_GATHER = KernelSpec(
    "bitnest_mxtq_gather_qmv",
    "mxtq_gather_qmv.metal",
    ("x", "idx", "packed", "norms", "codebook", "in_features", "out_features", "xdiv"),
    ("y",),
)
HADAMARD = KernelSpec("bitnest_hadamard_rotate", "hadamard_rotate.metal", ("x", "signs"), ("y",))
SPECS = (DUAL_PLANE, NESTED_KV, MXTQ_GATHER, HADAMARD)


@dataclass
class Launch:
    """Everything one kernel call needs; runners turn it into output arrays."""

    spec: KernelSpec
    inputs: list
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    init_value: float | None = None


Runner = Callable[[Launch], list[mx.array]]


def metal_runner(launch: Launch, verbose: bool = False) -> list[mx.array]:
    return launch.spec.build()(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        init_value=launch.init_value,
        verbose=verbose,
    )


# ---------------------------------------------------------------- dual-plane matmul (+ A8)


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
    (y,) = (runner or metal_runner)(launch)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


# ---------------------------------------------------------------- nested-KV attention read


def nested_kv_supported(q: mx.array, mask, head_dim: int, group: int) -> bool:
    """Decode and short verification chunks with a causal (or no) mask over nibble planes."""
    L = q.shape[2]
    causal = (L == 1 and mask is None) or (isinstance(mask, str) and mask == "causal")
    return (
        causal
        and L <= MAX_M
        and head_dim in (64, 128, 256)
        and group % (head_dim // 32) == 0
        and head_dim % group == 0
    )


def nested_kv_attention(
    q: mx.array,
    k_planes: tuple[mx.array, mx.array, mx.array],
    v_planes: tuple[mx.array, mx.array, mx.array],
    *,
    draft: bool,
    scale: float,
    group: int,
    n_kv: int | None = None,
    runner: Runner | None = None,
) -> mx.array:
    """softmax(q Kᵀ·scale + causal) V with K, V read as KV4/KV8 from (hi, lo, scales) planes.

    q [B, Hq, L, D]; planes [B, Hkv, T_cap, D/8] uint32 and scales [B, Hkv, T_cap, D/group]
    float32 with the first `n_kv` (default T_cap) positions valid; the L queries are the last
    L positions. Returns [B, Hq, L, D] in q's dtype.
    """
    B, Hq, L, D = q.shape
    k_hi, k_lo, k_s = k_planes
    v_hi, v_lo, v_s = v_planes
    Hkv, t_cap = k_hi.shape[1], k_hi.shape[2]
    n_kv = t_cap if n_kv is None else n_kv
    rows = (Hq // Hkv) * L
    qn = min(rows, MAX_M, KV_MAX_ROWS // D)
    chunks = (rows + qn - 1) // qn
    dtype = q.dtype if q.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32
    launch = Launch(
        NESTED_KV,
        [q.astype(dtype), k_hi, k_lo, k_s, v_hi, v_lo, v_s, Hq, Hkv, L, n_kv, t_cap, scale],
        [("T", dtype), ("D", D), ("G", group), ("QN", qn), ("NSG", KV_NSG), ("TARGET", not draft)],
        grid=(32, KV_NSG, B * Hkv * chunks),
        threadgroup=(32, KV_NSG, 1),
        output_shapes=[(B, Hq, L, D)],
        output_dtypes=[dtype],
    )
    (o,) = (runner or metal_runner)(launch)
    return o


# ---------------------------------------------------------------- MXTQ experts and rotation


def mxtq_gather_matvec(
    x_rot: mx.array,
    indices: mx.array,
    packed: mx.array,
    norms: mx.array,
    codebook: mx.array,
    bits: int,
    runner: Runner | None = None,
) -> mx.array:
    """Routed experts at M = 1: x_rot [..., 1|K, in] float32, indices [..., K] -> [..., K, out].

    x_rot with one row per token (gate/up) is shared by its K slots; with K rows (down) each slot
    reads its own. The result includes the row norms (float32).
    """
    k = indices.shape[-1]
    in_f = x_rot.shape[-1]
    out_f = packed.shape[-2]
    slots = indices.size
    shared = x_rot.shape[-2] == 1 and k > 1
    xs = x_rot.reshape(-1, in_f).astype(mx.float32)
    launch = Launch(
        MXTQ_GATHER,
        [
            xs,
            indices.reshape(-1).astype(mx.uint32),
            packed,
            norms,
            codebook,
            in_f,
            out_f,
            k if shared else 1,
        ],
        [("BITS", bits)],
        grid=(32, (out_f + 7) // 8, slots),
        threadgroup=(32, 2, 1),
        output_shapes=[(slots, out_f)],
        output_dtypes=[mx.float32],
    )
    (y,) = (runner or metal_runner)(launch)
    return y.reshape(*indices.shape, out_f)


def mxtq_gather_supported(x_rot: mx.array, indices: mx.array, bits: int) -> bool:
    """M = 1 decode shapes the kernel maps without broadcasting copies."""
    if bits not in (2, 4) or x_rot.ndim < 2:
        return False
    lead, rows = x_rot.shape[:-2], x_rot.shape[-2]
    return lead == indices.shape[:-1] and rows in (1, indices.shape[-1])


def hadamard_supported(d: int) -> bool:
    return 128 <= d <= 4096 and d & (d - 1) == 0


def hadamard_rotate(x: mx.array, signs: mx.array, runner: Runner | None = None) -> mx.array:
    """R x = H_d (signs ⊙ x) / √d along the last axis (d a power of two, 128..4096), float32."""
    d = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    launch = Launch(
        HADAMARD,
        [x.reshape(rows, d), signs.astype(mx.float32)],
        [("E", d // 128)],
        grid=(128, rows, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(rows, d)],
        output_dtypes=[mx.float32],
    )
    (y,) = (runner or metal_runner)(launch)
    return y.reshape(x.shape)


# ---------------------------------------------------------------- dispatch, self-test, report


@dataclass
class _State:
    status: dict[str, str] = field(default_factory=dict)  # name -> "ok" | "failed: ..."
    calls: Counter = field(default_factory=Counter)  # (name, "kernel" | "pure") -> count


_state = _State()


@cache
def _metal() -> bool:
    return mx.metal.is_available() and os.environ.get("BITNEST_MLX_KERNELS", "1") != "0"


SelfTest = Callable[[Runner | None], tuple[mx.array, mx.array]]


def use(name: str, self_test: SelfTest) -> bool:
    """Should the layer route to kernel `name`? At first use runs `self_test` (from the layer:
    kernel output via the runner it is given vs the layer's pure path) and remembers the verdict."""
    if not _metal():
        return False
    if name not in _state.status:
        _state.status[name] = check(self_test)
        if _state.status[name] != "ok":
            warnings.warn(
                f"bitnest_mlx: Metal kernel {name!r} failed its self-test "
                f"({_state.status[name]}); using the pure-MLX path",
                RuntimeWarning,
                stacklevel=3,
            )
    return _state.status[name] == "ok"


def record(name: str, path: str) -> None:
    """Count which path served a call (for `bitnest_mlx.bench`); cheap, host-side only."""
    _state.calls[(name, path)] += 1


def report() -> dict:
    """{kernel: {"status": ..., "kernel": calls, "pure": calls}} for the kernels seen so far."""
    names = sorted({n for n, _ in _state.calls} | set(_state.status))
    return {
        n: {
            "status": _state.status.get(n, "not tested" if _metal() else "no Metal"),
            "kernel": _state.calls[(n, "kernel")],
            "pure": _state.calls[(n, "pure")],
        }
        for n in names
    }


def check(self_test: SelfTest, runner: Runner | None = None) -> str:
    """Run a layer's kernel-vs-pure comparison; "ok" or the reason for falling back."""
    try:
        got, want = self_test(runner)
        mx.eval(got, want)
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        tol = 1e-3 * max(1.0, mx.abs(want.astype(mx.float32)).max().item())
        return "ok" if err <= tol else f"max error {err:.3g} > {tol:.3g}"
    except Exception as e:  # a compile error on some Metal version must not break generation
        return f"{type(e).__name__}: {e}"
