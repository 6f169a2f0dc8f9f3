"""`python -m bitnest_mlx.eval`: perplexity, bits per byte and draft/target agreement on a text."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mlx.core as mx

from . import load
from .formats.bitnest import PackageError
from .hub import ModelNotFound
from .speculative import Sampler, SpeculativeStats, speculative_generate_step

MODES = ("draft", "target", "float")


def windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive non-overlapping windows (the last partial one dropped when shorter than 2)."""
    return [tokens[i : i + size] for i in range(0, len(tokens), size) if len(tokens[i:]) > 1]


def _logits(model, window: list[int], mode: str) -> mx.array:
    """Teacher-forced logits [T, V]; `float` = W8 weights with A8 and KV quantization off."""
    parity = mode == "float"
    model.quantize_activations = model.quantize_kv = not parity
    try:
        return model(mx.array(window)[None], mode="target" if parity else mode)[0]
    finally:
        model.quantize_activations = model.quantize_kv = True


def evaluate(
    model,
    tokenizer,
    text: str,
    mode: str = "target",
    max_tokens: int = 2048,
    window: int = 512,
    gamma: int = 4,
    spec_tokens: int = 64,
) -> dict:
    """Perplexity and bits/byte of `mode` on the first `max_tokens` tokens of `text`, plus the
    greedy argmax agreement of draft vs target on the same positions and the mean accepted
    length of the greedy speculative loop at draft length `gamma`."""
    # A prefix is enough (no token spans 16 characters) and avoids tokenizing a whole book.
    tokens = tokenizer.encode(text[: 16 * max_tokens], verbose=False)[:max_tokens]
    nll, n_pred, n_bytes, agree = 0.0, 0, 0, 0
    for w in windows(tokens, window):
        logits = _logits(model, w, mode).astype(mx.float32)
        logprobs = logits[:-1] - mx.logsumexp(logits[:-1], axis=-1, keepdims=True)
        targets = mx.array(w[1:])
        nll -= mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum().item()
        n_pred += len(w) - 1
        n_bytes += len(tokenizer.decode(w[1:]).encode("utf-8"))
        draft = _logits(model, w, "draft") if mode != "draft" else logits
        target = _logits(model, w, "target") if mode != "target" else logits
        agree += mx.sum(mx.argmax(draft, -1) == mx.argmax(target, -1)).item()
    n_positions = sum(len(w) for w in windows(tokens, window))
    stats = SpeculativeStats()
    prompt = mx.array(tokens[: min(len(tokens) // 2, 256)])
    for _ in speculative_generate_step(
        prompt,
        model,
        max_tokens=spec_tokens,
        sampler=Sampler(),
        num_draft_tokens=gamma,
        fallback=False,
        stats=stats,
        adaptive=False,
    ):
        pass
    return {
        "mode": mode,
        "tokens": n_pred,
        "bytes": n_bytes,
        "ppl": math.exp(nll / n_pred),
        "bits_per_byte": nll / math.log(2) / n_bytes,
        "argmax_agreement": agree / n_positions,
        "mean_accepted": stats.mean_accepted,
        "gamma": gamma,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bitnest_mlx.eval",
        description="Perplexity and bits per byte of a bitnest package on a text file, with the "
        "draft/target greedy agreement and the mean accepted length of speculative decoding.",
    )
    p.add_argument("--model", required=True, help="package directory or Hub id org/repo[@rev]")
    p.add_argument("--text", required=True, help="UTF-8 text file")
    p.add_argument(
        "--mode",
        choices=MODES,
        default="target",
        help="draft (W4A8KV4), target (W8A8KV8) or float (W8 weights, no A8/KV quant)",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=512, help="context window (non-overlapping)")
    p.add_argument("--gamma", type=int, default=4, help="draft length for the accepted length")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        model, tokenizer = load(args.model)
        text = Path(args.text).read_text(encoding="utf-8")
    except (PackageError, ModelNotFound, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = evaluate(model, tokenizer, text, args.mode, args.max_tokens, args.window, args.gamma)
    result = {"model": str(args.model), "text": str(args.text), **result}
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>17}: {v:.4f}" if isinstance(v, float) else f"{k:>17}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
