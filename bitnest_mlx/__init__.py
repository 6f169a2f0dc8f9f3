"""bitnest-mlx: MLX runtime for nested dual-plane bitnest packages and DeepSeek-V4 MXTQ bundles.

The public API is imported lazily, so `import bitnest_mlx` stays light (no transformers).
See docs/architecture.md for the layers of the package.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "load": "runtime.loader",
    "load_model": "runtime.loader",
    "default_dtype": "runtime.loader",
    "RunOptions": "layers.options",
    "generate": "runtime.speculative",
    "stream_generate": "runtime.speculative",
    "make_sampler": "runtime.sampling",
    "Sampler": "runtime.sampling",
    "SpeculativeStats": "runtime.speculative",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_mlx_lm() -> None:
    """Make mlx-lm load bitnest packages and DeepSeek-V4 bundles in this process.

    The installed startup hook (bitnest_mlx_hook.pth) already does this for every process; call
    it when running from a source tree without `pip install`. See docs/mlx-lm.md.
    """
    from .mlx_lm_integration.plugin import register

    register()
