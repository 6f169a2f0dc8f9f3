"""`bench --speed-model`: what a package reads per token and what that implies on Apple chips.

For a package (its manifest and config; no tensor is read), or for the package the converter's
defaults would write from a Hugging Face checkpoint's config.json (no weight read either: the
Llama-3.2-3B-dimension checkpoint of `examples/convert_real_size.sh` takes a second), the bytes
per token of the draft, the target and their lm_head (`roofline`), at each reduced draft
vocabulary asked for; then, for each chip, the target-only tok/s at its memory bandwidth and the
speculative tok/s at the best γ for an acceptance α measured elsewhere (the real-model page):
decoding is bandwidth-bound, so tok/s = bandwidth / bytes per token (docs/speculative.md).
Nothing here is measured on a Mac.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from ..convert.defaults import DEFAULT_GROUP_SIZE
from ..formats.bitnest import choose_group_size, is_package, linear_shapes
from ..formats.bitnest.reader import read_spec
from ..formats.bitnest.spec import PackageSpec
from ..formats.bitnest.writer import PackageWriter
from ..runtime.chips import PEAK_GBS
from ..runtime.speed_model import CostModel, best_iid_speedup
from .roofline import roofline

CHIPS = ("M1", "M2 Pro", "M3 Max", "M4 Max")
CONTEXT = 1024  # KV tokens the projection reads per step (a chat turn's worth)


def default_spec(checkpoint: Path) -> PackageSpec:
    """The spec `convert` with its defaults writes for the checkpoint's config (weights unread)."""
    from ..convert.source_base import complete_hf_config

    f = checkpoint / "config.json"
    config = complete_hf_config(json.loads(f.read_text(encoding="utf-8")), str(f))
    shapes = linear_shapes(config)
    group = choose_group_size({k for _, k in shapes.values()}, None, DEFAULT_GROUP_SIZE)
    qkv = ("q_proj", "k_proj", "v_proj") if config["model_type"] == "qwen2" else ()
    biased = {lin for lin in shapes if lin.rsplit(".", 1)[-1] in qkv}
    return PackageWriter.spec_for(
        config, biased=biased, had_k=None, group_size=group, r3=True, kv_group=32
    )


def skeleton(spec: PackageSpec):
    """The model the spec describes, its arrays never evaluated (sizes only: nothing allocated)."""
    from ..models.bitnest_llama import Model, ModelArgs

    return Model(ModelArgs.from_spec(spec))


def project(path: Path, sizes: dict[int | str, float | None], context: int = CONTEXT) -> dict:
    """Bytes per token and projected tok/s for each draft vocabulary size in `sizes` (K, 'full'
    or 'package', the package's own -> acceptance α, or None for bytes only)."""
    spec = read_spec(path) if is_package(path) else default_spec(path)
    rows = {}
    for size, alpha in sizes.items():
        k = spec.draft_vocab if size == "package" else 0 if size == "full" else size
        k = 0 if k >= spec.vocab_size else k
        roof = roofline(skeleton(replace(spec, draft_vocab=k)), context)
        per_token = roof["bytes_per_token"]
        row = {
            "draft_vocab": k or spec.vocab_size,
            "bytes_per_token": per_token,
            "lm_head_bytes_per_token": roof["lm_head_bytes_per_token"],
            "cost_ratio": per_token["draft"] / per_token["target"],
        }
        if alpha is not None:
            speedup, gamma = best_iid_speedup(alpha, CostModel(row["cost_ratio"]))
            row |= {"acceptance": alpha, "speedup": speedup, "gamma": gamma}
        row["chips"] = {}
        for chip in CHIPS:
            target = PEAK_GBS[chip] * 1e9 / per_token["target"]
            at_chip = {"bandwidth_gbs": PEAK_GBS[chip], "target_tps": target}
            if alpha is not None:  # v(M) differs by chip: so may the best γ
                speedup, gamma = best_iid_speedup(alpha, CostModel(row["cost_ratio"], chip))
                at_chip |= {"speedup": speedup, "gamma": gamma, "speculative_tps": target * speedup}
            else:
                at_chip["speculative_tps"] = None
            row["chips"][chip] = at_chip
        rows[str(size)] = row
    return {
        "model": str(path),
        "group_size": spec.group_size,
        "vocab_size": spec.vocab_size,
        "context_tokens": context,
        "rows": rows,
    }


def report(result: dict) -> str:
    lines = [
        f"{result['model']}: group {result['group_size']}, vocabulary {result['vocab_size']}, "
        f"{result['context_tokens']} context tokens (projected from bytes, not measured)"
    ]
    for size, r in result["rows"].items():
        b, h = r["bytes_per_token"], r["lm_head_bytes_per_token"]
        head = f"draft vocab {size}: MB/token draft {b['draft'] / 1e6:.0f} (lm_head "
        head += f"{h['draft'] / 1e6:.0f}), target {b['target'] / 1e6:.0f} (lm_head "
        head += f"{h['target'] / 1e6:.0f}), cost ratio {r['cost_ratio']:.3f}"
        if "speedup" in r:
            head += f"; α {r['acceptance']:.3f} -> {r['speedup']:.2f}x at γ {r['gamma']}"
        lines.append(head)
        for chip, c in r["chips"].items():
            spec = c["speculative_tps"]
            tail = "" if spec is None else f", speculative {spec:.1f}"
            lines.append(
                f"  {chip} ({c['bandwidth_gbs']} GB/s): target {c['target_tps']:.1f}{tail}"
            )
    return "\n".join(lines)
