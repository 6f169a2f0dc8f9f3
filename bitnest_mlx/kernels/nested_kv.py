"""The nested-KV (KV4 draft / KV8 target) attention read for decode and verification."""

from __future__ import annotations

import mlx.core as mx

from .dual_plane import MAX_M
from .launch import KernelSpec, Launch, Runner, run

KV_NSG = 4  # simdgroups per threadgroup in the attention read
KV_MAX_ROWS = 1024  # QN · D floats per simdgroup in threadgroup memory (16 KB for 4 simdgroups)

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
    (o,) = run(launch, runner)
    return o
