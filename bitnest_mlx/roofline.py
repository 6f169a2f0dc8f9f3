"""Bytes read per generated token (the bandwidth roofline) and the draft-KV policy that follows
from them; the speed model of speculation built on them is `speed_model`.

Decoding one token on a GPU is bound by memory bandwidth: its time is about the bytes it reads
(weights, one embedding row, the KV cache) over the bandwidth. So bytes per token are the cost
model of every choice here: which KV the draft reads, and what speculation can gain.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.nn as nn

from .chips import PEAK_GBS
from .layers.dual_plane import DualPlaneLinear

# The chips the roofline's tok/s ceilings are reported for.
CHIPS = {
    "M4 Pro": PEAK_GBS["M4 Pro"],
    "M1/M2/M3 Max": PEAK_GBS["M1 Max"],
    "M4 Max": PEAK_GBS["M4 Max"],
    "M2 Ultra": PEAK_GBS["M2 Ultra"],
    "M3 Ultra": PEAK_GBS["M3 Ultra"],
}

# `auto` lets the draft read KV8 while that costs it at most this fraction of its KV4 bytes per
# token. The draft's cost enters a round as γ·c (see `projected_speedup`); at the usual
# c ≈ 0.5, γ = 3, a 10 % dearer draft makes a round ≈ 6 % dearer, which the better draft buys
# back once it adds ≈ 0.06 × tokens per round (≈ 0.15 tokens at 2.5 per round). Past this point
# the KV read grows with context while what KV8 adds to acceptance does not.
KV8_BUDGET = 0.10
DRAFT_KV_POLICIES = (4, 8, "auto")


def _linear_bytes(m: DualPlaneLinear) -> tuple[int, int]:
    """(draft, target) bytes one Linear reads per token through the dual-plane kernel
    (dual_plane_qmv.metal): the hi plane (draft) or both planes (target), the fp16 scales once
    (the -8 offset is folded through Σx, so MLX's affine biases are never read), the bias."""
    plane = m.hi.size * 4  # uint32 words of 8 nibbles
    scales = m.scales.size * 2
    bias = m.bias.size * 2 if "bias" in m else 0
    return plane + scales + bias, 2 * plane + scales + bias


def head_bytes(model: nn.Module) -> dict[str, int]:
    """The lm_head's share of `weight_bytes`: all V rows for the target, the reduced draft
    vocabulary's K rows (and their ids) for the draft when the model has one (§2.9)."""
    draft, target = _linear_bytes(model.lm_head)
    head = getattr(model, "draft_head", None)
    if head is not None:
        draft = _linear_bytes(head.rows)[0] + head.ids.size * 4
    return {"draft": draft, "target": target}


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Weight bytes read per token by the draft and the target, as the Metal kernels read them
    (`_linear_bytes`), plus one embedding row; the lm_head as `head_bytes` counts it."""
    draft = target = 0
    for name, m in model.named_modules():
        if isinstance(m, DualPlaneLinear) and name.split(".")[0] not in ("lm_head", "draft_head"):
            d, t = _linear_bytes(m)
            draft, target = draft + d, target + t
    head = head_bytes(model)
    embed_row = model.args.hidden_size * 2
    return {
        "draft": draft + head["draft"] + embed_row,
        "target": target + head["target"] + embed_row,
    }


def kv_bytes(args) -> dict[int, int]:
    """KV bytes read per context token, by KV reading (4: the q4 plane, 8: both planes); each
    (token, kv head) group has an fp32 scale, read by both."""
    values = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim  # K and V
    scales = values // args.kv_group * 4
    return {4: values // 2 + scales, 8: values + scales}


def roofline(model: nn.Module, context: int, draft_kv: int = 4) -> dict:
    """Bytes read per generated token at `context` tokens of KV cache, by the draft (reading
    KV4 or, with `draft_kv=8`, KV8) and the target (KV8), and the tok/s ceilings on `CHIPS`."""
    weights, kv = weight_bytes(model), kv_bytes(model.args)
    per_context = {"draft": kv[draft_kv], "target": kv[8]}
    per_token = {k: weights[k] + per_context[k] * context for k in weights}
    return {
        "context_tokens": context,
        "draft_kv": draft_kv,
        "weight_bytes_per_token": weights,
        "lm_head_bytes_per_token": head_bytes(model),
        "kv_bytes_per_context_token": per_context,
        "bytes_per_token": per_token,
        "ceiling_tps": {
            f"{chip} ({bw} GB/s)": {k: bw * 1e9 / v for k, v in per_token.items()}
            for chip, bw in CHIPS.items()
        },
    }


# --------------------------------------------------------------------------------------------
# Draft KV policy


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
