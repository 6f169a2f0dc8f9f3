"""`python -m bitnest_mlx.eval`: see `bitnest_mlx.cli.eval` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("eval"))
