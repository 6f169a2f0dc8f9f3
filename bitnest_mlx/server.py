"""`python -m bitnest_mlx.server`: see `bitnest_mlx.cli.server` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("server"))
