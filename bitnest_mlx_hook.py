"""Startup hook (run by bitnest_mlx_hook.pth): mlx-lm sees bitnest models in any Python process.

It only puts a finder on `sys.meta_path` (stdlib only, nothing imported): the finder acts when
mlx-lm itself imports one of WATCHED, and hands over to `bitnest_mlx.mlx_lm_integration.plugin`.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

WATCHED = frozenset(
    (
        "mlx_lm.utils",
        "mlx_lm.generate",
        "mlx_lm.chat",
        "mlx_lm.server",
        "mlx_lm.models.bitnest",
        "mlx_lm.models.deepseek_v4",
    )
)


class BitnestFinder(MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in WATCHED:
            return None
        from bitnest_mlx.mlx_lm_integration import plugin

        return plugin.find_spec(fullname, path, target)


def install() -> None:
    """Put the finder first on sys.meta_path, once."""
    if not any(type(f).__name__ == "BitnestFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, BitnestFinder())
