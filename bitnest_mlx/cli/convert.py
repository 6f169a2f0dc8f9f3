"""`python -m bitnest_mlx.convert` (`bitnest-convert`): HF safetensors or GGUF -> package."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..convert import ConvertSettings, OutputError, convert
from ..convert.calib import CALIB_TOKENS
from ..convert.joint import W8_BUDGET
from ..convert.resume import describe
from ..convert.rotation import ROTATIONS
from ..formats.bitnest import KV_GROUPS, WEIGHT_GROUPS
from .args import Parser, float_at_least, int_at_least, non_negative_int, positive_int, refuse
from .blas import reexec_with_openblas


def _slack(value: str) -> float | None:
    if value == "none":
        return None
    if float(value) < 0.5:
        raise argparse.ArgumentTypeError("must be >= 0.5 (RTN's own distance) or 'none'")
    return float(value)


def _lambda(value: str) -> float | None:
    if value == "auto":
        return None
    if float(value) <= 0:
        raise argparse.ArgumentTypeError("must be > 0 or 'auto'")
    return float(value)


def _draft_vocab(value: str) -> int | str:
    if value in ("auto", "full"):
        return value
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError("must be a positive number of tokens, 'auto' or 'full'")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.convert",
        description="Convert a Llama/Qwen2 checkpoint to a bitnest package: RMSNorm folding, "
        "R1/R2 rotations, R4 Hadamard, GPTQ (hi plane) + RTN residual (lo plane). The package "
        "is written into a hidden sibling of --out and renamed into place when complete; an "
        "interrupted conversion keeps its finished layers there, and the same command run again "
        "resumes it.",
    )
    _add_paths(p)
    _add_method(p)
    _add_calibration(p)
    _add_layout(p)
    return p


# The flags by what they decide, added in the order --help lists them.


def _add_paths(p: argparse.ArgumentParser) -> None:
    """Where the checkpoint comes from and where the package goes."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-path", help="Hugging Face checkpoint directory (safetensors)")
    src.add_argument("--gguf", help="GGUF file of arch llama or qwen2")
    p.add_argument(
        "--out",
        required=True,
        help="output package directory: not the source or inside its directory; an existing "
        "non-empty one is refused unless --force",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing non-empty --out (removed only once the new package is complete)",
    )
    p.add_argument(
        "--upload-repo",
        metavar="ORG/NAME",
        help="then publish the package to this Hub repo with a model card, as bitnest-upload "
        "does (as mlx_lm.convert --upload-repo; default: no upload)",
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete an interrupted conversion to the same --out (its hidden .NAME.partial-* "
        "folder) and start over, instead of resuming it",
    )


def _add_method(p: argparse.ArgumentParser) -> None:
    """How each Linear's codes are chosen."""
    p.add_argument("--calib", help="calibration text file (default: built-in corpus)")
    p.add_argument(
        "--method",
        choices=("joint", "gptq", "rtn"),
        default="joint",
        help="code selection: joint (default) picks each weight's W4 and W8 codes together on "
        "the calibration Hessian, trading the draft's error against the target's by "
        "--lambda-draft; gptq calibrates the hi plane under --w8-slack, then the lo plane; rtn "
        "rounds to nearest (no calibration)",
    )
    p.add_argument(
        "--lambda-draft",
        type=_lambda,
        default=None,
        help="joint: weight of the draft's (W4) error against the target's (W8), each measured "
        "in its own grid's steps (> 0), or 'auto' (default): per Linear, the largest weight "
        "that keeps the target's output error within --w8-budget",
    )
    p.add_argument(
        "--w8-budget",
        type=float_at_least(0.0),
        default=W8_BUDGET,
        help="joint, lambda auto: the target's calibration output error allowed, x that of "
        "8-bit rounding to nearest (>= 0; default %(default)s)",
    )


def _add_calibration(p: argparse.ArgumentParser) -> None:
    """The rotation, the calibration text's size and GPTQ's settings."""
    p.add_argument("--rotate", choices=ROTATIONS, default="hadamard", help="R1/R2 rotation kind")
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed for rotations (>= 0; default 0)"
    )
    p.add_argument(
        "--calib-tokens",
        type=positive_int,
        default=CALIB_TOKENS,
        help="calibration tokens for the joint and gptq methods (>= 1; default %(default)s): "
        "more than the widest Linear input (intermediate_size), or its Hessian is singular",
    )
    p.add_argument(
        "--calib-seq-len",
        type=int_at_least(2),
        default=256,
        help="calibration sequence length (>= 2; default %(default)s)",
    )
    p.add_argument(
        "--lo",
        choices=("gptq", "rtn"),
        default="gptq",
        help="lo plane with --method gptq: GPTQ-compensated residual (default) or the plain RTN "
        "residual of the seed format (saturates where GPTQ moved the hi code)",
    )
    p.add_argument(
        "--damp",
        type=float_at_least(0.0),
        default=0.01,
        help="GPTQ Hessian damping, x mean diagonal (>= 0; default %(default)s)",
    )
    p.add_argument(
        "--w8-slack",
        type=_slack,
        default=3.0,
        help="GPTQ may move a hi code only to the hi nibble of a W8 code within this many W8 "
        "steps (s/16) of the weight; 'none' leaves it free, at a cost to the target (default 3)",
    )


def _add_layout(p: argparse.ArgumentParser) -> None:
    """What the package stores beside the weights: KV settings, groups, smoothing, draft vocab."""
    p.add_argument(
        "--r3",
        choices=("on", "off"),
        default="on",
        help="per-head Hadamard of q and k before the KV cache (manifest kv.r3; default on: it "
        "cuts the 4-bit K cache error, most on Qwen2)",
    )
    p.add_argument(
        "--kv-group",
        type=int,
        choices=KV_GROUPS,
        default=32,
        help="KV cache values per scale (manifest kv.group; default 32: finer KV4/KV8 than one "
        "scale per head for 1/4 bit more per cached value)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        choices=WEIGHT_GROUPS,
        default=None,
        help="weight columns per scale (manifest group_size; default: 64 where every Linear's "
        "input width allows it, else 32: the draft's finer grid; 128 is the seed packages')",
    )
    p.add_argument(
        "--smooth",
        action="store_true",
        help="per-channel smoothing: store an RMSNorm weight d (and W/d in the Linears reading "
        "it) wherever the calibration text says it lowers the W4/W8 output error (manifest "
        "norms.smoothing)",
    )
    p.add_argument(
        "--draft-vocab",
        type=_draft_vocab,
        default="auto",
        metavar="K|auto|full",
        help="the draft's lm_head keeps the K most frequent tokens (calibration text + the "
        "target's next-token distribution on held-out calibration sequences; manifest draft, "
        "tensor draft.vocab): it reads K rows instead of the vocabulary's, while the target "
        "still verifies every token. auto (default): the K of 8192, 16384, ... or full with the "
        "highest projected speedup by the step-time model (a vocabulary of 8192 or fewer stays "
        "full); full: no reduction",
    )


def _terminate(signum, frame):
    """SIGTERM -> SystemExit, so it ends as on Ctrl-C (finished layers kept, the rest removed)."""
    sys.exit(128 + signum)


def _interrupted(out: str) -> str:
    """What an interrupted conversion leaves: finished layers to resume from, or nothing."""
    kept = describe(out)
    if kept is None:
        return f"error: interrupted; no package was written to {out}"
    return (
        f"error: interrupted; no package was written to {out} yet, but {kept}: run the same "
        "command again to resume (add --fresh to start over)"
    )


def _stages_line(summary: dict) -> str:
    parts = [
        f"{name} {s['seconds']:.0f} s, {s['peak_rss_gb']:.2f} GB"
        for name, s in summary["stages"].items()
    ]
    return (
        f"[convert] {' | '.join(parts)} | total {summary['seconds']:.0f} s, "
        f"peak RSS {summary['peak_rss_gb']:.2f} GB"
    )


def settings_of(args: argparse.Namespace) -> ConvertSettings:
    """The parsed flags that change the package."""
    return ConvertSettings(
        calib=args.calib,
        method=args.method,
        rotate_kind=args.rotate,
        seed=args.seed,
        calib_tokens=args.calib_tokens,
        calib_seq_len=args.calib_seq_len,
        damp=args.damp,
        lo_method=args.lo,
        w8_slack=args.w8_slack,
        lambda_draft=args.lambda_draft,
        w8_budget=args.w8_budget,
        r3=args.r3 == "on",
        kv_group=args.kv_group,
        smooth=args.smooth,
        group_size=args.group_size,
        draft_vocab=args.draft_vocab,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # a process of its own (not a call from Python): worth the faster BLAS
        reexec_with_openblas("bitnest_mlx.convert")
    if args.calib is not None and not Path(args.calib).is_file():
        return refuse(f"--calib {args.calib}: no such file")
    tic = time.perf_counter()
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = convert(
                hf_path=args.hf_path,
                gguf=args.gguf,
                out=args.out,
                settings=settings_of(args),
                scratch=Path(tmp),
                force=args.force,
                fresh=args.fresh,
            )
    except (ValueError, OSError) as e:  # SourceError, OutputError and PackageError included
        code = refuse(e)
        kept = None if isinstance(e, OutputError) else describe(args.out)
        if kept is not None:  # a failure after some layers: they are not lost
            print(f"note: {kept}; the same command resumes from there", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        print(_interrupted(args.out), file=sys.stderr)
        return 130
    except SystemExit:  # SIGTERM
        print(_interrupted(args.out), file=sys.stderr)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary["seconds"] = round(time.perf_counter() - tic, 1)
    print(json.dumps(summary, indent=2))
    print(_stages_line(summary), file=sys.stderr)
    return publish(args) if args.upload_repo else 0


def publish(args: argparse.Namespace) -> int:
    """--upload-repo: the package just written goes to the Hub with its model card."""
    from huggingface_hub.errors import HfHubHTTPError

    from .publish import PublishError, upload

    try:
        url = upload(args.out, args.upload_repo)
    except (PublishError, OSError, HfHubHTTPError) as e:
        return refuse(f"the package is written to {args.out}, but the upload failed: {e}")
    print(f"uploaded {args.out} to {url}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
