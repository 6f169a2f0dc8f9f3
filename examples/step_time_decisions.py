"""Issue 50 item 5: the γ caps, token trees and the server's batch rule re-decided by step time.

    python examples/step_time_decisions.py [--model llama-3.2-3b] [--context 2048] [--stored]

For the package (a preset, checkpoint or package, as `bench --speed-model` reads it) at its
bytes per token at `--context` tokens and its kernels counted from its graph (`--stored`: the
runtime's stored kernels a layer instead, seconds instead of minutes), on each chip and path:

* caps: the best W4 chain γ at i.i.d. acceptance α with the cap at 3 (the default
  `--num-draft-tokens`) and at 8, and the best copy length (no draft step) at copy acceptance
  α under the cap of 8 (`--ngram-tokens`);
* trees: a static tree of w branches at each of d levels (draft calls of 1, w, ... rows, a
  verify pass of w·d + 1 rows), against a chain of d: the tokens per round it must add to pay;
* batches: aggregate tok/s of B streams decoded as one target batch (a pass of B rows, each
  row its own KV) against B streams each running a workload table's mean round in one batch
  (B·(γ + 1) rows, up to the 16 v(M) is measured at; batched speculation is not built: this
  asks whether it would pay).

All are projections by step time (docs/step-time.md): bytes and kernels counted here, f, t_k,
t_sync and v(M) for a Mac to confirm.
"""

from __future__ import annotations

import argparse

from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
from bitnest_mlx.measurement.workload_rounds import DEFAULTS_QWEN05
from bitnest_mlx.runtime.speed_model import PATHS, CostModel, Round, iid_tokens_per_round
from bitnest_mlx.runtime.step_kernels import STORED
from bitnest_mlx.runtime.token_bytes import kv_bytes

CHIPS = ("M1", "M4 Max")
# v(M) is measured to 16 rows (`speed_model.PURE_VERIFY`); past them a batch's rows are unpriced.
MAX_ROWS = 16
ALPHAS = (0.6, 0.7, 0.8, 0.9)


def best_chain(cost: CostModel, alpha: float, cap: int) -> tuple[float, int]:
    return max((iid_tokens_per_round(alpha, g) / cost.chain(g), g) for g in range(1, cap + 1))


def best_copy(cost: CostModel, alpha: float, cap: int = 8) -> tuple[float, int]:
    spent = lambda n: cost.round(Round("ngram", n, 0))
    return max((iid_tokens_per_round(alpha, n) / spent(n), n) for n in range(1, cap + 1))


def tree_cost(cost: CostModel, w: int, d: int) -> float:
    return cost.round(Round("tree", w * d, 0, (1, *[w] * (d - 1))))


def pass_seconds(cost: CostModel, draft: bool, streams: int, rows_each: float, kv: dict) -> float:
    """One pass of `streams` x `rows_each` rows: the weights at v(all rows), each stream's own
    KV at its bytes (KV4 for the draft, KV8 for the target; their rows' extra ALU work, a few %
    of a step at 2k, is left out), the pass's kernels once."""
    c = cost.constants
    step, kv_each = (cost.draft_step, kv[4]) if draft else (cost.target_step, kv[8])
    rows = streams * rows_each
    kernels = step.kernels if draft else cost.target_kernels(rows)
    v = CostModel(1.0, cost.chip, cost.path).verify(rows)  # the weights' v(M), no KV share
    weights = c.bytes_seconds(step.nbytes - kv_each) * v
    return weights + streams * c.bytes_seconds(kv_each) + kernels * c.t_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.2-3b")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--stored", action="store_true", help="the runtime's stored kernels a layer")
    a = p.parse_args()
    net = skeleton(spec_of(a.model))
    counts = STORED if a.stored else None
    kv = {bits: n * a.context for bits, n in kv_bytes(net.args).items()}
    for chip in CHIPS:
        for path in PATHS:
            cost = step_costs.cost_model(net, a.context, chip, path, counts=counts)
            k = cost.target_step.kernels
            print(f"\n## {chip}, {path} path ({k:.0f} kernels a target step)")
            print("caps | α | best chain γ ≤ 3 | γ ≤ 8 | best copy ≤ 8 (α of copies)")
            for alpha in ALPHAS:
                (s3, g3), (s8, g8) = (best_chain(cost, alpha, cap) for cap in (3, 8))
                sc, n = best_copy(cost, alpha)
                print(f"  {alpha} | {s3:.3f}x (γ {g3}) | {s8:.3f}x (γ {g8}) | {sc:.3f}x ({n})")
            print("trees | w x d | tree / chain cost (what it must add to tokens per round)")
            for w in (2, 3, 4):
                row = [
                    f"d {d}: {tree_cost(cost, w, d) / cost.chain(d) - 1:+.1%}" for d in (1, 2, 3)
                ]
                print(f"  {w} | " + ", ".join(row))
            step = cost.target_seconds()
            print(
                "batches | B | target batch tok/s | speculating batch tok/s (code_edit T0, chat T0)"
            )
            for streams in (1, 2, 4, 8):
                target = streams / pass_seconds(cost, False, streams, 1, kv)
                spec = []
                for name in ("code_edit T0", "chat T0"):
                    r = DEFAULTS_QWEN05[name]
                    if streams * (r.drafted_per_round + 1) > MAX_ROWS:
                        spec.append("-")
                        continue
                    t = r.draft_steps_per_round * pass_seconds(cost, True, streams, 1, kv)
                    t += pass_seconds(cost, False, streams, r.drafted_per_round + 1, kv)
                    t += cost.syncs() * step
                    spec.append(f"{streams * r.tokens_per_round / t:.1f}")
                print(f"  {streams} | {target:.1f} | " + ", ".join(spec))


if __name__ == "__main__":
    main()
