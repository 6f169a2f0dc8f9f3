"""`python -m bitnest_mlx.verify`: see `bitnest_mlx.cli.verify` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("verify"))
