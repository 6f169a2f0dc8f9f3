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
HADAMARD = KernelSpec("bitnest_hadamard_rotate", "hadamard_rotate.metal", ("x", "signs"), ("y",))


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
    (y,) = run(launch, runner)
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
    (y,) = run(launch, runner)
    return y.reshape(x.shape)
