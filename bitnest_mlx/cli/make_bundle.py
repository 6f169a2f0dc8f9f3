"""`python -m bitnest_mlx.dsv4 make-bundle`: a synthetic DeepSeek-V4 bundle, random weights at
Flash's per-layer dimensions (or toy ones), written streaming (formats/dsv4_synthetic.py). For
measuring memory and speed at the real size without the real weights."""

from __future__ import annotations

import argparse


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
