"""The workload table of examples/real_model.md from `bench --workloads --json` outputs.

    python examples/workloads_table.py 'RUNS/qwen05-*.json'

One row per model, workload, temperature and draft configuration: tokens per round as generated,
the projected speed-up on M1, M3 Max and M4 Max (pure path; kernel path in brackets; by step
time, as `bench --workloads` reports it), the per-source acceptance, and the
Llama-3.2-3B-dimension projection at M4 Max (pure path) from the same rounds. That last column
prices each prompt's mean round (`measurement.workload_rounds`) at the 3B's step time: its bytes
at the prompt's context and the runtime's stored kernels a layer (`step_kernels.STORED`, the
counter's on the demo's structure; `bench --speed-model --model llama-3.2-3b` counts them at
the 3B's dims). Copies extended by the chain count as copies (no draft step).
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
from bitnest_mlx.measurement.workload_rounds import WorkloadRounds, speedup_at
from bitnest_mlx.runtime.step_kernels import STORED

CHIPS = ("M1", "M3 Max", "M4 Max")
LLAMA_3B = skeleton(spec_of("llama-3.2-3b"))


def rows(paths: list[str]) -> list[str]:
    out = []
    for path in sorted(paths):
        run = json.loads(Path(path).read_text())
        model = Path(run["model"]).name
        for name, temps in run["workloads"].items():
            for temp, configs in temps.items():
                for config, r in configs.items():
                    out.append(row(model, name, temp, config, r))
    return out


def row(model: str, name: str, temp: str, config: str, r: dict) -> str:
    s = r["projected_speedup"]
    speed = " | ".join(f"{s[c]['pure']:.2f}x ({s[c]['kernel']:.2f}x)" for c in CHIPS)
    sources = ", ".join(
        f"{k} {v['accepted']}/{v['drafted']}" for k, v in sorted(r["sources"].items())
    )
    return (
        f"| {model} | {name} | {temp} | {config} | {r['tokens_per_round']:.2f} | {speed} | "
        f"{projection_3b(r):.2f}x | {sources} |"
    )


def _totals(sources: dict, *names: str) -> tuple[int, int]:
    """(accepted, drafted) of the named sources."""
    return tuple(sum(sources.get(n, {}).get(k, 0) for n in names) for k in ("accepted", "drafted"))


def projection_3b(r: dict) -> float:
    """The harmonic mean over prompts of each prompt's mean round at the 3B's step time."""
    inverse = []
    for p in r["prompts"].values():
        src, tpr = p["sources"], p["tokens_per_round"]
        rounds = WorkloadRounds(tpr, _totals(src, "model"), _totals(src, "ngram", "ngram+model"))
        context = p["prompt_tokens"] + p["generated"] // 2
        cost = step_costs.cost_model(LLAMA_3B, context, "M4 Max", "pure", counts=STORED)
        inverse.append(1 / speedup_at(rounds, cost) if tpr > 1 else 1 / (1 + cost.syncs()))
    return len(inverse) / sum(inverse)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", help="glob of bench --workloads --json outputs")
    args = p.parse_args()
    print(
        "| model | workload | T | drafts | tokens/round | M1 | M3 Max | M4 Max | 3B at M4 Max "
        "| accepted/drafted by source |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows(glob.glob(args.runs))))


if __name__ == "__main__":
    main()
