"""`bench --workloads`: the built-in workloads (`workloads`) through the real speculative loop,
with tokens per round, per-source stats and the projected speed-up per chip.

Nothing here measures a Mac: the speed-ups are the logged rounds priced at each chip's v(M)
(`runtime.speed_model`), in target steps. The flags and the printing are bench's
(`cli/bench_modes.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.nn as nn

from ..layers.dual_plane import keep_dense
from ..runtime.speed_model import CostModel, verify_table
from ..runtime.step_kernels import STORED, run_chip, run_path
from .speed_projection import skeleton, spec_of
from .step_costs import cost_model
from .workloads import PROJECT_CHIPS, run_workloads


def plan_costs(
    model: nn.Module, path: str | None, dims: str | None
) -> Callable[[int], CostModel] | None:
    """context -> the CostModel the runs plan with: the step time of `path` (default: the path
    the model takes here) at the dims of `dims` (a preset or package; default the model's own,
    its kernels counted; a preset's are the runtime's stored kernels a layer, as
    `bench --speed-model` prices it), on the chip the run plans for. None when neither is set."""
    if path is None and dims is None:
        return None
    path = path or run_path(model)
    priced = model if dims is None else skeleton(spec_of(dims))
    counts = None if dims is None else STORED
    return lambda context: cost_model(priced, context, run_chip(), path, counts=counts)


def run(
    model: nn.Module,
    tokenizer,
    workloads: Sequence[str],
    configs: Sequence[str],
    temps: Sequence[float],
    tokens: int,
    seed: int,
    num_draft_tokens: int,
    ngram_tokens: int,
    progress: Callable[[str], None],
    draft_vocab_join: bool = True,
    dense_weights: bool = False,
    plan_path: str | None = None,
    plan_dims: str | None = None,
) -> dict:
    """`run_workloads` on a loaded package (its W4 and W8 kept as float matrices first with
    `dense_weights`), with the v(M) table the projections used."""
    if dense_weights:
        keep_dense(model)
    result = run_workloads(
        model,
        tokenizer,
        workloads,
        configs,
        temps,
        tokens,
        seed,
        num_draft_tokens,
        ngram_tokens,
        progress,
        draft_vocab_join=draft_vocab_join,
        plan=plan_costs(model, plan_path, plan_dims),
    )
    result = {**result, "verify_cost": verify_table()}
    result["settings"]["dense_weights"] = dense_weights
    result["settings"]["controller_path"] = plan_path or run_path(model)
    result["settings"]["controller_dims"] = plan_dims or "own"
    return result


def report(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"{result['model']}: {s['gen_tokens']} tokens per prompt, seed {s['seed']}, at most "
        f"{s['num_draft_tokens']} W4 draft tokens and {s['ngram_tokens']} copied per round; "
        f"plans priced at {s['controller_chip']}'s v(M). Speed-ups are projections (rounds "
        "priced at each chip's v(M), pure / kernel path), not Mac measurements.",
        f"{'workload':<11} {'T':>4} {'drafts':<12} {'tok/round':>9}  "
        + "  ".join(f"{c + ' pure/kernel':>20}" for c in PROJECT_CHIPS)
        + "  sources (accepted of drafted)",
    ]
    for name, temps in result["workloads"].items():
        for temp, configs in temps.items():
            for config, r in configs.items():
                speed = r["projected_speedup"]
                sources = ", ".join(
                    f"{k} {v['accepted']}/{v['drafted']}" for k, v in sorted(r["sources"].items())
                )
                lines.append(
                    f"{name:<11} {temp:>4} {config:<12} {r['tokens_per_round']:>9.2f}  "
                    + "  ".join(
                        f"{speed[c]['pure']:>12.2f}x/{speed[c]['kernel']:.2f}x"
                        for c in PROJECT_CHIPS
                    )
                    + f"  {sources}"
                )
    return "\n".join(lines)
