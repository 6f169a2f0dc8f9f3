"""The nested-KV (KV4 draft / KV8 target) attention read for decode and verification.

Two launches, flash-decoding style: pass 1 splits the keys over threadgroups (each writes its
split's max, sum and unnormalized output per query row), pass 2 merges the splits exactly as a
log-sum-exp. The split count is chosen so that a decode step fills the GPU at long context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from .dual_plane import MAX_M
from .launch import KernelSpec, Launch, Runner, run

KV_NSG = 4  # simdgroups per threadgroup in pass 1
# Apple GPUs give a threadgroup at most 32 KB of threadgroup memory; pass 1's arrays
# (`kv_threadgroup_bytes`) must fit it at every geometry the launch allows.
KV_TG_BYTES = 32 * 1024
# Query rows per threadgroup at most, for registers: each row keeps D/32 output dims, its
# running max and sum, its score and partial dot in every lane (about 110 at 16 rows, D = 64).
KV_MAX_QN = 16
# Pass 1 aims at this many threadgroups: about three per GPU core on a 40-core Max, so every
# core has work while one waits on memory. Fewer when the keys run out (below).
KV_TARGET_THREADGROUPS = 128
# A split holds at least one 32-key block per simdgroup: shorter splits leave simdgroups idle
# and make the merge's reads a larger share of the cache's.
KV_MIN_SPLIT = 32 * KV_NSG
MERGE_ROWS = 4  # query rows (simdgroups) per pass-2 threadgroup

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
        "rows",
        "L",
        "n_kv",
        "t_cap",
        "scale",
        "split_len",
        "n_splits",
    ),
    ("o_part", "m_part", "l_part"),
)
NESTED_KV_MERGE = KernelSpec(
    "bitnest_nested_kv_merge",
    "nested_kv_merge.metal",
    ("o_part", "m_part", "l_part", "n_splits"),
    ("o",),
)


def _ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


@dataclass(frozen=True)
class KVGeometry:
    """Pass 1's launch: query rows per threadgroup, row chunks per kv head, key splits."""

    qn: int
    chunks: int
    splits: int
    split_len: int
    threadgroups: int


def kv_threadgroup_bytes(qn: int, head_dim: int, nsg: int = KV_NSG) -> int:
    """Pass 1's threadgroup memory (nested_kv_attention.metal), float32: the simdgroups'
    outputs [nsg, qn, D] (q [qn, D] in the first during the key loop), the block's
    probabilities [nsg, qn, 32], and each simdgroup's max and sum per row."""
    return 4 * nsg * qn * (head_dim + 32 + 2)


def kv_max_rows(head_dim: int) -> int:
    """The most query rows one threadgroup takes at this head_dim (threadgroup memory and
    registers): 12 at 128, 16 at 64, 7 at 256."""
    qn = KV_MAX_QN
    while kv_threadgroup_bytes(qn, head_dim) > KV_TG_BYTES:
        qn -= 1
    return qn


def kv_geometry(
    batch: int,
    q_heads: int,
    kv_heads: int,
    L: int,
    head_dim: int,
    n_kv: int,
    splits: int | None = None,
) -> KVGeometry:
    """The split of the keys for one call; `splits` forces a count (tests: 1, several, ragged).

    A kv head's rows (GQA heads × L) go to as few chunks as `kv_max_rows` allows, of equal size
    (but the last), since each chunk reads and decodes every key and value again. Split
    lengths are whole 32-key blocks, so the last split is the ragged one."""
    rows = (q_heads // kv_heads) * L
    chunks = _ceil(rows, kv_max_rows(head_dim))
    qn = _ceil(rows, chunks)
    if kv_threadgroup_bytes(qn, head_dim) > KV_TG_BYTES:
        raise ValueError(
            f"nested-KV pass 1 at {qn} rows, head_dim {head_dim} needs "
            f"{kv_threadgroup_bytes(qn, head_dim)} bytes of threadgroup memory (> {KV_TG_BYTES})"
        )
    base = batch * kv_heads * chunks
    if splits is None:
        splits = max(1, min(_ceil(KV_TARGET_THREADGROUPS, base), _ceil(n_kv, KV_MIN_SPLIT)))
    split_len = _ceil(_ceil(n_kv, splits), 32) * 32
    splits = _ceil(n_kv, split_len)  # rounding to blocks may leave fewer splits, none empty
    return KVGeometry(qn, chunks, splits, split_len, base * splits)


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
    splits: int | None = None,
    runner: Runner | None = None,
) -> mx.array:
    """softmax(q Kᵀ·scale + causal) V with K, V read as KV4/KV8 from (hi, lo, scales) planes.

    q [B, Hq, L, D]; planes [B, Hkv, T_cap, D/8] uint32 and scales [B, Hkv, T_cap, D/group]
    float32 with the first `n_kv` (default T_cap) positions valid; the L queries are the last
    L positions. `splits` forces the number of key splits (default: `kv_geometry`'s choice).
    Returns [B, Hq, L, D] in q's dtype.
    """
    B, Hq, L, D = q.shape
    k_hi, k_lo, k_s = k_planes
    v_hi, v_lo, v_s = v_planes
    Hkv, t_cap = k_hi.shape[1], k_hi.shape[2]
    n_kv = t_cap if n_kv is None else n_kv
    geo = kv_geometry(B, Hq, Hkv, L, D, n_kv, splits)
    dtype = q.dtype if q.dtype in (mx.float16, mx.bfloat16, mx.float32) else mx.float32
    rows = B * Hq * L
    scalars = [Hq // Hkv * L, L, n_kv, t_cap, scale, geo.split_len, geo.splits]
    o_part, m_part, l_part = run(
        Launch(
            NESTED_KV,
            [q.astype(dtype), k_hi, k_lo, k_s, v_hi, v_lo, v_s, *scalars],
            [("T", dtype), ("D", D), ("G", group), ("QN", geo.qn), ("NSG", KV_NSG)]
            + [("TARGET", not draft)],
            grid=(32 * geo.splits, KV_NSG * geo.chunks, B * Hkv),
            threadgroup=(32, KV_NSG, 1),
            output_shapes=[(rows, geo.splits, D), (rows, geo.splits), (rows, geo.splits)],
            output_dtypes=[mx.float32] * 3,
        ),
        runner,
    )
    (o,) = run(
        Launch(
            NESTED_KV_MERGE,
            [o_part, m_part, l_part, geo.splits],
            [("T", dtype), ("D", D)],
            grid=(32, rows, 1),
            threadgroup=(32, min(MERGE_ROWS, rows), 1),
            output_shapes=[(B, Hq, L, D)],
            output_dtypes=[dtype],
        ),
        runner,
    )
    return o


NESTED_KV_WRITE = KernelSpec(
    "bitnest_nested_kv_write",
    "nested_kv_write.metal",
    ("k", "v", "D", "G"),
    ("k_hi", "k_lo", "k_scales", "v_hi", "v_lo", "v_scales"),
)


def nested_kv_write_supported(k: mx.array, v: mx.array, group: int) -> bool:
    """One thread per 8-column word, a row's words within one simdgroup, a group's words an
    aligned power-of-two run of them."""
    d = k.shape[-1]
    words = group // 8
    return (
        k.shape == v.shape
        and d % group == 0
        and group % 8 == 0
        and words & (words - 1) == 0
        and d // 8 <= 32
    )


def nested_kv_write(
    k: mx.array, v: mx.array, group: int, runner: Runner | None = None
) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
    """K and V [..., D] -> their (hi, lo, scales) as `layers.nested_kv.nest_quantize` makes
    them (hi, lo uint32 [..., D/8], scales float32 [..., D/group]), in one launch."""
    d = k.shape[-1]
    rows = math.prod(k.shape[:-1])
    words = d // 8
    per_tg = max(1, min(rows, 32 // words))  # rows a simdgroup holds
    lead = k.shape[:-1]
    shapes = [(*lead, words), (*lead, words), (*lead, d // group)] * 2
    launch = Launch(
        NESTED_KV_WRITE,
        [k.reshape(rows, d), v.reshape(rows, d), d, group],
        [],
        grid=(words, rows, 2),
        threadgroup=(words, per_tg, 1),
        output_shapes=shapes,
        output_dtypes=[mx.uint32, mx.uint32, mx.float32] * 2,
    )
    out = run(launch, runner)
    return tuple(out[:3]), tuple(out[3:])
