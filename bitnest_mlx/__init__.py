"""bitnest-mlx: MLX runtime for nested dual-plane bitnest packages."""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

__version__ = "0.1.0"
# Any of these makes a directory loadable by AutoTokenizer.
_TOKENIZER_DEFINING = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")

# mlx-lm-like generation API, imported lazily: `import bitnest_mlx` stays light (no transformers).
_SPECULATIVE_EXPORTS = ("generate", "stream_generate", "make_sampler", "SpeculativeStats")


def __getattr__(name: str):
    if name in _SPECULATIVE_EXPORTS:
        from . import speculative

        return getattr(speculative, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_mlx_lm() -> None:
    """Make mlx-lm load bitnest packages and DeepSeek-V4 bundles in this process.

    The installed startup hook (bitnest_mlx_hook.pth) already does this for every process; call
    it when running from a source tree without `pip install`. See docs/mlx-lm.md.
    """
    from .mlx_lm_plugin import register

    register()


def default_dtype() -> mx.Dtype:
    """float16 on a Metal GPU; float32 on CPU (MLX's CPU quantized matmul is slow in half)."""
    return mx.float16 if mx.metal.is_available() else mx.float32


def load(
    path_or_repo: str | Path, mode: str = "target", dtype: mx.Dtype | None = None
) -> tuple[nn.Module, object]:
    """Load a bitnest package or a DeepSeek-V4 MXTQ bundle (local directory or Hub
    `org/repo[@revision]`).

    Returns (model, tokenizer): an mlx-lm style model (for bitnest packages its `mode` is "draft"
    or "target"; DSV4 bundles have one precision and ignore `mode`) and mlx-lm's TokenizerWrapper.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from .formats import bitnest, dsv4_bundle
    from .hub import resolve
    from .models.bitnest_llama import Model, args_from_package

    path = resolve(path_or_repo)
    if dsv4_bundle.is_bundle(path):
        from .dsv4 import load_bundle

        return load_bundle(path, dtype)
    package = bitnest.read(path)
    model = Model(args_from_package(package.manifest, package.config))
    model.set_dtype(dtype or default_dtype())
    model.load_weights(list(model.sanitize(package.tensors).items()), strict=True)
    model.mode = mode
    mx.eval(model.parameters())
    if not any((path / f).is_file() for f in _TOKENIZER_DEFINING):
        warnings.warn(f"{path}: no tokenizer files; returning tokenizer None", stacklevel=2)
        return model, None
    return model, load_tokenizer(path, tokenizer_config_extra={"config": _tokenizer_config()})


def _tokenizer_config():
    """An empty transformers config, so AutoTokenizer never parses the package's config.json:
    model_type "bitnest" is unknown to transformers, and its generic fallback fails on llama3
    rope scaling."""
    from transformers import PretrainedConfig

    return PretrainedConfig()
