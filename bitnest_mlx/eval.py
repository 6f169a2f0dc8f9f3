"""`python -m bitnest_mlx.eval`: perplexity, bits per byte and draft/target agreement on a text."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

from . import load
from .formats.bitnest import PackageError
from .hub import HubError
from .layers.dual_plane import dense_matmul
from .speculative import Sampler, SpeculativeStats, speculative_generate_step

MODES = ("draft", "target", "float")


def windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive non-overlapping windows (the last partial one dropped when shorter than 2)."""
    return [tokens[i : i + size] for i in range(0, len(tokens), size) if len(tokens[i:]) > 1]


def window_nll(logits: mx.array, window: list[int]) -> float:
    """Summed NLL (nats) of window[1:] under teacher-forced logits [T, V] of the window."""
    lf = logits[:-1].astype(mx.float32)
    logprobs = lf - mx.logsumexp(lf, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, mx.array(window[1:])[:, None], axis=-1).sum().item()


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
        with dense_matmul():
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
        )
        with dense_matmul():  # the prompt prefill; γ+1-row verification stays quantized
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
        choices=(*MODES, "all"),
        default="target",
        help="draft (W4A8KV4), target (W8A8KV8), float (W8 weights, no A8/KV quant) or all",
    )
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens of the text to score")
    p.add_argument("--window", type=int, default=512, help="context window (non-overlapping)")
    p.add_argument("--gamma", type=int, default=4, help="draft length for the accepted length")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        model, tokenizer = load(args.model)
        text = Path(args.text).read_text(encoding="utf-8")
    except (PackageError, HubError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    modes = MODES if args.mode == "all" else (args.mode,)
    result = evaluate(model, tokenizer, text, modes, args.max_tokens, args.window, args.gamma)
    result = {"model": str(args.model), "text": str(args.text), "mode": args.mode, **result}
    if args.mode != "all":
        result.update(result["modes"][args.mode])
    if args.json:
        print(json.dumps(result))
        return 0
    for m, scores in result.pop("modes").items():
        print(f"{m:>7}: ppl {scores['ppl']:.4f}, {scores['bits_per_byte']:.4f} bits/byte")
    for k, v in result.items():
        print(f"{k:>17}: {v:.4f}" if isinstance(v, float) else f"{k:>17}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
