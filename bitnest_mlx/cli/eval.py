"""`python -m bitnest_mlx.eval` (`bitnest-eval`): perplexity, bits/byte, draft/target agreement."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..evaluation import MODES, evaluate
from ..formats.bitnest import PackageError
from ..hub import HubError
from ..loader import load


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
