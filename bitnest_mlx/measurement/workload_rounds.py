"""The workload table's rounds, as `bench --speed-model` re-prices them at another package's
costs: tokens per round and what drafted them, per workload and temperature.

The rounds: examples/real_model.md, "At the defaults, after the end-of-sequence fix" (issue 40,
2026-12-07): Qwen2.5-Coder-0.5B as `convert` writes it, `bench --workloads` at every default
(`auto` drafts: W4 chains, copies from the context, copies extended by the chain, or target
steps; at most 3 W4 and 8 copied tokens a round; seed 0; 256 tokens a prompt or to its end;
three prompts a workload; dense weights on this project's CPU). Its rounds were planned with
the bytes-only costs of an M4 Max on the pure path; a package of other dims and costs would
plan its own, and its acceptance is not measured here.

From a row's totals the mean round is: rounds = accepted / (tokens per round - 1) (each round
emits its accepted drafts and one token of the target), drafted rows and W4 draft steps per
round. A round is priced as its mean: `speedup_at` = tokens per round / (W4 steps · a 1-row
draft call + a verify pass of drafted + 1 rows + the round's syncs), v(M) interpolated at the
mean rows. That is exact where a pass costs a line in its rows (kernel-bound steps nearly are)
and low where v(M) bends (the pure path past MAX_M rows), and it counts a copy extended by the
chain's first call as one row.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.speed_model import CostModel


@dataclass(frozen=True)
class WorkloadRounds:
    """One row of the workload table: tokens per round as generated, and accepted / drafted
    tokens by the W4 chain and by copies, summed over its prompts."""

    tokens_per_round: float
    model: tuple[int, int]
    ngram: tuple[int, int]

    @property
    def rounds(self) -> float:
        return (self.model[0] + self.ngram[0]) / (self.tokens_per_round - 1)

    @property
    def drafted_per_round(self) -> float:
        return (self.model[1] + self.ngram[1]) / self.rounds

    @property
    def draft_steps_per_round(self) -> float:
        return self.model[1] / self.rounds


# Qwen2.5-Coder-0.5B at the defaults (the table named in the module docstring): tokens/round,
# W4 accepted/drafted, copies accepted/drafted.
DEFAULTS_QWEN05 = {
    "code_edit T0": WorkloadRounds(4.97, (6, 6), (614, 662)),
    "code_edit T0.7": WorkloadRounds(4.29, (31, 35), (564, 624)),
    "passage_qa T0": WorkloadRounds(2.75, (53, 57), (133, 175)),
    "passage_qa T0.7": WorkloadRounds(2.69, (76, 88), (96, 133)),
    "chat T0": WorkloadRounds(2.89, (259, 282), (172, 258)),
    "chat T0.7": WorkloadRounds(2.49, (265, 309), (142, 226)),
    "free T0": WorkloadRounds(2.60, (179, 212), (297, 377)),
    "free T0.7": WorkloadRounds(2.40, (313, 367), (138, 204)),
}


def round_cost(r: WorkloadRounds, cost: CostModel) -> float:
    """The mean round of `r` in target-only steps at `cost`."""
    draft = r.draft_steps_per_round * cost.draft((1,))
    return draft + cost.verify_pass(r.drafted_per_round + 1) + cost.syncs()


def speedup_at(r: WorkloadRounds, cost: CostModel) -> float:
    """Speculative tok/s over target-only of `r`'s mean round at `cost`."""
    return r.tokens_per_round / round_cost(r, cost)
