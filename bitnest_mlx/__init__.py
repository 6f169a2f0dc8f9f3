"""bitnest-mlx: MLX runtime for nested dual-plane bitnest packages."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

__version__ = "0.1.0"


def default_dtype() -> mx.Dtype:
    """float16 on a Metal GPU; float32 on CPU (MLX's CPU quantized matmul is slow in half)."""
    return mx.float16 if mx.metal.is_available() else mx.float32


def load(
    path_or_repo: str | Path, mode: str = "target", dtype: mx.Dtype | None = None
) -> tuple[nn.Module, object]:
    """Load a bitnest package (local directory or Hub `org/repo[@revision]`).

    Returns (model, tokenizer): an mlx-lm style model whose `mode` is "draft" or "target",
    and mlx-lm's TokenizerWrapper.
    """
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from .formats import bitnest
    from .hub import resolve
    from .models.bitnest_llama import Model, args_from_package

    path = resolve(path_or_repo)
    package = bitnest.read(path)
    model = Model(args_from_package(package.manifest, package.config))
    model.set_dtype(dtype or default_dtype())
    model.load_weights(list(model.sanitize(package.tensors).items()), strict=True)
    model.mode = mode
    mx.eval(model.parameters())
    return model, _quiet(load_tokenizer, path)


def _quiet(fn, *args):
    """transformers warns that config.json's model_type "bitnest" is unknown to it; it is."""
    import warnings

    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return fn(*args)
    finally:
        logging.set_verbosity(level)
