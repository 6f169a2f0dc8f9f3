"""`python -m bitnest_mlx.doctor`: see `bitnest_mlx.cli.doctor` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("doctor"))
