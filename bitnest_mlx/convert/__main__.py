"""`python -m bitnest_mlx.convert`: see `bitnest_mlx.cli.convert`."""

import sys

from ..cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
