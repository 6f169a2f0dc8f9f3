"""DeepSeek-V4 bundles -> model and tokenizer: what the loader's "dsv4" entry calls.

`load_model` reads a bundle (formats/dsv4_bundle.py, strict) and hands its tensors to the model,
which maps them itself (`Model.quantize_as` + `Model.sanitize`, models/deepseek_v4_weights.py,
as mlx-lm models do in `sanitize`); the weights load strictly. `python -m bitnest_mlx.runtime.dsv4
make-bundle` writes a synthetic bundle (formats/dsv4_synthetic.py). The tiny demo bundle and
random weights are in demo.py.
"""

from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    """`make-bundle`'s parser (see `main`)."""
    p = argparse.ArgumentParser(prog="python -m bitnest_mlx.runtime.dsv4")
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
    """`python -m bitnest_mlx.runtime.dsv4 make-bundle --layers N --out DIR [--tiny]`: a synthetic
    bundle at DeepSeek-V4-Flash's per-layer dimensions (formats/dsv4_synthetic.py)."""
    from ..formats import dsv4_synthetic

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
