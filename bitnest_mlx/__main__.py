"""`python -m bitnest_mlx CMD ARGS...` runs a command; alone, it lists them."""

import sys

from .cli.entry import dispatch

if __name__ == "__main__":
    sys.exit(dispatch(sys.argv[1:]))
