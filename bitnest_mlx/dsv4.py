"""`python -m bitnest_mlx.dsv4 make-bundle`: see `bitnest_mlx.cli.make_bundle`."""

import sys

from .cli.make_bundle import main

if __name__ == "__main__":
    sys.exit(main())
