"""DeepSeek-V4's MoE routing in one launch: scores, the experts (top-k or hash table) and their
weights, without reading anything back to the host. The pure-MLX twin and the check of one
against the other are bitnest_mlx/layers/dsv4_route.py."""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from .launch import KernelSpec, Launch, Runner, run

MOE_ROUTE = KernelSpec(
    "bitnest_moe_route",
    "moe_route.metal",
    ("logits", "bias", "table", "ids", "route_scale"),
    ("idx", "weight"),
)


@cache
def _unused(dtype: mx.Dtype) -> mx.array:
    """A one-element stand-in for the inputs the other routing kind reads (evaluated once: made
    per call it would be a kernel a call)."""
    a = mx.zeros((1,), dtype=dtype)
    mx.eval(a)
    return a


def moe_route(
    logits: mx.array,
    k: int,
    route_scale: float,
    bias: mx.array | None = None,
    table: mx.array | None = None,
    ids: mx.array | None = None,
    runner: Runner | None = None,
) -> tuple[mx.array, mx.array]:
    """logits [..., E] float32 (x · gateᵀ) -> (experts [..., k] uint32, weights [..., k]
    float32). Learned routing: the top k of sqrt(softplus(logits)) + bias; hash routing:
    `table` [vocab, k] (tid2eid) at the token `ids` [...]. Exactly one of bias, table."""
    if (bias is None) == (table is None):
        raise ValueError("moe_route takes a bias (learned routing) or a table (hash routing)")
    e = logits.shape[-1]
    lead = logits.shape[:-1]
    n = logits.size // e
    hashed = table is not None
    launch = Launch(
        MOE_ROUTE,
        [
            logits.reshape(n, e).astype(mx.float32),
            _unused(mx.float32) if hashed else bias.astype(mx.float32),
            table if hashed else _unused(mx.int32),
            ids.reshape(n).astype(mx.uint32) if hashed else _unused(mx.uint32),
            float(route_scale),
        ],
        [("E", e), ("K", k), ("HASH", hashed)],
        grid=(32, n, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(n, k), (n, k)],
        output_dtypes=[mx.uint32, mx.float32],
    )
    idx, weight = run(launch, runner)
    return idx.reshape(*lead, k), weight.reshape(*lead, k)
