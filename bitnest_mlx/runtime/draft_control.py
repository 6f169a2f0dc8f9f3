"""What each round drafts: the W4 draft's chain, an n-gram copy from the context, the copy
extended by the W4 draft, or nothing (a target-only step), chosen by expected tokens per cost.

A plan of γ tokens emits E = Σ_{i=0..γ} Π_{j<i} α_j tokens (α_j: the measured acceptance of the
source that drafts position j) and costs its draft calls plus a verify pass of γ + 1 rows.
Costs are either measured (wall time of this run) or fixed: `speed_model.CostModel`, in
target steps: v(M) on the bytes, and where it is given the draft's and target's kernels, the
launches and the round's host sync too (step time, docs/step-time.md). Seeded runs use fixed
costs so that their plans depend on the acceptances only, never on timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .speed_model import CostModel, Round

DRAFT_SOURCES = ("auto", "model", "ngram", "none")


@dataclass(frozen=True)
class Plan:
    """A round's draft: `ngram` tokens copied from the context, then `steps` W4 draft tokens."""

    ngram: tuple[int, ...] = ()
    steps: int = 0
    match: int = 0  # the n-gram match length behind `ngram`

    @property
    def gamma(self) -> int:
        return len(self.ngram) + self.steps

    @property
    def source(self) -> str:
        if self.ngram:
            return "ngram+model" if self.steps else "ngram"
        return "model" if self.steps else "target"

    @property
    def draft_calls(self) -> tuple[int, ...]:
        """Rows of each draft-model call: the first reads y and the copied tokens at once."""
        if not self.steps:
            return ()
        return (len(self.ngram) + 1,) + (1,) * (self.steps - 1)

    def truncated(self, limit: int) -> Plan:
        """This plan drafting at most `limit` tokens (the copy first)."""
        ngram = self.ngram[: max(limit, 0)]
        return Plan(ngram, max(0, min(self.steps, limit - len(ngram))), self.match)

    def as_round(self, accepted: int) -> Round:
        return Round(self.source, self.gamma, accepted, self.draft_calls)


COPY_PRIOR = 0.5  # a copy's acceptance before any evidence


class Acceptance:
    """A decayed estimate of P(accept) of one source's drafts (prior `prior`, weight 5)."""

    def __init__(self, prior: float):
        self.hits, self.trials = 5 * prior, 5.0

    @property
    def alpha(self) -> float:
        return min(self.hits / self.trials, 0.999)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.hits = 0.95 * self.hits + accepted
            self.trials = 0.95 * self.trials + accepted + (accepted < drafted)


class DraftController:
    """Chooses each round's `Plan` by maximizing expected tokens per unit of cost.

    max_gamma: the most W4 draft tokens a round may hold (0: no model drafts); source: one of
    DRAFT_SOURCES; fallback: whether a target-only step may be chosen; every `reprobe` target-only
    rounds one speculative round refreshes the estimates. `cost`: fixed costs (seeded runs), or
    None to time this run: the first rounds then probe a chain of max_gamma, of 1 and a
    target-only step, and a verify of k rows costs a line fitted through the measured ones.
    """

    def __init__(
        self,
        max_gamma: int,
        source: str = "model",
        fallback: bool = True,
        reprobe: int = 32,
        cost: CostModel | None = None,
    ):
        if source not in DRAFT_SOURCES:
            raise ValueError(f"draft source must be one of {DRAFT_SOURCES}, got {source!r}")
        self.max_gamma = max_gamma if source in ("auto", "model") else 0
        self.ngram = source in ("auto", "ngram")
        self.fallback, self.reprobe, self.cost = fallback, reprobe, cost
        # Copies are estimated per match length (a 4-token match predicts better than a 2-token
        # one). A length first seen starts at COPY_PRIOR, or lower when this run's copies so far
        # ("ngram", every length) scored lower: on text that copies badly, failed copies stop
        # costing rounds at each new length; success elsewhere does not vouch for a new length.
        self.acceptance = {"model": Acceptance(0.8), "ngram": Acceptance(COPY_PRIOR)}
        self.t_draft: float | None = None  # seconds per 1-row draft call (measured costs)
        self.t_verify: dict[int, float] = {}  # rows -> seconds (measured costs)
        self.since_spec = 0
        self.warm = False
        self.fell_back = False  # the last choice was target-only because it rated higher

    @property
    def alpha(self) -> float:
        """The W4 draft's estimated acceptance."""
        return self.acceptance["model"].alpha

    # -- costs, in target steps (fixed) or seconds (measured) ---------------------------------

    def _verify(self, rows: int) -> float:
        if rows in self.t_verify:
            return self.t_verify[rows]
        ks = list(self.t_verify)
        if not ks:
            return float(rows)
        if len(ks) == 1:  # proportional to rows
            return self.t_verify[ks[0]] * rows / ks[0]
        mk = sum(ks) / len(ks)
        mt = sum(self.t_verify.values()) / len(ks)
        slope = sum((x - mk) * (self.t_verify[x] - mt) for x in ks)
        slope = max(slope / sum((x - mk) ** 2 for x in ks), 0.0)
        return max(mt + slope * (rows - mk), 1e-9)

    def _draft(self, calls: tuple[int, ...]) -> float:
        step = self.t_draft or 0.0  # a wider call costs what a verify pass of its rows adds
        return sum(step * self._verify(r) / self._verify(1) for r in calls)

    def round_cost(self, plan: Plan) -> float:
        if self.cost is not None:  # what the projections charge the round as it would run
            return self.cost.round(plan.as_round(0))
        return self._draft(plan.draft_calls) + self._verify(plan.gamma + 1)

    def expected_tokens(self, plan: Plan) -> float:
        alphas = [self._copies(plan.match).alpha] * len(plan.ngram)
        alphas += [self.acceptance["model"].alpha] * plan.steps
        expected, reach = 1.0, 1.0
        for a in alphas:
            reach *= a
            expected += reach
        return expected

    def rate(self, plan: Plan) -> float:
        return self.expected_tokens(plan) / self.round_cost(plan)

    # -- the choice ---------------------------------------------------------------------------

    def plans(self, proposal: list[int], match: int) -> list[Plan]:
        """Every plan this round allows: chains, n-gram prefixes, prefixes extended."""
        chains = [Plan(steps=s) for s in range(1, self.max_gamma + 1)]
        copies = [Plan(tuple(proposal[:n]), 0, match) for n in range(1, len(proposal) + 1)]
        if not (self.ngram and self.max_gamma):
            return chains + copies
        extended = [Plan(c.ngram, s, match) for c in copies for s in range(1, self.max_gamma + 1)]
        return chains + copies + extended

    def choose(self, proposal: list[int] = (), match: int = 0) -> Plan:
        """The plan of this round, given the n-gram proposal (its tokens, its match length)."""
        proposal = list(proposal) if self.ngram else []
        plans = self.plans(proposal, match)
        self.fell_back = False
        if not plans:
            return Plan()
        if self.cost is None:  # measured costs: time the plans the estimates need first
            probes = [Plan(steps=self.max_gamma), Plan(steps=1)] if self.max_gamma else []
            probes += [Plan()] if self.fallback else []
            for probe in probes:
                if probe.gamma + 1 not in self.t_verify:
                    return probe
        best = max(plans, key=self.rate)
        if self.fallback and self.since_spec < self.reprobe and self.rate(Plan()) > self.rate(best):
            self.fell_back = True
            return Plan()
        return best

    def _copies(self, match: int) -> Acceptance:
        """The acceptance of copies behind a match of `match` tokens (first seen: COPY_PRIOR or
        the pooled copies' estimate, whichever is lower, as its prior)."""
        key = f"ngram{match}"
        if key not in self.acceptance:
            self.acceptance[key] = Acceptance(min(COPY_PRIOR, self.acceptance["ngram"].alpha))
        return self.acceptance[key]

    def update(self, plan: Plan, accepted: int, draft_s: float, verify_s: float) -> None:
        """Fold in a round: `accepted` of its drafts, its measured draft and verify seconds."""
        copied = min(accepted, len(plan.ngram))
        if plan.ngram:
            # An n-gram prefix is tested first: its acceptances, then the model's after it.
            self._copies(plan.match).update(len(plan.ngram), copied)
            self.acceptance["ngram"].update(len(plan.ngram), copied)
        if plan.steps and accepted >= len(plan.ngram):
            self.acceptance["model"].update(plan.steps, accepted - len(plan.ngram))
        self.since_spec = self.since_spec + 1 if plan.gamma == 0 else 0
        if self.cost is not None:  # the fixed model: measured times are not used
            return
        if not self.warm:  # the first round pays one-off costs (allocation, compilation)
            self.warm = True
            return
        ema = lambda old, new: new if old is None else 0.7 * old + 0.3 * new
        self.t_verify[plan.gamma + 1] = ema(self.t_verify.get(plan.gamma + 1), verify_s)
        if plan.steps:
            per_call = draft_s / (
                self._verify(len(plan.ngram) + 1) / self._verify(1) + plan.steps - 1
            )
            self.t_draft = ema(self.t_draft, per_call)
