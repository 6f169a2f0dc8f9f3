"""The pure path of a nested cache's attention, for one sequence (`NestedKVCache`) or a batch
(`BatchNestedKVCache`): each cache stores and reads its planes its own way, the rest is this."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import kernels


def pure_attention(
    cache: Any,
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    mask: Any,
    draft: bool,
    k_offset: mx.array | None,
    use_kernels: bool = False,
) -> mx.array:
    """`attend`'s pure path for a nested cache of one or several sequences: store k, v (by the
    write kernel where `use_kernels` lets the cache use it), read every position as KV4 or KV8
    (`cache.update_and_fetch`), add the key offset, SDPA."""
    kernels.record("nested_kv", "pure")
    keys, values = cache.update_and_fetch(k, v, draft, use_kernels)
    if k_offset is not None:
        keys = keys + k_offset.astype(keys.dtype)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
