"""bench's modes that replace the timing runs, as flags and printed results: `--kernels`
(`measurement.kernel_costs`), `--speed-model` (`measurement.speed_projection`),
`--dsv4-price` (`measurement.dsv4_price`) and `--workloads` (`measurement.bench_workloads`).
The work is measurement's; this is its face."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..formats.dsv4_config import BundleError
from ..measurement import (
    bench_workloads,
    dispatch_report,
    dsv4_price,
    kernel_costs,
    speed_projection,
)
from ..measurement.workloads import CONFIGS, WORKLOADS
from ..runtime.demo import DEMO, resolve_model
from ..runtime.loader import LOAD_ERRORS, load
from ..runtime.speed_model import PATHS
from .args import non_negative_float, positive_int, refuse


def acceptance_pair(value: str) -> tuple[int | str, float]:
    """`K=α` (K a number of draft tokens, 'full' or 'package': as the package stores it; α in
    (0, 1))."""
    k, _, alpha = value.partition("=")
    try:
        size = k if k in ("full", "package") else int(k)
        a = float(alpha)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected K=alpha, e.g. full=0.80") from None
    if not 0 < a < 1 or (isinstance(size, int) and size < 1):
        raise argparse.ArgumentTypeError(f"{value!r}: K >= 1, 'full' or 'package'; 0 < alpha < 1")
    return size, a


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `--speed-model` and `--workloads`."""
    p.add_argument(
        "--speed-model",
        action="store_true",
        help="instead of running: --model's bytes and kernels per token (a package, or what "
        "convert's defaults would write from a checkpoint's config.json or a preset: no weight "
        "is read) and projected draft, target and speculative tok/s on M1 / M3 Max / M4 Max / "
        "M3 Ultra beside mlx-lm's 4 and 8 bits, by step time (docs/step-time.md)",
    )
    p.add_argument(
        "--acceptance",
        type=acceptance_pair,
        nargs="+",
        metavar="K=ALPHA",
        help="--speed-model: draft acceptance α (Σmin(p, q) per drafted token, e.g. from the "
        "real-model page) at draft vocabulary K (a token count, 'full', or 'package': as the "
        "package stores it, the one row without this flag); one row per pair",
    )
    _add_workload_arguments(p)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
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
        "--workload-plan-path",
        choices=PATHS,
        help="--workloads: the controller plans with this path's step-time costs on the chip "
        "it plans for (off Metal an M4 Max): 'kernel' plans as a Mac with the Metal kernels "
        "would (default: the path the model takes here)",
    )
    p.add_argument(
        "--workload-plan-dims",
        metavar="MODEL",
        help="--workloads: the controller plans with the step time of this model's dims (a "
        "preset such as llama-3.2-3b, or a package; the runtime's stored kernels a layer) "
        "instead of the package's own: the rounds a model of that size would plan at this "
        "package's acceptance (default: the package's own dims)",
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


def add_dsv4_price(p: argparse.ArgumentParser) -> None:
    """`--dsv4-price`: DeepSeek-V4-Flash priced by step time (`measurement.dsv4_price`)."""
    p.add_argument(
        "--dsv4-price",
        action="store_true",
        help="instead of running: DeepSeek-V4-Flash's bytes a decode token (weights at its MLX "
        "q3.4 bundle's bit plan, caches at 2k and 64k context) from its config.json (or "
        "--model's: a bundle folder or a config.json), kernels and host syncs a token, and the "
        "projected tok/s on M3 Max / M4 Max / M3 Ultra by step time beside ds4 and oMLX "
        "(docs/deepseek-v4.md)",
    )


def kernels(as_json: bool = False) -> int:
    """`bench --kernels`."""
    missing = kernel_costs.missing_tools()
    if missing:
        print(
            "bench --kernels counts operations in the CPU emulator, which needs a C++ compiler: "
            f"{', '.join(missing)} not found (install g++ and clang, or set BITNEST_EMU_CXX / "
            "BITNEST_EMU_CLANG)"
        )
        return 2
    rows = kernel_costs.run()
    print(json.dumps(rows, indent=2) if as_json else kernel_costs.report(rows))
    return 0


def dispatches(model: str, as_json: bool) -> int:
    """`bench --dispatches`."""
    try:
        result = dispatch_report.run(model)
    except (*LOAD_ERRORS, OSError, ValueError, KeyError) as e:
        return refuse(f"{model}: {e}")
    print(json.dumps(result, indent=2) if as_json else dispatch_report.report(result))
    return 0


def speed_model(model: str, acceptance: list[tuple[int | str, float]] | None, as_json: bool) -> int:
    """`bench --speed-model`."""
    from ..convert.checkpoint import PRESETS

    sizes: dict[int | str, float | None] = dict(acceptance or [("package", None)])
    path = Path(resolve_model(model))
    if model not in PRESETS and not (path / "config.json").is_file():
        return refuse(
            f"{model}: --speed-model reads a package, a Hugging Face checkpoint folder or a "
            f"preset ({', '.join(sorted(PRESETS))}), and {path / 'config.json'} does not exist"
        )
    try:
        result = speed_projection.project(model if model in PRESETS else path, sizes)
    except (*LOAD_ERRORS, OSError, ValueError, KeyError) as e:
        return refuse(f"{model}: {e}")
    print(json.dumps(result, indent=2) if as_json else speed_projection.report(result))
    return 0


def dsv4_pricing(model: str, as_json: bool) -> int:
    """`bench --dsv4-price`: the real Flash config, or --model's (a bundle folder or a file)."""
    try:
        if model == DEMO:
            config, source = dsv4_price.flash_config(), dsv4_price.FLASH_CONFIG_FILE
        else:
            config, source = dsv4_price.read_config(model), str(model)
        result = dsv4_price.price(config, source=source)
    except (OSError, ValueError, KeyError, TypeError, BundleError) as e:
        return refuse(f"{model}: {e}")
    print(json.dumps(result, indent=2) if as_json else dsv4_price.report(result))
    return 0


def workloads(args: argparse.Namespace) -> int:
    """`bench --workloads`."""
    try:
        model, tokenizer = load(resolve_model(args.model), verify=args.verify)
    except LOAD_ERRORS as e:
        return refuse(e)
    if not model.supports_draft or tokenizer is None:
        return refuse(f"{args.model}: --workloads needs a bitnest package with a tokenizer")

    def progress(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    result = bench_workloads.run(
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
        dense_weights=args.dense_weights,
        plan_path=args.workload_plan_path,
        plan_dims=args.workload_plan_dims,
    )
    result = {"model": str(args.model), **result}
    print(json.dumps(result, indent=2) if args.json else bench_workloads.report(result))
    return 0
