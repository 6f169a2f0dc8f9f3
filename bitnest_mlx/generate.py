"""`python -m bitnest_mlx.generate`: runs `bitnest_mlx.cli.generate`.

Only for `-m`: `bitnest_mlx.generate` is the API function (mlx-lm's name), and importing a
submodule of that name would rebind it, so importing this file is refused with a pointer.
"""

import sys

if __name__ != "__main__":
    raise ImportError(
        "bitnest_mlx.generate is the API function; the CLI module is bitnest_mlx.cli.generate"
    )

from bitnest_mlx.cli.entry import run  # noqa: E402

sys.exit(run("generate"))
