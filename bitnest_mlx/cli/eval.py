"""`python -m bitnest_mlx.eval` (`bitnest-eval`): perplexity, bits/byte, draft/target agreement,
sampling acceptance of speculative decoding and its projected speedup by step time on a GPU."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..measurement.evaluation import GAMMAS, GEN_TOKENS, MODES, SAMPLING, evaluate
from ..runtime.demo import DEMO, resolve_model
from ..runtime.loader import LOAD_ERRORS, load
from ..runtime.sampling import RULES, make_sampler
from .args import (
    Parser,
    add_draft_kv,
    add_draft_source,
    add_draft_vocab_join,
    add_verify,
    int_at_least,
    non_empty,
    non_negative_float,
    non_negative_int,
    probability,
    refuse,
)
from .eval_report import report
from .progress import StageBars


def gamma_list(text: str) -> tuple[int, ...]:
    """--gammas: comma-separated draft lengths, each >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 2,3,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"each draft length must be >= 1, got {text}")
    return values


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


def build_parser() -> Parser:
    p = Parser(
        prog="python -m bitnest_mlx.eval",
        description="Perplexity and bits per byte of a bitnest package on a text file, with the "
        "draft/target greedy agreement and the mean accepted length of speculative decoding.",
    )
    _add_scoring(p)
    _add_speculation(p)
    return p


# The flags by what they set, added in the order --help lists them.


def _add_scoring(p: argparse.ArgumentParser) -> None:
    """The model, the text and how it is scored in windows."""
    p.add_argument(
        "--model",
        default=DEMO,
        help="package directory, Hub id org/repo[@rev], or 'demo' (the shipped demo package; "
        "the default)",
    )
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


def _add_speculation(p: argparse.ArgumentParser) -> None:
    """The speculative runs: γ, tokens, prompts, sampling and the draft's settings."""
    p.add_argument(
        "--gamma",
        type=non_negative_int,
        default=4,
        help="draft length for the accepted length (>= 0; default %(default)s)",
    )
    p.add_argument(
        "--gammas",
        type=gamma_list,
        default=GAMMAS,
        help="fixed draft lengths of the sampled speculative runs (default 2,3,4)",
    )
    p.add_argument(
        "--gen-tokens",
        type=non_negative_int,
        default=GEN_TOKENS,
        help="tokens generated per prompt and draft length by the sampled speculative runs "
        "(0 = skip them and the speed model; default %(default)s)",
    )
    p.add_argument(
        "--prompt",
        action="append",
        type=non_empty,
        help="a prompt for the sampled runs, raw text (repeat for more); default: the built-in "
        "code, prose and chat prompts",
    )
    p.add_argument(
        "--temp",
        type=non_negative_float,
        default=SAMPLING.temp,
        help="temperature of the sampled acceptance and runs (default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=SAMPLING.top_p,
        help="top-p of the sampled acceptance and runs, in (0, 1] (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the sampled runs (>= 0)"
    )
    p.add_argument(
        "--rule",
        choices=RULES,
        default="rejection",
        help="accept rule of the sampled runs (default %(default)s: its acceptance is "
        "sum(min(p, q)))",
    )
    add_draft_kv(p)
    add_draft_source(p)
    add_draft_vocab_join(p)
    add_verify(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        text = read_text(args.text)  # before the model: a bad file is refused at once
        model, tokenizer = load(resolve_model(args.model), verify=args.verify)
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
    prompts = None
    if args.prompt:
        prompts = {f"prompt{i + 1}": tokenizer.encode(t) for i, t in enumerate(args.prompt)}
    result = evaluate(
        model,
        tokenizer,
        text,
        modes,
        args.max_tokens,
        args.window,
        args.gamma,
        draft_kv=args.draft_kv,
        sampler=make_sampler(args.temp, args.top_p),
        gammas=args.gammas,
        gen_tokens=args.gen_tokens,
        prompts=prompts,
        seed=args.seed,
        rule=args.rule,
        draft_source=args.draft_source,
        draft_vocab_join=args.draft_vocab_join == "on",
        progress=StageBars(),
    )
    result = {"model": str(args.model), "text": str(args.text), "mode": args.mode, **result}
    if args.mode != "all":
        result.update(result["modes"][args.mode])
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
