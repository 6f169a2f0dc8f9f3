"""DeepSeek-V4 bundles -> model and tokenizer (the loader's DSV4 entry; `bitnest_mlx.load`).

`build_model(bundle)` builds models/deepseek_v4.py from a bundle that formats/dsv4_bundle.py read
(strict), swaps in MLX affine layers and MXTQ experts where the bundle stores them, and loads
every tensor (strict). `load_stage` does the same for one rank of a pipeline, reading only the
tensors that rank holds. The tiny demo bundle and random weights are in demo.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .formats import dsv4_bundle, safetensors_io
from .formats.dsv4_bundle import BundleError
from .layers import expert_store
from .layers.expert_store import ExpertStore
from .layers.mxtq_linear import MXTQSwitchLinear
from .models.deepseek_v4 import Model, ModelArgs


def args_from_config(config: dict) -> ModelArgs:
    return ModelArgs.from_dict(config)


def build_model(
    bundle: dsv4_bundle.Bundle,
    dtype: mx.Dtype = mx.float32,
    model: Model | None = None,
    max_expert_memory: float | None = None,
) -> Model:
    """The model with affine / MXTQ layers where the bundle stores them, weights loaded.

    model: a skeleton to fill instead of a new whole model (one pipeline stage, `load_stage`).
    max_expert_memory: GB (1e9 bytes) of routed-expert codes to keep resident; the codes stay
    in the bundle's files and the most recently used experts are cached
    (layers/expert_store.py, `model.expert_store`). None: every expert resident.

    Each weight is held once, as stored: codes, scales, norms keep their bundle dtype (MLX's
    quantized matmul takes float16 scales with float32 input, bit-identically). Only the
    embedding's scales are widened to the model dtype, because a QuantizedEmbedding returns
    its scales' dtype. The lazily created initial weights are replaced before anything
    evaluates them.
    """
    if model is None:
        model = Model(args_from_config(bundle.config))
    model.set_dtype(dtype)
    for bits, group in set(bundle.affine.values()):
        names = {n for n, bg in bundle.affine.items() if bg == (bits, group)}
        nn.quantize(
            model,
            group_size=group,
            bits=bits,
            class_predicate=lambda path, m, names=names: (
                path in names and isinstance(m, (nn.Linear, nn.Embedding))
            ),
        )
    slots = dsv4_bundle.schedule(bundle.config)
    store = None if max_expert_memory is None else ExpertStore(int(max_expert_memory * 1e9))
    ranges = expert_store.tensor_ranges(bundle.path) if store is not None else {}
    on_disk = set()
    for name, fmt in bundle.formats.items():
        if isinstance(fmt, int):  # MXTQ experts of `fmt` bits
            layer, proj = dsv4_bundle.layer_proj(name)
            e, out_f, in_f = slots[name].shape
            switch = model.layers[int(layer)].ffn.switch_mlp
            experts = MXTQSwitchLinear(in_f, out_f, e, fmt, seed=bundle.seed)
            if store is not None:
                experts.use_store(store, expert_store.expert_source(ranges, name, e))
                on_disk.add(f"{name}.tq_packed")
            setattr(switch, proj, experts)
    model.expert_store = store
    params = dict(tree_flatten(model.parameters()))
    weights = []
    for key, a in bundle.tensors.items():
        if key in on_disk:
            continue  # never evaluated: its bytes are read per expert through the store
        target = params.get(key)
        if target is None:
            raise BundleError(f"{key}: no such model parameter")
        keep = key.endswith((".scales", ".biases")) and not key.startswith("embed.")
        weights.append((key, a.astype(target.dtype) if a.dtype != target.dtype and not keep else a))
    model.load_weights(weights, strict=True)
    model.eval()
    return model


def load_stage(
    path: str | Path,
    group: mx.distributed.Group,
    dtype: mx.Dtype = mx.float32,
    split: list[int] | None = None,
) -> Model:
    """This rank's stage of a pipeline over `group` (`Model.pipeline`), holding about 1/size of
    the layers: the whole bundle is validated, but only the stage's tensors are ever read.

    `dsv4_bundle.read` returns lazy arrays (`mx.load`); the tensors of other stages are dropped
    here before anything evaluates them, so their bytes never reach memory.
    """
    bundle = dsv4_bundle.read(path)
    model = Model(args_from_config(bundle.config))
    model.pipeline(group, split)
    # Every module path and parameter name the stage kept (`layers.3.attn.wq_a`, `norm.weight`):
    # a tensor is kept with its module (`.scales` and `.tq_packed` come with the swap below).
    held = set()
    for name, _ in tree_flatten(model.parameters()):
        parts = name.split(".")
        held.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    bundle.tensors = {
        k: a for k, a in bundle.tensors.items() if k in held or k.rpartition(".")[0] in held
    }
    bundle.formats = {k: f for k, f in bundle.formats.items() if k in held}
    bundle.affine = {k: bg for k, bg in bundle.affine.items() if k in held}
    return build_model(bundle, dtype, model)


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


def build_parser() -> argparse.ArgumentParser:
    """`make-bundle`'s parser (see `main`)."""
    p = argparse.ArgumentParser(prog="python -m bitnest_mlx.dsv4")
    sub = p.add_subparsers(dest="command", required=True)
    make = sub.add_parser(
        "make-bundle",
        help="write a random-weight bundle with Flash's dimensions and N layers, streaming",
    )
    make.add_argument("--layers", type=int, default=2, help="number of layers (default 2)")
    make.add_argument(
        "--first-layer",
        type=int,
        default=3,
        help="Flash layer the window starts at: its ratios and bit plan (default 3: ratios "
        "128, 4; gate/up 2-bit, down 4-bit)",
    )
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--tiny", action="store_true", help="toy dimensions (tests)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--max-shard-gb", type=float, default=1.0, help="largest shard (GB)")
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m bitnest_mlx.dsv4 make-bundle --layers N --out DIR [--tiny]`: a synthetic
    bundle at DeepSeek-V4-Flash's per-layer dimensions (formats/dsv4_synthetic.py)."""
    from .formats import dsv4_synthetic

    p = build_parser()
    args = p.parse_args(argv)
    try:
        path = dsv4_synthetic.write(
            args.out,
            args.layers,
            first_layer=args.first_layer,
            tiny=args.tiny,
            seed=args.seed,
            max_shard_bytes=int(args.max_shard_gb * 1e9),
        )
    except ValueError as e:
        p.error(str(e))
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(f"{path}: {size / 1e9:.3f} GB in {len(list(path.glob('*.safetensors')))} shards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
