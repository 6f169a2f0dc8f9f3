"""What a W4 chain can reach, and what a cheaper draft would have to be (issue 52).

    python examples/draft_frontier.py [--model llama-3.2-3b] [--context 2048] [--chip "M4 Max"]

The chain's speed-up over target-only at the best γ (1..8) for i.i.d. per-draft acceptance α,
priced by step time on the kernel path (`measurement.step_costs`: the package's bytes at the
context, the runtime's stored kernels a layer, a round's host sync), for the W4 draft as it is
and for hypothetical drafts: its kernels halved, no kernels at all (the floor of any kernel
work), a quarter of the target's bytes (what a 2-bit plane would read) at today's kernels, and
both. Beside each: the acceptance a chain needs for 1.4x, and target-only x 1.4 against
mlx-lm's 4-bit Llama of the same dims. Nothing here is measured; it is the step-time model.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
from bitnest_mlx.runtime.speed_model import best_iid_speedup
from bitnest_mlx.runtime.step_kernels import STORED
from bitnest_mlx.runtime.step_time import Step, step_seconds, tokens_per_second

ALPHAS = (0.7, 0.8, 0.85, 0.9, 0.95, 0.99)
GOAL = 1.4


def drafts(cost) -> dict[str, Step]:
    """The draft steps compared, from the package's own W4 draft step."""
    d, t = cost.draft_step, cost.target_step
    return {
        "W4 draft as built": d,
        "its kernels halved": Step(d.nbytes, d.kernels / 2, d.syncs),
        "no kernels (bytes only)": Step(d.nbytes, 0, d.syncs),
        "1/4 of the target's bytes": Step(t.nbytes / 4, d.kernels, d.syncs),
        "1/4 bytes, kernels halved": Step(t.nbytes / 4, d.kernels / 2, d.syncs),
    }


def needed_alpha(cost) -> float | None:
    """The least α (to 0.005) at which the best chain reaches GOAL, None if none below 1."""
    for i in range(500, 1000, 5):
        if best_iid_speedup(i / 1000, cost)[0] >= GOAL:
            return i / 1000
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-3b", help="a preset or a package")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chip", default="M4 Max")
    args = p.parse_args()
    model = skeleton(spec_of(args.model))
    cost = step_costs.cost_model(model, args.context, args.chip, "kernel", counts=STORED)
    target_s = step_seconds(cost.target_step, args.chip)
    peer = tokens_per_second(step_costs.peer_step(model.args, 4, args.context), args.chip)
    print(
        f"{args.model} at {args.context} tokens, {args.chip}, kernel path: target-only "
        f"{1 / target_s:.0f} tok/s, mlx-lm 4-bit {peer:.0f} tok/s; {GOAL}x target-only is "
        f"{GOAL / target_s / peer:.2f}x mlx-lm 4-bit\n"
    )
    head = " | ".join(f"α {a}" for a in ALPHAS)
    print(f"| draft | step / target step | {head} | α for {GOAL}x |")
    print("|---|---|" + "---|" * len(ALPHAS) + "---|")
    for name, step in drafts(cost).items():
        c = replace(cost, draft_step=step, cost_ratio=step.nbytes / cost.target_step.nbytes)
        cells = []
        for a in ALPHAS:
            speed, gamma = best_iid_speedup(a, c)
            cells.append(f"{speed:.2f}x (γ {gamma})")
        need = needed_alpha(c)
        print(
            f"| {name} | {step_seconds(step, args.chip) / target_s:.2f} | "
            + " | ".join(cells)
            + f" | {'none below 1' if need is None else f'{need:.3f}'} |"
        )


if __name__ == "__main__":
    main()
