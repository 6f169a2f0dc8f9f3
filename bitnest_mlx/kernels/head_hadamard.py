"""R3 in one launch: q's and k's head rows times the normalized Walsh-Hadamard matrix."""

from __future__ import annotations

import math

import mlx.core as mx

from .launch import KernelSpec, Launch, Runner, run

HEAD_HADAMARD = KernelSpec(
    "bitnest_head_hadamard",
    "head_hadamard.metal",
    ("q", "k", "rows_q"),
    ("q_out", "k_out"),
)


def head_hadamard_supported(q: mx.array, k: mx.array) -> bool:
    d = q.shape[-1]
    return k.shape[-1] == d and 32 <= d <= 1024 and d & (d - 1) == 0


def head_hadamard(
    q: mx.array, k: mx.array, runner: Runner | None = None
) -> tuple[mx.array, mx.array]:
    """(H q / √D, H k / √D) along the last axis (D = head_dim), in float32 arithmetic, each
    returned in its own dtype: what `mx.hadamard_transform` does to them widened to float32."""
    d = q.shape[-1]
    rows_q, rows_k = math.prod(q.shape[:-1]), math.prod(k.shape[:-1])
    launch = Launch(
        HEAD_HADAMARD,
        [q.reshape(rows_q, d), k.reshape(rows_k, d), rows_q],
        [("D", d), ("TQ", q.dtype), ("TK", k.dtype)],
        grid=(32, rows_q + rows_k, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(rows_q, d), (rows_k, d)],
        output_dtypes=[q.dtype, k.dtype],
    )
    q_out, k_out = run(launch, runner)
    return q_out.reshape(q.shape), k_out.reshape(k.shape)
