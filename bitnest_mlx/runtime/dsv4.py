"""DeepSeek-V4 bundles -> model and tokenizer: what the loader's "dsv4" entry calls.

`load_model` reads a bundle (formats/dsv4_bundle.py, strict) and hands its tensors to the model,
which maps them itself (`Model.quantize_as` + `Model.sanitize`, models/deepseek_v4_weights.py,
as mlx-lm models do in `sanitize`); the weights load strictly. `python -m bitnest_mlx.dsv4
make-bundle` (cli/make_bundle.py) writes a synthetic bundle (formats/dsv4_synthetic.py); the
tiny demo bundle and random weights are in demo.py.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..formats import dsv4_bundle, safetensors_io
from ..formats.dsv4_bundle import BundleError
from ..models.deepseek_v4 import Model, ModelArgs


def load_model(
    path: str | Path,
    dtype: mx.Dtype = mx.float32,
    group: mx.distributed.Group | None = None,
    max_expert_memory: float | None = None,
    split: list[int] | None = None,
) -> Model:
    """The bundle's model, weights loaded and evaluated.

    group: keep this rank's stage of a pipeline over `group` (`Model.pipeline`, about 1/size of
    the layers): the whole bundle is validated, but only the stage's tensors are ever read
    (`dsv4_bundle.read` returns lazy arrays; `sanitize` drops the other stages' unevaluated).
    max_expert_memory: GB of routed-expert codes to keep resident (`Model.quantize_as`).
    The skeleton's lazily created initial weights are replaced before anything evaluates them.
    """
    bundle = dsv4_bundle.read(path)
    model = Model(ModelArgs.from_dict(bundle.config))
    if group is not None:
        model.pipeline(group, split)
    model.set_dtype(dtype)
    model.quantize_as(bundle, max_expert_memory)
    model.load_weights(list(model.sanitize(bundle.tensors).items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def bundle_tokenizer(path: str | Path, config: dict | None = None):
    """mlx-lm's TokenizerWrapper for a bundle, or None when it ships no tokenizer files.

    Stop ids come from config.json's `eos_token_id` (read here unless given), as mlx-lm does for
    its own models, so generation stops where the model's config says.
    """
    path = Path(path)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    if config is None:
        config = safetensors_io.read_json(path / "config.json", BundleError)
    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else None
    return load_tokenizer(path, eos_token_ids=eos)
