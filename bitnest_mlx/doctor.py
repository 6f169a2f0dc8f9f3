"""`python -m bitnest_mlx.doctor`: see `bitnest_mlx.cli.doctor` (import that, not this module)."""

import sys

from .cli.doctor import main

if __name__ == "__main__":
    sys.exit(main())
