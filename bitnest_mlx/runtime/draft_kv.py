"""The draft-KV policy: whether the draft reads the KV cache as KV4 or KV8 at a given context.

Both readings cost bytes per token (`token_bytes`); `auto` lets the draft read KV8 while that
stays within a budget of its KV4 bytes, so short contexts get the better draft and long ones
the cheaper read. The speculative loop asks `draft_kv_policy` each round; eval and bench report
`resolve_draft_kv` / `model_kv8_limit`.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from .token_bytes import kv_bytes, weight_bytes

# `auto` lets the draft read KV8 while that costs it at most this fraction of its KV4 bytes per
# token. The draft's cost enters a round as γ·c (see `projected_speedup`); at the usual
# c ≈ 0.5, γ = 3, a 10 % dearer draft makes a round ≈ 6 % dearer, which the better draft buys
# back once it adds ≈ 0.06 × tokens per round (≈ 0.15 tokens at 2.5 per round). Past this point
# the KV read grows with context while what KV8 adds to acceptance does not.
KV8_BUDGET = 0.10
DRAFT_KV_POLICIES = (4, 8, "auto")


def choose_draft_kv(
    context: int, weights: int, kv4: int, kv8: int, budget: float = KV8_BUDGET
) -> int:
    """8 if the draft reading KV8 instead of KV4 at `context` tokens adds at most `budget` of
    its KV4 bytes per token, (kv8 - kv4)·context <= budget·(weights + kv4·context); else 4.

    weights: the draft's weight bytes per token; kv4, kv8: KV bytes per context token."""
    return 8 if (kv8 - kv4) * context <= budget * (weights + kv4 * context) else 4


def kv8_context_limit(weights: int, kv4: int, kv8: int, budget: float = KV8_BUDGET) -> int | None:
    """The longest context at which `choose_draft_kv` picks 8 (None: at every context)."""
    slope = kv8 - kv4 - budget * kv4  # extra bytes per context token, net of the budget's share
    if slope <= 0:
        return None
    n = int(budget * weights / slope)
    while choose_draft_kv(n + 1, weights, kv4, kv8, budget) == 8:  # float rounding at the edge
        n += 1
    while n > 0 and choose_draft_kv(n, weights, kv4, kv8, budget) == 4:
        n -= 1
    return n


def draft_kv_policy(
    policy: int | str, model: nn.Module, budget: float = KV8_BUDGET
) -> Callable[[int], int]:
    """context length -> the KV the draft reads (4 or 8) under `policy` (4, 8 or "auto")."""
    if policy not in DRAFT_KV_POLICIES:
        raise ValueError(f"draft_kv must be one of {DRAFT_KV_POLICIES}, got {policy!r}")
    if policy != "auto":
        return lambda context: policy
    weights, kv = weight_bytes(model)["draft"], kv_bytes(model.args)
    return lambda context: choose_draft_kv(context, weights, kv[4], kv[8], budget)


def resolve_draft_kv(policy: int | str, model: nn.Module, context: int) -> int:
    """The KV (4 or 8) the draft reads at `context` tokens under `policy` (4, 8 or "auto")."""
    return draft_kv_policy(policy, model)(context)


def model_kv8_limit(model: nn.Module, budget: float = KV8_BUDGET) -> int | None:
    """`kv8_context_limit` of a model: where `auto` switches the draft from KV8 to KV4."""
    kv = kv_bytes(model.args)
    return kv8_context_limit(weight_bytes(model)["draft"], kv[4], kv[8], budget)
