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

from ..formats import bitnest, detect, dsv4_bundle, safetensors_io
from ..hub import HubError, resolve
from ..layers.options import RunOptions, at_load
from ..layers.pipeline import PipelineError
from .demo import resolve_model

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


_ERRORS = {"bitnest": bitnest.PackageError, "dsv4": dsv4_bundle.BundleError}


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
    from ..models.bitnest_llama import Model

    return Model


def _bitnest_model(path: Path, dtype: mx.Dtype | None) -> nn.Module:
    from ..models.bitnest_llama import Model, ModelArgs

    package = bitnest.read(path)
    model = Model(ModelArgs.from_spec(package.spec))
    model.set_dtype(dtype or default_dtype())
    model.load_weights(list(model.sanitize(package.tensors).items()), strict=True)
    mx.eval(model.parameters())
    return model


def checked_tokenizer(
    path: Path, error: type[Exception], load: Callable, *args, **kwargs
) -> object:
    """`load(path, *args, **kwargs)` (mlx-lm's tokenizer loading) after our check of the
    tokenizer files (formats.safetensors_io.check_tokenizer_files); whatever transformers still
    raises becomes `error`, one line naming the directory."""
    safetensors_io.check_tokenizer_files(Path(path), error)
    try:
        return load(path, *args, **kwargs)
    except (error, KeyboardInterrupt, SystemExit):
        raise
    # tokenizers/transformers raise their own types with their wording; a panic in the Rust
    # tokenizer is pyo3's PanicException, a BaseException.
    except BaseException as e:
        raise error(
            f"{path}: the tokenizer files could not be loaded ({type(e).__name__}: {e})"
        ) from e


def _bitnest_tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if not has_tokenizer(path):
        warnings.warn(f"{path}: no tokenizer files; returning tokenizer None", stacklevel=3)
        return None
    extra = {"config": tokenizer_config()}
    return checked_tokenizer(
        path, bitnest.PackageError, load_tokenizer, tokenizer_config_extra=extra
    )


def _dsv4_class() -> type[nn.Module]:
    from ..models.deepseek_v4 import Model

    return Model


def _dsv4_model(path: Path, dtype: mx.Dtype | None) -> nn.Module:
    from . import dsv4

    return dsv4.load_model(path, dtype or mx.float32)


def _dsv4_budgeted(path: Path, dtype: mx.Dtype | None, max_expert_memory: float) -> nn.Module:
    from . import dsv4

    return dsv4.load_model(path, dtype or mx.float32, max_expert_memory=max_expert_memory)


def _dsv4_stage(path: Path, dtype: mx.Dtype | None, group: mx.distributed.Group) -> nn.Module:
    from . import dsv4

    return dsv4.load_model(path, dtype or mx.float32, group)


def _dsv4_tokenizer(path: Path):
    from . import dsv4

    return checked_tokenizer(path, dsv4_bundle.BundleError, dsv4.bundle_tokenizer)


def _bitnest_verify(path: Path) -> Path | None:
    manifest = bitnest.read(path, verify=True).manifest
    return bitnest.find_manifest(path) if bitnest.CHECKSUMS_KEY in manifest else None


def _dsv4_verify(path: Path) -> Path | None:
    config = dsv4_bundle.read(path, verify=True).config
    return path / "config.json" if dsv4_bundle.CHECKSUMS_KEY in config else None


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
    # Every rule plus the data against the recorded checksums; returns the file recording them
    # (None: the model has none, so only its structure could be checked).
    verify: Callable[[Path], Path | None] | None = None


FORMATS = {
    "bitnest": ModelFormat(
        "bitnest", _bitnest_class, _bitnest_model, _bitnest_tokenizer, verify=_bitnest_verify
    ),
    "dsv4": ModelFormat(
        "dsv4",
        _dsv4_class,
        _dsv4_model,
        _dsv4_tokenizer,
        _dsv4_stage,
        _dsv4_budgeted,
        _dsv4_verify,
    ),
}


def model_format(path: str | Path) -> ModelFormat:
    """The format of a local directory. Unrecognised directories go to the bitnest reader, whose
    error names what a package needs (a manifest), unless config.json, which would say what the
    directory is, is unreadable: then that is the error."""
    found = detect(path)
    if found is None and (Path(path) / "config.json").is_file():
        safetensors_io.read_json(Path(path) / "config.json", bitnest.PackageError)
    return FORMATS[found or "bitnest"]


def supports_draft(path: str | Path) -> bool:
    """Whether the model of a local directory has a draft reading (checked without loading)."""
    return model_format(path).model_class().supports_draft


def verify_path(path: str | Path) -> Path | None:
    """Check a local package or bundle against its recorded checksums (after every structural
    rule and the tokenizer files): raises one of LOAD_ERRORS naming the first file that differs;
    returns the file recording the checksums, or None when the model records none."""
    fmt = model_format(path)
    found = fmt.verify(Path(path))
    safetensors_io.check_tokenizer_files(Path(path), _ERRORS[fmt.name])
    return found


def load_model(path: str | Path, dtype: mx.Dtype | None = None, verify: bool = False) -> nn.Module:
    """The model of a local package or bundle (no tokenizer); `verify`: check its checksums
    first (`verify_path`)."""
    fmt = model_format(path)
    if verify:
        fmt.verify(Path(path))
    return _switched(fmt.load_model(Path(path), dtype), RunOptions())


def _switched(model: nn.Module, options: RunOptions) -> nn.Module:
    """The process-wide choices read once per load (`at_load`: BITNEST_MLX_KERNELS) and kept by
    the model as its call defaults, `model.options`: both families take RunOptions per call."""
    model.options = at_load(options)
    return model


def uses_kernels(model: nn.Module) -> bool:
    """Whether `model` may route to the Metal kernels (as loaded; they still need Metal).
    False for a model that is not ours (an mlx-lm model has no bitnest kernels)."""
    options = getattr(model, "options", None)
    return isinstance(options, RunOptions) and options.use_kernels


def load(
    path_or_repo: str | Path,
    mode: str = "target",
    dtype: mx.Dtype | None = None,
    options: RunOptions | None = None,
    pipeline: mx.distributed.Group | None = None,
    max_expert_memory: float | None = None,
    verify: bool = False,
) -> tuple[nn.Module, object]:
    """Load a bitnest package or a DeepSeek-V4 MXTQ bundle (local directory, Hub
    `org/repo[@revision]`, or "demo": the demo package shipped with bitnest_mlx).

    Returns (model, tokenizer): an mlx-lm style model and mlx-lm's TokenizerWrapper (None when
    the directory has no tokenizer files). Every model gets `options` (default:
    RunOptions(mode=mode)) as its call defaults; a model with one precision (DeepSeek-V4) reads
    the same weights whatever the mode. `BITNEST_MLX_KERNELS=0` in the environment now turns the
    kernels off for this model (`layers.options.at_load`).

    `pipeline`: split the layers over the group's ranks (mlx-lm's pipeline convention,
    layers/pipeline.py); this rank loads and runs its share only, and every rank returns the
    same logits. Launch one process per rank (`mlx.launch`, docs/deepseek-v4.md).

    `max_expert_memory`: GB of routed-expert codes to keep resident (DeepSeek-V4 bundles); the
    rest stay on disk and the most recently used are cached (`model.expert_store`). Logits are
    the same as without a budget.

    `verify`: hash every file against the checksums the writer recorded first and refuse the
    first that differs (`verify_path`); without it no tensor data is read to load (a Hub download
    verifies the files it has just fetched either way).
    """
    path = resolve(resolve_model(path_or_repo))
    fmt = model_format(path)
    if verify:
        verify_path(path)
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
    return _switched(model, options or RunOptions(mode=mode)), fmt.load_tokenizer(path)
