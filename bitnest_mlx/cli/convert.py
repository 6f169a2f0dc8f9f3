"""`python -m bitnest_mlx.convert` (`bitnest-convert`): HF safetensors or GGUF -> package."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from ..convert import convert
from ..convert.rotation import ROTATIONS
from ..convert.sources import SourceError
from ..formats.bitnest import KV_GROUPS


def _slack(value: str) -> float | None:
    if value == "none":
        return None
    if float(value) < 0.5:
        raise argparse.ArgumentTypeError("must be >= 0.5 (RTN's own distance) or 'none'")
    return float(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bitnest_mlx.convert",
        description="Convert a Llama/Qwen2 checkpoint to a bitnest package: RMSNorm folding, "
        "R1/R2 rotations, R4 Hadamard, GPTQ (hi plane) + RTN residual (lo plane).",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-path", help="Hugging Face checkpoint directory (safetensors)")
    src.add_argument("--gguf", help="GGUF file of arch llama or qwen2")
    p.add_argument("--out", required=True, help="output package directory")
    p.add_argument("--calib", help="calibration text file (default: built-in corpus)")
    p.add_argument("--method", choices=("gptq", "rtn"), default="gptq", help="hi-plane method")
    p.add_argument("--rotate", choices=ROTATIONS, default="hadamard", help="R1/R2 rotation kind")
    p.add_argument("--seed", type=int, default=0, help="seed for rotations (default 0)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens for GPTQ")
    p.add_argument("--calib-seq-len", type=int, default=256, help="calibration sequence length")
    p.add_argument(
        "--lo",
        choices=("gptq", "rtn"),
        default="gptq",
        help="lo plane with --method gptq: GPTQ-compensated residual (default) or the plain RTN "
        "residual of the seed format (saturates where GPTQ moved the hi code)",
    )
    p.add_argument("--damp", type=float, default=0.01, help="GPTQ Hessian damping (x mean diag)")
    p.add_argument(
        "--w8-slack",
        type=_slack,
        default=3.0,
        help="GPTQ may move a hi code only to the hi nibble of a W8 code within this many W8 "
        "steps (s/16) of the weight; 'none' leaves it free, at a cost to the target (default 3)",
    )
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
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    tic = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            summary = convert(
                hf_path=args.hf_path,
                gguf=args.gguf,
                out=args.out,
                calib=args.calib,
                method=args.method,
                rotate_kind=args.rotate,
                seed=args.seed,
                calib_tokens=args.calib_tokens,
                calib_seq_len=args.calib_seq_len,
                damp=args.damp,
                lo_method=args.lo,
                w8_slack=args.w8_slack,
                r3=args.r3 == "on",
                kv_group=args.kv_group,
                scratch=Path(tmp),
            )
    except (SourceError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.perf_counter() - tic, 1)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
