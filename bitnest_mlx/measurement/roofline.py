"""Bytes read per generated token (the bandwidth roofline) and the tok/s ceilings they imply on
Apple chips; the speed model of speculation built on them is `runtime.speed_model`.

Decoding one token on a GPU is bound by memory bandwidth: its time is about the bytes it reads
(weights, one embedding row, the KV cache) over the bandwidth. The counts themselves are the
runtime's (`runtime.token_bytes`: the draft-KV policy decides from them); this module reports
them at a context length, for bench, eval, `bench --speed-model` and the converter's draft
vocabulary.
"""

from __future__ import annotations

import mlx.nn as nn

from ..runtime.chips import PEAK_GBS
from ..runtime.token_bytes import head_bytes, kv_bytes, weight_bytes

# The chips the roofline's tok/s ceilings are reported for.
CHIPS = {
    "M4 Pro": PEAK_GBS["M4 Pro"],
    "M1/M2/M3 Max": PEAK_GBS["M1 Max"],
    "M4 Max": PEAK_GBS["M4 Max"],
    "M2 Ultra": PEAK_GBS["M2 Ultra"],
    "M3 Ultra": PEAK_GBS["M3 Ultra"],
}


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
