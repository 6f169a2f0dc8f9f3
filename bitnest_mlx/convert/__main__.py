"""`python -m bitnest_mlx.convert`: see `bitnest_mlx.cli.convert`;
`python -m bitnest_mlx.convert make-checkpoint ...`: see `bitnest_mlx.convert.checkpoint`."""

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["make-checkpoint"]:
        from .checkpoint import main as make_checkpoint_main

        sys.exit(make_checkpoint_main(sys.argv[2:]))
    from ..cli.entry import run

    sys.exit(run("convert"))
