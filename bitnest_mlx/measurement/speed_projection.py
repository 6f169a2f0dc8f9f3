"""`bench --speed-model`: what a package reads and launches per token and what that implies on
Apple chips.

For a package (its manifest and config; no tensor is read), for the package the converter's
defaults would write from a Hugging Face checkpoint's config.json, or for a preset of `convert
make-checkpoint` (llama-3.2-3b; no weight read either), at each reduced draft vocabulary asked
for: the bytes per token of the draft, the target and their lm_head (`roofline`) at CONTEXT
tokens. Then for each chip and path (kernel, pure), priced by step time (runtime/step_time.py:
bytes / (f · bandwidth) + kernels · t_k + syncs · t_sync) with the kernels counted from the
package's own graph (`step_costs`): the draft's and the target's tok/s as decoders, the
speculative tok/s at the best γ for an acceptance α measured elsewhere, and at the workload
table's rounds (`workload_rounds`); beside them mlx-lm's Llama at 4 and 8 bits on the same dims,
counted and priced the same way.

Counted here: bytes from the package's shapes, kernels and host syncs from the graphs on the GPU
basis. What a Mac must confirm: f and t_k (fitted on an M4 Max, carried over to other chips,
`step_time.provenance`), t_sync (assumed), v(M) (`speed_model`), and the counts themselves.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path

from ..convert.defaults import DEFAULT_GROUP_SIZE
from ..formats.bitnest import choose_group_size, is_package, linear_shapes
from ..formats.bitnest.reader import read_spec
from ..formats.bitnest.spec import PackageSpec
from ..formats.bitnest.writer import PackageWriter
from ..runtime.speed_model import PATHS, CostModel, best_iid_speedup
from ..runtime.step_time import provenance, step_seconds, tokens_per_second
from . import step_costs
from .roofline import roofline
from .workload_rounds import DEFAULTS_QWEN05, speedup_at

CHIPS = ("M1", "M3 Max", "M4 Max", "M3 Ultra")
# KV tokens a projected step reads: mlx-lm's benchmark prompt (`mlx_lm.benchmark -p 2048`), the
# conditions the step-time constants were fitted under (docs/step-time.md).
CONTEXT = 2048
PEER_BITS = (4, 8)
BASIS = (
    "projected, not measured: step time = bytes / (f x bandwidth) + kernels x t_k + syncs x "
    "t_sync. Counted here: bytes from the shapes, kernels and syncs from the graphs (GPU "
    "basis). A Mac must confirm f and t_k (fitted on an M4 Max, assumed elsewhere), t_sync "
    "(assumed), v(M) and the counts (bitnest-doctor measures t_k and t_sync)"
)


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


def spec_of(model: str | Path) -> PackageSpec:
    """The spec of a package, of `demo`, or of the package convert's defaults would write from
    a checkpoint folder or a preset name of `convert make-checkpoint` (llama-3.2-3b)."""
    from ..convert.checkpoint import PRESETS, preset
    from ..runtime.demo import resolve_model

    if str(model) in PRESETS:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(preset(str(model))))
            return default_spec(Path(tmp))
    path = Path(resolve_model(str(model)))
    return read_spec(path) if is_package(path) else default_spec(path)


def skeleton(spec: PackageSpec):
    """The model the spec describes, its arrays never evaluated (sizes only: nothing allocated)."""
    from ..models.bitnest_llama import Model, ModelArgs

    return Model(ModelArgs.from_spec(spec))


def _at_path(cost: CostModel, alpha: float | None, workloads: bool) -> dict:
    """tok/s of the draft and the target as decoders on `cost`'s chip and path, and speculative
    at the best γ for `alpha` and at the workload table's rounds."""
    c = cost.constants
    target = 1 / cost.target_seconds()
    out = {
        "draft_tps": 1 / step_seconds(cost.draft_step, c),
        "target_tps": target,
        "target_ms": {
            "bytes": c.bytes_seconds(cost.target_step.nbytes) * 1e3,
            "kernels": cost.target_step.kernels * c.t_kernel * 1e3,
        },
    }
    if alpha is not None:  # v(M) and the kernels' share differ by chip: so may the best γ
        speedup, gamma = best_iid_speedup(alpha, cost)
        out |= {"speedup": speedup, "gamma": gamma, "speculative_tps": target * speedup}
    if workloads:
        out["workloads"] = {
            name: {"speedup": speedup_at(r, cost), "speculative_tps": target * speedup_at(r, cost)}
            for name, r in DEFAULTS_QWEN05.items()
        }
    return out


def project(
    model: str | Path, sizes: dict[int | str, float | None], context: int = CONTEXT
) -> dict:
    """Bytes and kernels per token and projected tok/s for each draft vocabulary size in `sizes`
    (K, 'full' or 'package', the package's own -> acceptance α, or None for none), the workload
    table's rounds at the first size, and mlx-lm's Llama at PEER_BITS on the same dims."""
    spec = spec_of(model)
    args = skeleton(spec).args
    # Counted once, at the package's own draft vocabulary: a reduced one's head adds 2 kernels to
    # a draft step outside the layers on the demo, not worth a count each (about 17 min at 3B here)
    counts = step_costs.counted(args)
    rows = {}
    for i, (size, alpha) in enumerate(sizes.items()):
        k = spec.draft_vocab if size == "package" else 0 if size == "full" else size
        k = 0 if k >= spec.vocab_size else k
        net = skeleton(replace(spec, draft_vocab=k))
        roof = roofline(net, context)
        per_token = roof["bytes_per_token"]
        row = {
            "draft_vocab": k or spec.vocab_size,
            "bytes_per_token": per_token,
            "lm_head_bytes_per_token": roof["lm_head_bytes_per_token"],
            "cost_ratio": per_token["draft"] / per_token["target"],
        }
        if alpha is not None:
            row["acceptance"] = alpha
        row["chips"] = {}
        for chip in CHIPS:
            costs = {p: step_costs.cost_model(net, context, chip, p, counts=counts) for p in PATHS}
            row["chips"][chip] = {
                "bandwidth_gbs": costs["pure"].constants.bandwidth_gbs,
                "kernels_per_token": {
                    p: {"draft": c.draft_step.kernels, "target": c.target_step.kernels}
                    for p, c in costs.items()
                },
                **{p: _at_path(c, alpha, workloads=i == 0) for p, c in costs.items()},
            }
        rows[str(size)] = row
    peers = {f"{b}bit": step_costs.peer_step(args, b, context) for b in PEER_BITS}
    return {
        "model": str(model),
        "basis": BASIS,
        "group_size": spec.group_size,
        "vocab_size": spec.vocab_size,
        "layers": spec.num_hidden_layers,
        "context_tokens": context,
        "constants": {chip: provenance(chip) for chip in CHIPS},
        "rows": rows,
        "mlx_lm": {
            name: {
                "bytes_per_token": s.nbytes,
                "kernels_per_token": s.kernels,
                "tps": {chip: tokens_per_second(s, chip) for chip in CHIPS},
            }
            for name, s in peers.items()
        },
    }


def _size_lines(size: str, r: dict) -> list[str]:
    b, h = r["bytes_per_token"], r["lm_head_bytes_per_token"]
    head = f"\ndraft vocab {size}: MB/token draft {b['draft'] / 1e6:.0f} (lm_head "
    head += f"{h['draft'] / 1e6:.0f}), target {b['target'] / 1e6:.0f} (lm_head "
    head += f"{h['target'] / 1e6:.0f}), cost ratio {r['cost_ratio']:.3f}"
    if "acceptance" in r:
        head += f", α {r['acceptance']:.3f}"
    kernels = next(iter(r["chips"].values()))["kernels_per_token"]
    lines = [
        head,
        "  kernels a token: "
        + "; ".join(
            f"{p} path draft {k['draft']:.0f}, target {k['target']:.0f}" for p, k in kernels.items()
        ),
        "  chip (GB/s)          path    draft tok/s  target tok/s (ms bytes + kernels)"
        "  speculative",
    ]
    for chip, c in r["chips"].items():
        for path in PATHS:
            x, ms = c[path], c[path]["target_ms"]
            spec = (
                ""
                if "speedup" not in x
                else (f"{x['speculative_tps']:.1f} ({x['speedup']:.2f}x, γ {x['gamma']})")
            )
            lines.append(
                f"  {chip + ' (' + str(c['bandwidth_gbs']) + ')':20} {path:7} "
                f"{x['draft_tps']:11.1f}  {x['target_tps']:12.1f} ({ms['bytes']:.1f} + "
                f"{ms['kernels']:.1f})  {spec}"
            )
    return lines


def _workload_lines(size: str, chips: dict) -> list[str]:
    lines = [
        f"\nworkload table's rounds (workload_rounds: the 0.5B's at the defaults) at draft vocab "
        f"{size}: speculative tok/s (speed-up over target-only)"
    ]
    for path in PATHS:
        lines.append(f"  {path} path: " + ", ".join(chips))
        for name in DEFAULTS_QWEN05:
            cells = [chips[c][path]["workloads"][name] for c in chips]
            lines.append(
                f"    {name:16} "
                + "  ".join(f"{w['speculative_tps']:7.1f} ({w['speedup']:.2f}x)" for w in cells)
            )
    return lines


def report(result: dict) -> str:
    """The projection as text: per draft vocabulary, chip and path; the workloads; mlx-lm."""
    lines = [
        f"{result['model']}: group {result['group_size']}, vocabulary {result['vocab_size']}, "
        f"{result['layers']} layers, {result['context_tokens']} context tokens",
        f"basis: {result['basis']}",
    ]
    for size, r in result["rows"].items():
        lines += _size_lines(size, r)
    first = next(iter(result["rows"]))
    lines += _workload_lines(first, result["rows"][first]["chips"])
    lines.append(f"\nmlx-lm's Llama on the same dims (group {step_costs.PEER_GROUP}, float16 KV):")
    for name, peer in result["mlx_lm"].items():
        tps = ", ".join(f"{chip} {t:.1f}" for chip, t in peer["tps"].items())
        lines.append(
            f"  {name}: {peer['bytes_per_token'] / 1e6:.0f} MB and {peer['kernels_per_token']:.0f} "
            f"kernels a token; tok/s {tps}"
        )
    lines.append("\nconstants: " + "; ".join(f"{c}: {p}" for c, p in result["constants"].items()))
    return "\n".join(lines)


def markdown(result: dict, path: str = "kernel") -> str:
    """The docs' tables on `path` (docs/step-time.md): tok/s per chip beside mlx-lm's, and the
    speculative tok/s at the workload table's rounds, for the first draft vocabulary."""
    r = next(iter(result["rows"].values()))
    chips = r["chips"]
    peers = result["mlx_lm"]
    out = [
        "| chip | mlx-lm 4-bit | mlx-lm 8-bit | bitnest draft | bitnest target "
        "| target / mlx-lm 8-bit |",
        "|---|---|---|---|---|---|",
    ]
    for chip, c in chips.items():
        x, q4, q8 = c[path], peers["4bit"]["tps"][chip], peers["8bit"]["tps"][chip]
        out.append(
            f"| {chip} | {q4:.1f} | {q8:.1f} | {x['draft_tps']:.1f} | {x['target_tps']:.1f} | "
            f"{x['target_tps'] / q8:.2f}x |"
        )
    out += [
        "",
        "| workload | tokens/round | " + " | ".join(chips) + " |",
        "|---|---|" + "---|" * len(chips),
    ]
    for name, rounds in DEFAULTS_QWEN05.items():
        cells = [chips[c][path]["workloads"][name] for c in chips]
        out.append(
            f"| {name} | {rounds.tokens_per_round:.2f} | "
            + " | ".join(f"{w['speculative_tps']:.1f} ({w['speedup']:.2f}x)" for w in cells)
            + " |"
        )
    return "\n".join(out)
