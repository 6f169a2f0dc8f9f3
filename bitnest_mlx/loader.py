"""The one way in: a local directory or Hub id -> (model, tokenizer), by a registry of formats.

`bitnest_mlx.load`, the mlx-lm plugin, the CLIs and the server all come through here, so a new
format is one entry in FORMATS.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .formats import bitnest, detect, dsv4_bundle
from .hub import HubError, resolve
from .layers.options import RunOptions
from .layers.pipeline import PipelineError

# Any of these makes a directory loadable by AutoTokenizer.
TOKENIZER_DEFINING = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ExpertBudgetError(ValueError):
    """An expert memory budget asked of a format (or a pipeline) that cannot keep experts on
    disk."""


# What a load raises for input it refuses: one line naming file, tensor and expectation, which
# the faces print as it is.
LOAD_ERRORS = (
    bitnest.PackageError,
    dsv4_bundle.BundleError,
    HubError,
    PipelineError,
    ExpertBudgetError,
)


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_DEFINING)


def default_dtype() -> mx.Dtype:
    """float16 on a Metal GPU; float32 on CPU (MLX's CPU quantized matmul is slow in half)."""
    return mx.float16 if mx.metal.is_available() else mx.float32


def tokenizer_config():
    """An empty transformers config, so AutoTokenizer never parses the package's config.json:
    model_type "bitnest" is unknown to transformers, and its generic fallback fails on llama3
    rope scaling."""
    from transformers import PretrainedConfig

    return PretrainedConfig()


def _bitnest_class() -> type[nn.Module]:
    from .models.bitnest_llama import Model

    return Model


def _bitnest_model(path: Path, dtype: mx.Dtype | None) -> nn.Module:
    from .models.bitnest_llama import Model, ModelArgs

    package = bitnest.read(path)
    model = Model(ModelArgs.from_spec(package.spec))
    model.set_dtype(dtype or default_dtype())
    model.load_weights(list(model.sanitize(package.tensors).items()), strict=True)
    mx.eval(model.parameters())
    return model


def _bitnest_tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if not has_tokenizer(path):
        warnings.warn(f"{path}: no tokenizer files; returning tokenizer None", stacklevel=3)
        return None
    return load_tokenizer(path, tokenizer_config_extra={"config": tokenizer_config()})


def _dsv4_class() -> type[nn.Module]:
    from .models.deepseek_v4 import Model

    return Model


def _dsv4_model(path: Path, dtype: mx.Dtype | None) -> nn.Module:
    from . import dsv4

    model = dsv4.build_model(dsv4_bundle.read(path), dtype or mx.float32)
    mx.eval(model.parameters())
    return model


def _dsv4_budgeted(path: Path, dtype: mx.Dtype | None, max_expert_memory: float) -> nn.Module:
    from . import dsv4

    bundle = dsv4_bundle.read(path)
    model = dsv4.build_model(bundle, dtype or mx.float32, max_expert_memory=max_expert_memory)
    mx.eval(model.parameters())
    return model


def _dsv4_stage(path: Path, dtype: mx.Dtype | None, group: mx.distributed.Group) -> nn.Module:
    from . import dsv4

    model = dsv4.load_stage(path, group, dtype or mx.float32)
    mx.eval(model.parameters())
    return model


def _dsv4_tokenizer(path: Path):
    from . import dsv4

    return dsv4.bundle_tokenizer(path)


@dataclass(frozen=True)
class ModelFormat:
    name: str
    model_class: Callable[[], type[nn.Module]]  # says what the models support (supports_draft)
    load_model: Callable[[Path, mx.Dtype | None], nn.Module]  # validated, weights evaluated
    load_tokenizer: Callable[[Path], object]  # mlx-lm TokenizerWrapper, or None without files
    # This rank's share of a pipeline over a group (None: the format cannot be split).
    load_stage: Callable[[Path, mx.Dtype | None, mx.distributed.Group], nn.Module] | None = None
    # With routed experts on disk and an LRU of that many GB (None: no routed experts).
    load_budgeted: Callable[[Path, mx.Dtype | None, float], nn.Module] | None = None


FORMATS = {
    "bitnest": ModelFormat("bitnest", _bitnest_class, _bitnest_model, _bitnest_tokenizer),
    "dsv4": ModelFormat(
        "dsv4", _dsv4_class, _dsv4_model, _dsv4_tokenizer, _dsv4_stage, _dsv4_budgeted
    ),
}


def model_format(path: str | Path) -> ModelFormat:
    """The format of a local directory. Unrecognised directories go to the bitnest reader, whose
    error names what a package needs (a manifest)."""
    return FORMATS[detect(path) or "bitnest"]


def supports_draft(path: str | Path) -> bool:
    """Whether the model of a local directory has a draft reading (checked without loading)."""
    return model_format(path).model_class().supports_draft


def load_model(path: str | Path, dtype: mx.Dtype | None = None) -> nn.Module:
    """The model of a local package or bundle (no tokenizer)."""
    return model_format(path).load_model(Path(path), dtype)


def load(
    path_or_repo: str | Path,
    mode: str = "target",
    dtype: mx.Dtype | None = None,
    options: RunOptions | None = None,
    pipeline: mx.distributed.Group | None = None,
    max_expert_memory: float | None = None,
) -> tuple[nn.Module, object]:
    """Load a bitnest package or a DeepSeek-V4 MXTQ bundle (local directory or Hub
    `org/repo[@revision]`).

    Returns (model, tokenizer): an mlx-lm style model and mlx-lm's TokenizerWrapper (None when
    the directory has no tokenizer files). Models with `supports_draft` (bitnest packages) get
    `options` (default: RunOptions(mode=mode)) as their call defaults; others have one precision
    and ignore both.

    `pipeline`: split the layers over the group's ranks (mlx-lm's pipeline convention,
    layers/pipeline.py); this rank loads and runs its share only, and every rank returns the
    same logits. Launch one process per rank (`mlx.launch`, docs/deepseek-v4.md).

    `max_expert_memory`: GB of routed-expert codes to keep resident (DeepSeek-V4 bundles); the
    rest stay on disk and the most recently used are cached (`model.expert_store`). Logits are
    the same as without a budget.
    """
    path = resolve(path_or_repo)
    fmt = model_format(path)
    if max_expert_memory is not None:
        if fmt.load_budgeted is None or pipeline is not None:
            what = "a pipeline" if pipeline is not None else f"a {fmt.name} model"
            raise ExpertBudgetError(f"{path}: {what} cannot keep its experts on disk")
        model = fmt.load_budgeted(path, dtype, max_expert_memory)
    elif pipeline is None:
        model = fmt.load_model(path, dtype)
    elif fmt.load_stage is None:
        raise PipelineError(f"{path}: a {fmt.name} model cannot be split into a pipeline")
    else:
        model = fmt.load_stage(path, dtype, pipeline)
    if model.supports_draft:
        model.options = options or RunOptions(mode=mode)
    return model, fmt.load_tokenizer(path)
