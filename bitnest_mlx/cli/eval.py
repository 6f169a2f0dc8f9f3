"""`python -m bitnest_mlx.eval` (`bitnest-eval`): perplexity, bits/byte, draft/target agreement."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..evaluation import MODES, evaluate
from ..loader import LOAD_ERRORS, load
from .args import Parser, int_at_least, non_negative_int, refuse


def read_text(path: str | Path) -> str:
    """The UTF-8 text of `path`; ValueError naming the file and the problem for a missing,
    unreadable, empty, binary (NUL bytes) or non-UTF-8 file."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"--text {path}: {e.strerror or e}") from e
    if not data:
        raise ValueError(f"--text {path}: the file is empty")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(
            f"--text {path}: binary file (NUL byte at offset {nul}), expected UTF-8 text"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--text {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})"
        ) from e


def main(argv: list[str] | None = None) -> int:
    p = Parser(
        prog="python -m bitnest_mlx.eval",
        description="Perplexity and bits per byte of a bitnest package on a text file, with the "
        "draft/target greedy agreement and the mean accepted length of speculative decoding.",
    )
    p.add_argument("--model", required=True, help="package directory or Hub id org/repo[@rev]")
    p.add_argument("--text", required=True, help="UTF-8 text file (not empty, no NUL bytes)")
    p.add_argument(
        "--mode",
        choices=(*MODES, "all"),
        default="target",
        help="draft (W4A8KV4), target (W8A8KV8), float (W8 weights, no A8/KV quant) or all",
    )
    p.add_argument(
        "--max-tokens",
        type=int_at_least(2),
        default=2048,
        help="tokens of the text to score (>= 2; default %(default)s)",
    )
    p.add_argument(
        "--window",
        type=int_at_least(2),
        default=512,
        help="context window, non-overlapping (>= 2; default %(default)s)",
    )
    p.add_argument(
        "--gamma",
        type=non_negative_int,
        default=4,
        help="draft length for the accepted length (>= 0; default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        text = read_text(args.text)  # before the model: a bad file is refused at once
        model, tokenizer = load(args.model)
    except (*LOAD_ERRORS, OSError, ValueError) as e:
        return refuse(e)
    if tokenizer is None:
        return refuse(f"{args.model} has no tokenizer files (tokenizer.json, ...)")
    if not model.supports_draft:
        return refuse(
            f"{args.model}: eval scores the draft/target/float readings of a bitnest package; "
            "this model has one precision (a DeepSeek-V4 bundle)"
        )
    n = len(tokenizer.encode(text[:64]))
    if n < 2:
        return refuse(f"--text {args.text}: {n} token(s) of text, at least 2 are needed to score")
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
