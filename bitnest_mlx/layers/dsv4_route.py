"""DeepSeek-V4's MoE routing: sqrt(softplus) scores, experts by top-k of score + bias or by the
hash table (tid2eid), weights normalised over the chosen experts. Nothing is read back to the
host on either path.

Kernel path: the gate matmul, then one launch (bitnest_mlx/kernels/moe_route.py) after its
self-test passed. Pure path: the reference math as 4 kernels after the matmul (scores with the
biased key, arg-partition, the gathered scores, their normalisation), bit for bit the
unfused ops.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .. import kernels
from .dsv4_ops import unrolled_sum


@partial(mx.compile, shapeless=True)
def _scores(logits: mx.array) -> mx.array:
    return mx.sqrt(nn.softplus(logits))


@partial(mx.compile, shapeless=True)
def _keyed_scores(logits: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
    """(scores, -(scores + bias)): the arg-partition's key in the same kernel."""
    scores = mx.sqrt(nn.softplus(logits))
    return scores, -(scores + bias)


@mx.compile
def _normalised(w: mx.array, route_scale: float) -> mx.array:
    total = unrolled_sum([w[..., k : k + 1] for k in range(w.shape[-1])])
    return w / total * route_scale


def route(
    logits: mx.array,
    top_k: int,
    route_scale: float,
    bias: mx.array | None = None,
    table: mx.array | None = None,
    ids: mx.array | None = None,
    use_kernels: bool = True,
) -> tuple[mx.array, mx.array]:
    """(experts [..., top_k] uint32, weights [..., top_k] float32) from the gate's float32
    logits [..., E]: learned routing with `bias` [E], or hash routing with `table` [vocab,
    top_k] at token `ids` [...]. The experts' order differs between the paths (a set)."""
    if use_kernels and kernels.use("moe_route", route_self_test):
        kernels.record("moe_route", "kernel")
        return kernels.moe_route(logits, top_k, route_scale, bias, table, ids)
    kernels.record("moe_route", "pure")
    return pure_route(logits, top_k, route_scale, bias, table, ids)


def pure_route(
    logits: mx.array,
    top_k: int,
    route_scale: float,
    bias: mx.array | None = None,
    table: mx.array | None = None,
    ids: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    if table is not None:
        scores = _scores(logits)
        idx = table[ids].view(mx.uint32)  # expert ids are >= 0: a view, not a conversion
    else:
        # The bias only chooses experts; the weights come from the unbiased scores.
        scores, key = _keyed_scores(logits, bias)
        idx = mx.argpartition(key, top_k - 1, axis=-1)[..., :top_k]
    w = mx.take_along_axis(scores, idx, axis=-1)
    return idx, _normalised(w, route_scale)


def dense(idx: mx.array, w: mx.array, experts: int) -> mx.array:
    """[..., experts] with each token's weights at its experts (0 elsewhere): a routing
    compared as a set, whatever order each path lists the experts in."""
    out = mx.zeros((*idx.shape[:-1], experts), dtype=mx.float32)
    return mx.put_along_axis(out, idx.astype(mx.int32), w, axis=-1)


def route_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) routings as dense weight rows: 3 tokens over 40 experts (a ragged second
    pass of the 32 lanes), 6 learned picks, then a 4-expert hash table; `big`: 1024 tokens
    over 256 experts (DeepSeek-V4-Flash's), 6 picks."""
    experts, k_hash, tokens = (256, 6, 1024) if big else (40, 4, 3)
    k1, k2, k3, k4 = mx.random.split(mx.random.key(21), 4)
    logits = mx.random.normal((1, tokens, experts), key=k1) * 3
    bias = mx.random.normal((experts,), key=k2)
    table = mx.random.randint(0, experts, (50, k_hash), key=k3).astype(mx.int32)
    ids = mx.random.randint(0, 50, (1, tokens), key=k4).astype(mx.uint32)
    got, want = [], []
    for kw, k in (({"bias": bias}, 6), ({"table": table, "ids": ids}, k_hash)):
        got.append(dense(*kernels.moe_route(logits, k, 2.5, runner=runner, **kw), experts))
        want.append(dense(*pure_route(logits, k, 2.5, **kw), experts))
    return mx.concatenate(got, -1), mx.concatenate(want, -1)


__all__ = ["dense", "pure_route", "route", "route_self_test"]
