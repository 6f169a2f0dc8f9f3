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

    python examples/workloads_table.py 'RUNS/*.json' --sources

One row per model, workload and temperature, the draft configurations side by side (issue 52):
each one's tokens per round and projected speed-up over target-only on an M4 Max's kernel path
at the package's own dims (as `bench --workloads` reports it) and at Llama-3.2-3B's (the mean
round re-priced, as above), the ratio to mlx-lm's 4-bit Llama of the same dims there, and
whether `chain+ngram` (auto) reaches the best single source (chain or ngram) at each. "auto,
fallback pipelined" re-prices auto's rounds as if its target-only rounds (the fallback's, and
ngram's rounds without a copy) were pipelined like target-only decoding, with no host sync each:
a change not built, priced from the logged rounds.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
from bitnest_mlx.measurement.workload_rounds import WorkloadRounds, round_cost
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


def projection_3b(r: dict, path: str = "pure", pipelined: bool = False) -> float:
    """The harmonic mean over prompts of each prompt's mean round at the 3B's step time;
    `pipelined`: with its target-only rounds paying no host sync (see `pipelined_own`)."""
    inverse = []
    for p in r["prompts"].values():
        src, tpr = p["sources"], p["tokens_per_round"]
        context = p["prompt_tokens"] + p["generated"] // 2
        cost = step_costs.cost_model(LLAMA_3B, context, "M4 Max", path, counts=STORED)
        saved = _target_rounds(p) / (p["generated"] / tpr) * cost.syncs() if pipelined else 0
        if tpr <= 1:
            inverse.append(1 / (1 + cost.syncs() - saved))
            continue
        rounds = WorkloadRounds(tpr, _totals(src, "model"), _totals(src, "ngram", "ngram+model"))
        inverse.append((round_cost(rounds, cost) - saved) / tpr)
    return len(inverse) / sum(inverse)


def _target_rounds(p: dict) -> float:
    """A prompt's target-only rounds: all its rounds but those a source drafted."""
    return p["generated"] / p["tokens_per_round"] - sum(v["rounds"] for v in p["sources"].values())


def pipelined_own(model, r: dict, chip: str = "M4 Max") -> float:
    """The kernel-path speed-up at own dims had the fallback's target-only rounds been
    pipelined as target-only decoding is (no host sync each; not built): each prompt's logged
    cost less a sync per target-only round, harmonic mean over the prompts."""
    inverse = []
    for p in r["prompts"].values():
        context = p["prompt_tokens"] + p["generated"] // 2
        cost = step_costs.cost_model(model, context, chip, "kernel", counts=STORED)
        spent = p["generated"] / p["projected_speedup"][chip]["kernel"]
        inverse.append((spent - _target_rounds(p) * cost.syncs()) / p["generated"])
    return len(inverse) / sum(inverse)


def target_over_peer4(model, r: dict, chip: str = "M4 Max") -> float:
    """Target-only tok/s over mlx-lm 4-bit's of `model`'s dims on `chip`'s kernel path, at the
    prompts' mean context (stored kernels a layer: the counts do not change with the dims)."""
    context = round(sum(p["prompt_tokens"] + p["generated"] / 2 for p in r["prompts"].values()))
    context //= len(r["prompts"])
    cost = step_costs.cost_model(model, context, chip, "kernel", counts=STORED)
    return step_costs.over_peer(cost, model.args, context)


SOURCES = ("chain", "ngram", "chain+ngram")


def source_rows(paths: list[str]) -> list[str]:
    """The --sources table: a row per model, workload and temperature."""
    out = []
    for path in sorted(paths):
        run = json.loads(Path(path).read_text())
        own = skeleton(spec_of(run["model"]))
        label = Path(run["model"]).name
        dims = run["settings"].get("controller_dims", "own")
        label += "" if dims == "own" else f" (plans at {dims})"
        for name, temps in run["workloads"].items():
            for temp, configs in temps.items():
                out.append(source_row(label, own, name, temp, configs))
    return out


def source_row(model: str, own, name: str, temp: str, configs: dict) -> str:
    have = [c for c in SOURCES if c in configs]
    cells, verdicts = [], []
    for where in ("own", "3b"):
        speed = {
            c: configs[c]["projected_speedup"]["M4 Max"]["kernel"]
            if where == "own"
            else projection_3b(configs[c], "kernel")
            for c in have
        }
        ratio = target_over_peer4(own if where == "own" else LLAMA_3B, configs[have[0]])
        cells.append(" / ".join(f"{speed[c]:.2f}x" for c in have))
        cells.append(f"{speed.get('chain+ngram', max(speed.values())) * ratio:.2f}")
        if "chain+ngram" in speed:
            auto = configs["chain+ngram"]
            piped = (
                pipelined_own(own, auto) if where == "own" else projection_3b(auto, "kernel", True)
            )
            cells.append(f"{piped:.2f}x")
        if "chain+ngram" in speed and len(speed) > 1:
            single = max(v for c, v in speed.items() if c != "chain+ngram")
            gap = speed["chain+ngram"] / single - 1
            verdicts.append("yes" if gap >= 0 else f"**no** ({100 * gap:+.1f} %)")
    tpr = " / ".join(f"{configs[c]['tokens_per_round']:.2f}" for c in have)
    return (
        f"| {model} | {name} | {temp} | {tpr} | "
        + " | ".join(cells)
        + (f" | {' / '.join(verdicts)} |")
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", help="glob of bench --workloads --json outputs")
    p.add_argument("--sources", action="store_true", help="the draft configurations side by side")
    args = p.parse_args()
    if args.sources:
        print(
            "| model | workload | T | tokens/round (chain / ngram / auto) | M4 Max kernel, own "
            "dims | auto vs mlx-lm 4-bit | auto, fallback pipelined | 3B at M4 Max kernel "
            "| auto vs mlx-lm 4-bit | auto, fallback pipelined | auto ≥ best single (own / 3B) |"
            "\n|---|---|---|---|---|---|---|---|---|---|---|"
        )
        print("\n".join(source_rows(glob.glob(args.runs))))
        return
    print(
        "| model | workload | T | drafts | tokens/round | M1 | M3 Max | M4 Max | 3B at M4 Max "
        "| accepted/drafted by source |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    print("\n".join(rows(glob.glob(args.runs))))


if __name__ == "__main__":
    main()
