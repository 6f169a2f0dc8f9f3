"""`bench --workloads`: the built-in workloads (`bitnest_mlx.workloads`) through the real
speculative loop, with tokens per round, per-source stats and the projected speed-up per chip.

Nothing here measures a Mac: the speed-ups are the logged rounds priced at each chip's v(M)
(`speed_model`), in target steps.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..demo import resolve_model
from ..layers.dual_plane import keep_dense
from ..loader import LOAD_ERRORS, load
from ..speed_model import verify_table
from ..workloads import CONFIGS, PROJECT_CHIPS, WORKLOADS, run_workloads
from .args import non_negative_float, positive_int, refuse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads",
        nargs="*",
        choices=WORKLOADS,
        metavar="NAME",
        help="instead of the timing runs: decode the built-in workloads ("
        + ", ".join(WORKLOADS)
        + "; all when none is named) with the real speculative loop and report tokens per "
        "round and the projected speedup per chip",
    )
    p.add_argument(
        "--workload-tokens",
        type=positive_int,
        default=256,
        help="--workloads: tokens generated per prompt (>= 1; default %(default)s)",
    )
    p.add_argument(
        "--workload-temps",
        type=non_negative_float,
        nargs="+",
        default=[0.0, 0.7],
        metavar="T",
        help="--workloads: temperatures (top-p 0.95 when > 0; default 0 0.7)",
    )
    p.add_argument(
        "--dense-weights",
        action="store_true",
        help="--workloads: keep W4 and W8 as float matrices (8 bytes per weight) so that a CPU "
        "verifies M rows for about the cost of one (layers.dual_plane.keep_dense; float "
        "rounding as the dense path)",
    )
    p.add_argument(
        "--workload-configs",
        nargs="+",
        choices=tuple(CONFIGS),
        default=list(CONFIGS),
        metavar="C",
        help="--workloads: what drafts: "
        + ", ".join(f"{k} (--draft-source {v})" for k, v in CONFIGS.items())
        + " (default: all)",
    )


def main(args: argparse.Namespace) -> int:
    try:
        model, tokenizer = load(resolve_model(args.model), verify=args.verify)
    except LOAD_ERRORS as e:
        return refuse(e)
    if not model.supports_draft or tokenizer is None:
        return refuse(f"{args.model}: --workloads needs a bitnest package with a tokenizer")
    if args.dense_weights:
        keep_dense(model)

    def progress(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    result = run_workloads(
        model,
        tokenizer,
        args.workloads or WORKLOADS,
        args.workload_configs,
        args.workload_temps,
        args.workload_tokens,
        args.seed,
        args.num_draft_tokens,
        args.ngram_tokens,
        progress,
        draft_vocab_join=args.draft_vocab_join == "on",
    )
    result = {"model": str(args.model), **result, "verify_cost": verify_table()}
    result["settings"]["dense_weights"] = args.dense_weights
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


def report(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"{result['model']}: {s['gen_tokens']} tokens per prompt, seed {s['seed']}, at most "
        f"{s['num_draft_tokens']} W4 draft tokens and {s['ngram_tokens']} copied per round; "
        f"plans priced at {s['controller_chip']}'s v(M). Speed-ups are projections (rounds "
        "priced at each chip's v(M), pure / kernel path), not Mac measurements.",
        f"{'workload':<11} {'T':>4} {'drafts':<12} {'tok/round':>9}  "
        + "  ".join(f"{c + ' pure/kernel':>20}" for c in PROJECT_CHIPS)
        + "  sources (accepted of drafted)",
    ]
    for name, temps in result["workloads"].items():
        for temp, configs in temps.items():
            for config, r in configs.items():
                speed = r["projected_speedup"]
                sources = ", ".join(
                    f"{k} {v['accepted']}/{v['drafted']}" for k, v in sorted(r["sources"].items())
                )
                lines.append(
                    f"{name:<11} {temp:>4} {config:<12} {r['tokens_per_round']:>9.2f}  "
                    + "  ".join(
                        f"{speed[c]['pure']:>12.2f}x/{speed[c]['kernel']:.2f}x"
                        for c in PROJECT_CHIPS
                    )
                    + f"  {sources}"
                )
    return "\n".join(lines)
