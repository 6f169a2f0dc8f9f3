"""`python -m bitnest_mlx.eval` (`bitnest-eval`): perplexity, bits/byte, draft/target agreement,
sampling acceptance of speculative decoding and its projected speedup on a bandwidth-bound GPU."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..demo import DEMO, resolve_model
from ..evaluation import GAMMAS, GEN_TOKENS, MODES, SAMPLING, evaluate
from ..loader import LOAD_ERRORS, load
from ..sampling import RULES, make_sampler
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
    return p


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
    )
    result = {"model": str(args.model), "text": str(args.text), "mode": args.mode, **result}
    if args.mode != "all":
        result.update(result["modes"][args.mode])
    print(json.dumps(result) if args.json else report(result))
    return 0


def report(r: dict) -> str:
    """The human-readable report of an `evaluate` result."""
    r = dict(r)
    lines = [
        f"{m:>7}: ppl {s['ppl']:.4f}, {s['bits_per_byte']:.4f} bits/byte"
        for m, s in r.pop("modes").items()
    ]
    kv, sampling = r.pop("draft_kv"), r.pop("sampling")
    runs, speed = r.pop("speculative_sampling", None), r.pop("speed_model", None)
    verify_cost = r.pop("verify_cost")
    for k, v in r.items():
        lines.append(f"{k:>17}: {v:.4f}" if isinstance(v, float) else f"{k:>17}: {v}")
    limit = kv["kv8_context_limit"]
    lines.append(
        f"draft KV: {kv['policy']} -> KV{kv['windows']} on the windows (auto reads KV8 up to "
        f"{'any' if limit is None else limit} context tokens)"
    )
    for name, s in kv["readings"].items():
        lines.append(
            f"  draft KV{name}: ppl {s['ppl']:.4f}, argmax agreement {s['argmax_agreement']:.4f},"
            f" sum min(p, q) {s['sum_min_pq']:.4f}"
        )
    lines.append(
        f"sampling (temp {sampling['temp']}, top-p {sampling['top_p']}): mean sum min(p, q) "
        f"{r['sum_min_pq']:.4f}"
    )
    if runs is not None:
        lines.append(
            f"speculative runs ({sampling['rule']}, seed {sampling['seed']}, "
            f"{runs['gen_tokens']} tokens on each of {', '.join(runs['prompt_tokens'])}):"
        )
        for g, s in runs["gammas"].items():
            lines.append(
                f"  gamma {g}: {s['mean_accepted']:.3f} accepted + 1 = "
                f"{s['tokens_per_round']:.3f} tokens per round, acceptance "
                f"{s['acceptance_rate']:.1%} ({s['rounds']} rounds)"
            )
    if speed is not None:
        b = speed["bytes_per_token"]
        lines.append(
            f"speed model (bandwidth-bound, {speed['context_tokens']} context tokens, draft "
            f"KV{speed['draft_kv']}): c = {b['draft'] / 1e6:.3f} / {b['target'] / 1e6:.3f} MB "
            f"= {speed['cost_ratio']:.3f}"
        )
        for g, s in speed["gammas"].items():
            measured = s["measured_speedup"]  # None without sampled runs (--gen-tokens 0)
            lines.append(
                f"  gamma {g}: "
                + (f"measured {measured:.3f}x, " if measured is not None else "")
                + f"i.i.d. (alpha {speed['alpha']:.3f}) {s['iid_speedup']:.3f}x"
            )
        if speed["best_speedup"] is not None:
            lines.append(
                f"  best: gamma {speed['best_gamma']}, {speed['best_speedup']:.3f}x target-only "
                f"(i.i.d.: gamma {speed['best_gamma_iid']}, {speed['best_speedup_iid']:.3f}x)"
            )
        else:
            lines.append(
                f"  best (i.i.d.): gamma {speed['best_gamma_iid']}, "
                f"{speed['best_speedup_iid']:.3f}x target-only"
            )
    if runs is not None and "adaptive" in runs:
        a = runs["adaptive"]
        lines.append(
            f"adaptive runs (--draft-source {a['draft_source']}, at most {a['num_draft_tokens']} "
            f"W4 tokens a round): {a['tokens_per_round']:.3f} tokens per round over "
            f"{a['rounds']} rounds ({a['target_steps']} target-only)"
        )
        for source, s in sorted(a["sources"].items()):
            lines.append(
                f"  {source}: {s['rounds']} rounds, {s['accepted']} of {s['drafted']} accepted"
            )
        for prompt, chips in a["projected_speedup"].items():
            lines.append(
                f"  {prompt}: projected "
                + ", ".join(f"{c} {v['pure']:.3f}x / {v['kernel']:.3f}x" for c, v in chips.items())
                + " (pure / kernel v(M))"
            )
    for path, chips in verify_cost.items():
        lines.append(
            f"v(M) {path}: "
            + "; ".join(
                f"{c} " + " ".join(f"{v:.2f}" for v in row.values()) for c, row in chips.items()
            )
            + f" (M = {', '.join(map(str, next(iter(chips.values()))))})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
