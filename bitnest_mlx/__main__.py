"""`python -m bitnest_mlx CMD ARGS...` runs `python -m bitnest_mlx.CMD ARGS...`; alone, it lists
the commands."""

import os
import sys

from .cli.entry import dispatch

if __name__ == "__main__":
    target = dispatch(sys.argv[1:])
    if isinstance(target, int):
        sys.exit(target)
    # The same process becomes the command's own: its arguments, its usage line and convert's
    # re-execution with OpenBLAS are those of `python -m bitnest_mlx.CMD`.
    os.execv(sys.executable, [sys.executable, "-m", target, *sys.argv[2:]])
