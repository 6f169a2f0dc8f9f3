"""`python -m bitnest_mlx.upload` (`bitnest-upload`): publish a package or bundle to the Hub
with a model card (README.md) saying what it is, how it was made and how well it scores."""

from __future__ import annotations

import argparse
import sys

from .args import Parser, refuse
from .publish import PublishError, read_evals, upload


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.upload",
        description="Push a converted bitnest package (or DeepSeek-V4 bundle) folder to a "
        "Hugging Face Hub repo, creating it if needed, in one commit with a model card. The "
        "token is huggingface_hub's (HF_TOKEN or `hf auth login`); HF_ENDPOINT picks the Hub.",
    )
    p.add_argument("path", help="the package or bundle folder")
    p.add_argument("repo", help="the Hub repo id, org/name")
    p.add_argument(
        "--eval-json",
        nargs="+",
        default=[],
        metavar="FILE",
        help="outputs of `python -m bitnest_mlx.eval --json` to put on the card (default: none)",
    )
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--message", help="the commit message (default: 'Upload NAME (bitnest-mlx V)')")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from huggingface_hub.errors import HfHubHTTPError

    try:
        url = upload(args.path, args.repo, read_evals(args.eval_json), args.private, args.message)
    except (PublishError, OSError, HfHubHTTPError) as e:
        return refuse(e)
    print(f"uploaded {args.path} to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
