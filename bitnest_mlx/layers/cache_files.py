"""Prompt-cache files as `mlx_lm.cache_prompt` writes them (`save_prompt_cache`), read back with
bitnest's cache classes.

The file is one safetensors: the arrays of each layer's `state` under "i.j", and metadata
holding (user metadata, class names, scalar markers). mlx-lm's reader finds a class by its name
in `mlx_lm.models.cache` only, where NestedKVCache is not, so this reader looks up bitnest's
classes first and mlx-lm's after.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as mlx_cache

from .nested_kv import NestedKVCache

CLASSES = {"NestedKVCache": NestedKVCache}


class PromptCacheError(ValueError):
    """A prompt-cache file that cannot be read, or one that does not fit the model."""


def _restore_scalars(arrays: dict, scalars: list) -> None:
    for pos, kind in scalars[1:]:
        array = arrays[pos]
        if kind == "scalar":
            arrays[pos] = array.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise PromptCacheError(f"unknown scalar kind {kind!r}")


def load_prompt_cache(path: str | Path) -> tuple[list, dict[str, str]]:
    """(one cache per layer, the file's metadata: `model`, `tokenizer_config`, ...)."""
    path = Path(path)
    try:
        arrays, raw = mx.load(str(path), return_metadata=True)
        metadata, classes, scalars = tree_unflatten(list(raw.items()))
        _restore_scalars(arrays, scalars)
    except (OSError, RuntimeError, ValueError, KeyError, TypeError) as e:
        raise PromptCacheError(f"{path}: not a prompt-cache file ({e})") from None
    states = tree_unflatten(list(arrays.items()))
    cache = []
    for name, state in zip(classes, states):
        cls = CLASSES.get(name) or getattr(mlx_cache, name, None)
        if cls is None or not hasattr(cls, "from_state"):
            raise PromptCacheError(f"{path}: cache class {name!r} cannot be restored here")
        cache.append(cls.from_state(state))
    return cache, metadata


def check_fits(cache: list, model_cache: list, path: str | Path) -> None:
    """Refuse a file whose caches are not the ones this model makes (layers, class, layout)."""
    if len(cache) != len(model_cache):
        raise PromptCacheError(
            f"{path}: {len(cache)} layer caches, the model has {len(model_cache)} layers"
        )
    for i, (got, want) in enumerate(zip(cache, model_cache)):
        if type(got) is not type(want):
            raise PromptCacheError(
                f"{path}: layer {i} holds a {type(got).__name__}, the model uses "
                f"{type(want).__name__}"
            )
        if isinstance(got, NestedKVCache) and got.meta_state != want.meta_state:
            raise PromptCacheError(
                f"{path}: layer {i} is a nested KV cache of group {got.group_size} (quantized "
                f"{got.quantized}), the model's is group {want.group_size}"
            )
