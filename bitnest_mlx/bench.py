"""`python -m bitnest_mlx.bench`: see `bitnest_mlx.cli.bench` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("bench"))
