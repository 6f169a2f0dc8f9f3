"""`python -m bitnest_mlx.upload`: see `bitnest_mlx.cli.upload` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("upload"))
