"""`python -m bitnest_mlx`: the list of commands."""

import sys

from .cli import COMMANDS


def main() -> int:
    print("bitnest-mlx commands (python -m bitnest_mlx.<name> or bitnest-<name>; --help on each):")
    for name, what in COMMANDS.items():
        print(f"  {name:<9} {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
