"""`bench --dispatches`: kernels per decode token on the GPU basis, beside mlx-lm's, and the
issue's goals per layer-token (kernel path ≤ 1.25x mlx-lm's Llama at the same bits, pure path
≤ 3x for the target and 2x for the draft, a draft below its target, one host sync a round)."""

from __future__ import annotations

import json
from pathlib import Path

from ..formats.dsv4_bundle import is_bundle
from . import dispatches as d
from .speed_projection import spec_of

# Goals per layer-token, as multiples of mlx-lm's Llama (8-bit for the target, 4-bit for the
# draft) on the same config.
GOALS = {("kernel", "target"): 1.25, ("kernel", "draft"): 1.25, ("pure", "target"): 3.0,
         ("pure", "draft"): 2.0}  # fmt: skip
PEER_BITS = {"target": 8, "draft": 4}


def run_bitnest(model: str) -> dict:
    spec = spec_of(model)
    from ..models.bitnest_llama import ModelArgs

    args = ModelArgs.from_spec(spec)
    counts = d.count_bitnest(args)
    peers = {bits: d.count_mlx_lm_llama(args, bits) for bits in (4, 8)}
    goals = {}
    for (path, step), factor in GOALS.items():
        ours, peer = counts[path][step].per_layer, peers[PEER_BITS[step]].per_layer
        goals[f"{path}_{step}"] = {
            "per_layer": ours,
            "mlx_lm_per_layer": peer,
            "ratio": ours / peer,
            "goal_ratio": factor,
            "met": ours <= factor * peer,
        }
    for path in ("kernel", "pure"):
        draft, target = counts[path]["draft"].per_layer, counts[path]["target"].per_layer
        goals[f"{path}_draft_below_target"] = {
            "draft": draft,
            "target": target,
            "met": draft < target,
        }
    round_syncs = counts["kernel"][f"round_gamma_{d.ROUND_GAMMA}"].syncs
    goals["syncs_per_round"] = {"syncs": round_syncs, "goal": 1, "met": round_syncs <= 1}
    return {
        "model": model,
        "layers": spec.num_hidden_layers,
        "steps": {p: {k: c.as_dict() for k, c in s.items()} for p, s in counts.items()},
        "mlx_lm": {f"llama_{b}bit": c.as_dict() for b, c in peers.items()},
        "goals": goals,
    }


def run_dsv4(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    counts = d.count_dsv4(path)
    peer = d.count_deepseek_v3(config)
    return {
        "model": str(path.name),
        "layers": config["num_hidden_layers"],
        "steps": {p: c.as_dict() for p, c in counts.items()},
        "mlx_lm_deepseek_v3": peer.as_dict(),
        "goals": {
            p: {
                "per_layer": counts[p].per_layer,
                "ratio": counts[p].per_layer / peer.per_layer,
                "goal_ratio": g,
                "met": counts[p].per_layer <= g * peer.per_layer,
            }
            for p, g in (("kernel", 1.25), ("pure", 3.0))
        },
    }


def run(model: str, bundle: bool = True) -> dict:
    """The bitnest counts of `model` (or, for a DeepSeek-V4 bundle, its own), and the demo
    bundle's unless `bundle` is False."""
    from ..runtime.demo import demo_bundle_path, resolve_model

    out = {"basis": d.BASIS}
    path = Path(resolve_model(model))
    if is_bundle(path):
        out["deepseek_v4"] = run_dsv4(path)
        return out
    out["bitnest"] = run_bitnest(model)
    if bundle:
        out["deepseek_v4"] = run_dsv4(demo_bundle_path())
    return out


def _parts(parts: dict) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def _row(path: str, step: str, c: dict) -> str:
    per, out = f"{c['per_layer']:.4g}", f"{c['outside']:.4g}"
    return f"{path:7} {step:17} {per:>9} {out:>8} {c['syncs']:5d}  {_parts(c['per_layer_parts'])}"


def _goal(name: str, g: dict) -> str:
    detail = ", ".join(
        f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in g.items() if k != "met"
    )
    return f"  {name}: {'met' if g['met'] else 'NOT met'} ({detail})"


HEADER = f"{'path':7} {'step':17} {'per layer':>9} {'outside':>8} {'syncs':>5}  per layer by part"


def report(r: dict) -> str:
    lines = [f"basis: {r['basis']}"]
    if "bitnest" in r:
        b = r["bitnest"]
        lines += [
            f"\nbitnest {b['model']} ({b['layers']} layers): kernels per decode token",
            HEADER,
        ]
        lines += [_row(p, step, c) for p, steps in b["steps"].items() for step, c in steps.items()]
        lines += [_row("mlx-lm", name, c) for name, c in b["mlx_lm"].items()]
        lines += ["goals:", *(_goal(name, g) for name, g in b["goals"].items())]
    if "deepseek_v4" in r:
        v = r["deepseek_v4"]
        lines += [
            f"\nDeepSeek-V4 {v['model']} ({v['layers']} layers): kernels per decode token",
            HEADER,
        ]
        lines += [_row(p, "step", c) for p, c in v["steps"].items()]
        lines.append(_row("mlx-lm", "deepseek_v3 4bit", v["mlx_lm_deepseek_v3"]))
        lines += ["goals:", *(_goal(name, g) for name, g in v["goals"].items())]
    return "\n".join(lines)
