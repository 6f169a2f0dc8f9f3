"""Perplexity, bits per byte and draft/target agreement of a bitnest model on a text."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx

from .layers.options import RunOptions
from .sampling import Sampler
from .speculative import SpeculativeStats, speculative_generate_step

MODES = ("draft", "target", "float")


def windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive non-overlapping windows (the last partial one dropped when shorter than 2)."""
    return [tokens[i : i + size] for i in range(0, len(tokens), size) if len(tokens[i:]) > 1]


def window_nll(logits: mx.array, window: list[int]) -> float:
    """Summed NLL (nats) of window[1:] under teacher-forced logits [T, V] of the window."""
    lf = logits[:-1].astype(mx.float32)
    logprobs = lf - mx.logsumexp(lf, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, mx.array(window[1:])[:, None], axis=-1).sum().item()


# Teacher-forced windows are long: a dense matmul on the dequantized planes is much faster on
# CPU and gives the same logits up to float rounding (see RunOptions.dense_min_rows).
_DENSE = RunOptions(dense_min_rows=32)
_READINGS = {
    "draft": replace(_DENSE, mode="draft"),
    "target": _DENSE,
    "float": replace(_DENSE, quantize_activations=False, quantize_kv=False),  # W8 weights only
}


def _logits(model, window: list[int], mode: str) -> mx.array:
    """Teacher-forced logits [T, V] of one reading (MODES)."""
    return model(mx.array(window)[None], options=_READINGS[mode])[0]


def evaluate(
    model,
    tokenizer,
    text: str,
    modes: Sequence[str] = ("target",),
    max_tokens: int = 2048,
    window: int = 512,
    gamma: int = 4,
    spec_tokens: int = 64,
) -> dict:
    """Perplexity and bits/byte of each mode on the first `max_tokens` tokens of `text`, the
    greedy argmax agreement of draft vs target on the same positions, and the mean accepted
    length of the greedy speculative loop at draft length `gamma`."""
    # A prefix is enough (no token spans 16 characters) and avoids tokenizing a whole book.
    tokens = tokenizer.encode(text[: 16 * max_tokens], verbose=False)[:max_tokens]
    nll = dict.fromkeys(modes, 0.0)
    n_pred = n_bytes = agree = n_positions = 0
    for w in windows(tokens, window):
        logits = {m: _logits(model, w, m) for m in {*modes, "draft", "target"}}
        for m in modes:
            nll[m] += window_nll(logits[m], w)
        same = mx.argmax(logits["draft"], -1) == mx.argmax(logits["target"], -1)
        agree += mx.sum(same).item()
        n_positions += len(w)
        n_pred += len(w) - 1
        n_bytes += len(tokenizer.decode(w[1:]).encode("utf-8"))
    stats = SpeculativeStats()
    if spec_tokens > 0:
        prompt = mx.array(tokens[: min(len(tokens) // 2, 256)])
        steps = speculative_generate_step(
            prompt,
            model,
            max_tokens=spec_tokens,
            sampler=Sampler(),
            num_draft_tokens=gamma,
            fallback=False,
            stats=stats,
            adaptive=False,
            options=_DENSE,  # dense only for the prompt prefill: γ+1 rows stay quantized
        )
        for _ in steps:
            pass
    return {
        "tokens": n_pred,
        "bytes": n_bytes,
        "modes": {
            m: {"ppl": math.exp(nll[m] / n_pred), "bits_per_byte": nll[m] / math.log(2) / n_bytes}
            for m in modes
        },
        "argmax_agreement": agree / n_positions,
        "mean_accepted": stats.mean_accepted if spec_tokens > 0 else None,
        "gamma": gamma,
    }
