"""`python -m bitnest_mlx.verify`: see `bitnest_mlx.cli.verify` (import that, not this module)."""

import sys

from .cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
