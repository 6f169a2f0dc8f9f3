"""`python -m bitnest_mlx.verify PATH` (`bitnest-verify`): check a package or bundle against the
checksums its writer recorded (formats/checksums.py), after every rule of its format.

Exit status 0: every recorded file and tensor is as written; 1: the model records no checksums
(only its structure could be checked); 2: refused, with one line naming the first file that
differs or the rule it breaks.
"""

from __future__ import annotations

import sys

from ..hub import resolve
from ..runtime.demo import DEMO, resolve_model
from ..runtime.loader import LOAD_ERRORS, verify_path
from .args import Parser, refuse


def build_parser() -> Parser:
    p = Parser(
        prog="python -m bitnest_mlx.verify",
        description="Verify a bitnest package or DeepSeek-V4 bundle against its recorded SHA-256 "
        "checksums: every file's bytes (and each tensor's), after every structural rule.",
    )
    p.add_argument(
        "path",
        nargs="?",
        default=DEMO,
        help="package or bundle directory, Hub id org/repo[@rev], or 'demo' (the default)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = resolve(resolve_model(args.path))
        recorded_in = verify_path(path)
    except LOAD_ERRORS as e:
        return refuse(e)
    if recorded_in is None:
        print(
            f"{path}: valid, but it records no checksums, so its data cannot be verified",
            file=sys.stderr,
        )
        return 1
    print(f"{path}: ok (every file matches the sha256 recorded in {recorded_in.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
