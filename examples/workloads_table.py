"""The workload table of examples/real_model.md from `bench --workloads --json` outputs.

    python examples/workloads_table.py 'RUNS/qwen05-*.json' --model PACKAGE [--c3b 0.516]

One row per model, workload, temperature and draft configuration: tokens per round as generated,
the projected speed-up on M1, M3 Max and M4 Max (pure path; kernel path in brackets), the
per-source acceptance, and the Llama-3.2-3B-dimension projection at M4 Max (pure path) from
the same rounds. That last column re-prices the rounds with the 3B's draft / target bytes ratio
`--c3b` (0.516: docs/speculative.md, the full draft vocabulary at 1024 context): a round's cost
is c·D + V with D its draft steps and V its verify passes in target steps, so the 0.5B's
projection gives V = tokens / speedup - c₀·D, and the 3B's is tokens / (c₃·D + V). D counts
one step per W4 token: exact for chains, a little low for copies extended by the chain
(their first call reads the copy too; the rows say how many such rounds there were). The KV
share of the verify pass is the 0.5B's at its context (small for both at these lengths).
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

import bitnest_mlx
from bitnest_mlx.measurement.workloads import cost_models

CHIPS = ("M1", "M3 Max", "M4 Max")


def rows(paths: list[str], c3b: float, bitnest) -> list[str]:
    out = []
    for path in sorted(paths):
        run = json.loads(Path(path).read_text())
        model = Path(run["model"]).name
        for name, temps in run["workloads"].items():
            for temp, configs in temps.items():
                for config, r in configs.items():
                    for p in r["prompts"].values():  # the 0.5B's c where the prompt ran
                        context = p["prompt_tokens"] + p["generated"] // 2
                        p["cost_ratio"] = cost_models(bitnest, context, ("M4 Max",))["M4 Max"][
                            "pure"
                        ].cost_ratio
                    out.append(row(model, name, temp, config, r, c3b, run))
    return out


def row(model: str, name: str, temp: str, config: str, r: dict, c3b: float, run: dict) -> str:
    s = r["projected_speedup"]
    speed = " | ".join(f"{s[c]['pure']:.2f}x ({s[c]['kernel']:.2f}x)" for c in CHIPS)
    sources = ", ".join(
        f"{k} {v['accepted']}/{v['drafted']}" for k, v in sorted(r["sources"].items())
    )
    return (
        f"| {model} | {name} | {temp} | {config} | {r['tokens_per_round']:.2f} | {speed} | "
        f"{projection_3b(r, c3b):.2f}x | {sources} |"
    )


def projection_3b(r: dict, c3b: float) -> float:
    """The harmonic mean over prompts of each prompt's rounds re-priced at the 3B's c."""
    inverse = []
    for p in r["prompts"].values():
        tokens = p["generated"]
        steps = sum(v["drafted"] for k, v in p["sources"].items() if k == "model")
        steps += sum(v["rounds"] for k, v in p["sources"].items() if k == "ngram+model")
        spent = tokens / p["projected_speedup"]["M4 Max"]["pure"]
        verify = spent - p["cost_ratio"] * steps
        inverse.append((c3b * steps + verify) / tokens)
    return len(inverse) / sum(inverse)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", help="glob of bench --workloads --json outputs")
    p.add_argument("--model", required=True, help="the package the runs decoded (its bytes)")
    p.add_argument("--c3b", type=float, default=0.516)
    args = p.parse_args()
    model, _ = bitnest_mlx.load(args.model)
    print(
        "| model | workload | T | drafts | tokens/round | M1 | M3 Max | M4 Max | 3B at M4 Max "
        "| accepted/drafted by source |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows(glob.glob(args.runs), args.c3b, model)))


if __name__ == "__main__":
    main()
