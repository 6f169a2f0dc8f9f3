"""Bytes read per generated token: the weights of the draft and of the target as the Metal
kernels read them, the lm_head's share, and the KV cache per context token.

Decoding one token on a GPU is bound by memory bandwidth: its time is about the bytes it reads
(weights, one embedding row, the KV cache) over the bandwidth. So these counts are the cost
model of the runtime's choices (which KV the draft reads, `draft_kv`; the draft's cost ratio c
in the speculative loop) and of what measurement reports (`measurement.roofline`).
"""

from __future__ import annotations

import mlx.nn as nn

from ..layers.dual_plane import DualPlaneLinear


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
