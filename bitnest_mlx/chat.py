"""`python -m bitnest_mlx.chat`: see `bitnest_mlx.cli.chat` (import that, not this module)."""

import sys

from .cli.entry import run

if __name__ == "__main__":
    sys.exit(run("chat"))
