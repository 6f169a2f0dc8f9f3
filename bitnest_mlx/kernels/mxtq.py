"""MXTQ routed experts (gather + codebook + dot) and the Hadamard rotation of their input."""

from __future__ import annotations

import math

import mlx.core as mx

from .launch import KernelSpec, Launch, Runner, run

MXTQ_GATHER = KernelSpec(
    "bitnest_mxtq_gather_qmv",
    "mxtq_gather_qmv.metal",
    ("x", "idx", "packed", "norms", "codebook", "in_features", "out_features", "xdiv"),
    ("y",),
)
MXTQ_SWIGLU = KernelSpec(
    "bitnest_mxtq_gather_swiglu",
    "mxtq_gather_swiglu.metal",
    (
        "x",
        "idx",
        "packed_g",
        "norms_g",
        "packed_u",
        "norms_u",
        "codebook",
        "route_w",
        "in_features",
        "out_features",
        "k",
        "limit",
    ),
    ("h",),
)
HADAMARD = KernelSpec("bitnest_hadamard_rotate", "hadamard_rotate.metal", ("x", "signs"), ("y",))

# Output rows per simdgroup. jang measured 20 faster than 8 (more loads in flight per x value
# and fewer threadgroups); 16 keeps that while dividing DeepSeek-V4's 2048 / 4096 / 7168 rows
# (20 leaves a ragged simdgroup per slot that re-reads clamped rows), and the fused gate/up
# kernel's 2 x 16 accumulators plus 16 x values (2 bits) stay well inside the register file.
MXTQ_ROWS = 16
MXTQ_SIMDGROUPS = 2  # per threadgroup


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
        [("BITS", bits), ("ROWS", MXTQ_ROWS)],
        grid=(32, -(-out_f // MXTQ_ROWS), slots),
        threadgroup=(32, MXTQ_SIMDGROUPS, 1),
        output_shapes=[(slots, out_f)],
        output_dtypes=[mx.float32],
    )
    (y,) = run(launch, runner)
    return y.reshape(*indices.shape, out_f)


def mxtq_gather_swiglu(
    x_rot: mx.array,
    indices: mx.array,
    gate: tuple[mx.array, mx.array],
    up: tuple[mx.array, mx.array],
    codebook: mx.array,
    bits: int,
    limit: float,
    route_w: mx.array,
    runner: Runner | None = None,
) -> mx.array:
    """w · silu(min(g, limit)) · clip(u, ±limit) of the routed gate and up experts at M = 1, one
    dispatch: x_rot [..., 1, in] float32 shared by a token's K slots, indices and route_w
    [..., K], gate and up (codes [E, out, words], norms [E, out]) -> [..., K, out] float32.
    No clamp when limit <= 0."""
    k = indices.shape[-1]
    in_f = x_rot.shape[-1]
    out_f = gate[0].shape[-2]
    slots = indices.size
    launch = Launch(
        MXTQ_SWIGLU,
        [
            x_rot.reshape(-1, in_f).astype(mx.float32),
            indices.reshape(-1).astype(mx.uint32),
            *gate,
            *up,
            codebook,
            route_w.reshape(-1).astype(mx.float32),
            in_f,
            out_f,
            k,
            float(limit),
        ],
        [("BITS", bits), ("ROWS", MXTQ_ROWS)],
        grid=(32, -(-out_f // MXTQ_ROWS), slots),
        threadgroup=(32, MXTQ_SIMDGROUPS, 1),
        output_shapes=[(slots, out_f)],
        output_dtypes=[mx.float32],
    )
    (h,) = run(launch, runner)
    return h.reshape(*indices.shape, out_f)


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
    (y,) = run(launch, runner)
    return y.reshape(x.shape)
