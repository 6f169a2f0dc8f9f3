"""The speed model of speculation on a bandwidth-bound GPU: what a round costs in target steps.

A target step (one token, target-only) costs 1. A round that drafts γ tokens and verifies them
costs its draft calls (each c · v(rows), c = draft / target bytes per token) plus one verify
pass of γ + 1 rows, v(γ + 1). v(M) = time of an M-row target pass / time of a 1-row pass is the
one table of that cost (`verify_cost`): eval's projection, `bench --speed-model`, the
converter's draft-vocabulary choice and the adaptive controller's fixed costs all read it.

v(M) per chip family and per path:

* `pure` (MLX's `quantized_matmul`): measured ratios from published MLX timings (`PURE_VERIFY`,
  sources beside it). Apple publishes no such numbers; `bitnest-doctor` times them on the
  user's Mac and prints them beside these.
* `kernel` (our dual-plane kernel, which decodes each weight block once for all M rows): from
  its executed operation counts at each M (`KERNEL_CYCLES`, the CPU emulator) against the
  chip's ALU budget while it streams the planes at peak bandwidth (`chips.Chip.budget`). A pass
  is bound by bytes until the M rows' arithmetic exceeds that budget. The kernel takes at most
  `MAX_M` rows; a wider pass runs MLX's matmuls and costs what `pure` does.

At long context the verify pass also reads the KV cache: `kv_fraction` (KV bytes / weight bytes
of the pass) weighs in the nested-KV attention kernel's counts at L = M rows (`KV8_CYCLES`).

Bytes alone leave out what a Mac spends launching kernels and waiting on the host: a CostModel
given the draft's and target's `step_time.Step` (bytes, kernels; `step_cost_model`) prices each
pass as bytes · v(M) / (f · bandwidth) + kernels · t_k and each round's host syncs at t_sync
(runtime/step_time.py, docs/step-time.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..kernels.dual_plane import MAX_M
from .chips import family as chip_family
from .chips import gpu
from .step_time import Step, StepConstants, step_seconds
from .step_time import constants as step_constants

PATHS = ("kernel", "pure")
DEFAULT_CHIP = "M4 Max"  # the chip the projections and the seeded controller assume
# The projections' path: the measured one. The kernel's counts are a bound no Mac has confirmed
# (they assume peak bandwidth at every M); reports give both.
DEFAULT_PATH = "pure"
REPORT_CHIPS = ("M1", "M1 Max", "M2 Ultra", "M3 Max", "M4 Pro", "M4 Max")

# v(M) of MLX's 4-bit affine `quantized_matmul` on layers wider than 4096, weights streamed from
# memory, per family; linear between the points, flat past the last (`qmm`'s 32-row tile).
# M3+: qmv_wide up to the batch limit, then qmm. Measured: ml-explore/mlx #3839 (M4 Pro, mlx
# 0.32.0: m=2 1.03-1.25, m=4 1.14-1.57, m=6 1.47-2.07, m=8 1.73-2.69), #3852 (M4 Pro: M=5
# 1.75-1.85, M=8 2.84-3.03, M>=10 4.5), PR #3863 (M3 Max cold: M=4 1.28, M=6 2.04, M=8 2.50,
# M=9 3.14, M=10-16 3.94). M1/M2: no MLX sweep is published; these chips keep per-row `qmv`
# up to the batch limit (PR #3764; lablup/mlxcel #1182 on M1 Ultra), so the points follow
# that path's measured cost on M3 Ultra (mlx 0.31.1: 1.31 / 2.27 / 4.28 at M = 2 / 4 / 8) and
# llama.cpp's Metal mat-vec (M2 Ultra Q4_0 1.43 / 2.02 at 2 / 4, PR #10581; M1 Pro 1.78 / 3.33,
# PR #10491), and the matrix-matrix plateau of both (4.7-5.7) from M = 6 (the limit on a
# Max/Pro at this width). `bitnest-doctor` measures them on the user's Mac.
PURE_VERIFY: dict[str, dict[int, float]] = {
    "M1/M2": {1: 1.0, 2: 1.5, 3: 2.0, 4: 2.5, 5: 3.0, 6: 4.7, 16: 4.7},
    "M3+": {1: 1.0, 2: 1.05, 3: 1.2, 4: 1.4, 5: 1.75, 6: 2.0, 8: 2.6, 9: 3.1, 10: 4.0, 16: 4.0},
}

# Lane-cycles per weight·row of the dual-plane kernel's target pass (both planes, A8 per token
# on fp16 x, group 64, K = 3072, 64 rows) at M rows, counted in the CPU emulator (`bench
# --kernels` machinery, kernels/emulator/profile.py with M set); lane-cycle costs per
# operation: profile.CYCLES. Up to 2 rows the launch quantizes x itself (every simdgroup all of
# it: the M = 1, 2 costs); from 3 rows an a8_quantize launch goes first (counted, over 64 rows).
KERNEL_CYCLES = {1: 9.22, 2: 6.797, 3: 3.713, 4: 3.318, 6: 2.921, 8: 2.724}
KERNEL_STREAM_BYTES = 1 + 2 / 64  # per weight: a byte of the two nibble planes, fp16 scale / 64
# Lane-cycles per KV element·row of the nested-KV attention kernel reading KV8 at L rows
# (two launches; 512 cached tokens, head_dim 128, group 64, GQA 3), same counting: the "KV8 L=…"
# cases of profile.nested_kv_cases(ls=...), profile.measure(case)["cycles"]
# (tests/test_kernel_counts.py checks the table). L = 6 and 8 (18 and 24 rows) take two chunks
# of 9 and 12 rows, so they cost what L = 3 and 4 do.
KV8_CYCLES = {1: 10.904, 2: 7.436, 3: 6.346, 4: 5.769, 6: 6.346, 8: 5.769}
KV8_STREAM_BYTES = 1 + 4 / 64  # per element: both planes, an fp32 scale per 64


@dataclass(frozen=True)
class ExpertTraffic:
    """What a MoE's pass of M rows reads beyond its dense weights (DeepSeek-V4 bundles).

    share: routed-expert bytes / all weight bytes one token reads (its top_k experts a layer);
    union: M -> distinct experts per layer that M consecutive tokens route to (measured,
    `DSV4_FLASH`). The pass reads the dense weights once and union(M) experts, each for
    M·top_k / union(M) rows on average, so with w(m) the dense path's cost of m rows:

        time(M) = (1 - share)·w(M) + share · union(M) / top_k · w(M · top_k / union(M))

    and time(1) = 1: one token reads its top_k experts, one row each.
    """

    share: float
    top_k: int
    n_experts: int
    union: Mapping[int, float]

    def experts(self, rows: int) -> float:
        """union(rows); past the table, its last step's growth, at most every expert."""
        if rows in self.union:
            return self.union[rows]
        last = max(self.union)
        slope = self.union[last] - self.union.get(last - 1, self.union[last])
        if rows < last:  # a table with gaps: linear between its points
            return _interpolate(self.union, rows)
        return min(float(self.n_experts), self.union[last] + slope * (rows - last))

    def time(self, rows: int, weights: Callable[[float], float]) -> float:
        union = self.experts(rows)
        dense = (1 - self.share) * weights(rows)
        return dense + self.share * union / self.top_k * weights(rows * self.top_k / union)


# DeepSeek-V4-Flash's verify traffic (docs/speculative.md, "DeepSeek-V4 bundles: n-gram drafts
# and the expert union"; examples/dsv4_expert_union.py). share: routed-expert bytes of one
# token (6 experts x 43 layers, the q3.4 bit plan: 2.760 GB) over all its weight bytes (dense
# affine 8-bit g32, head, one embedding row: 7.766 GB more). union: distinct experts per layer
# of M consecutive tokens, measured from the routing of a synthetic bundle at Flash's
# dimensions (make-bundle --layers 3 --first-layer 2: hash layer 2, learned-gate layers 3 and
# 4, random weights) on 4 x 384 ids of the workload prompts (Qwen2.5's tokenizer), weighted as
# Flash's 3 hash and 40 learned layers. Random-weight routing is nearly independent per token
# (16 tokens: 70.6 experts against 80.8 for independent draws); a trained router's consecutive
# tokens likely share more experts (not measured: no trained weights here), so read it as a
# pessimistic estimate of what a verify pass reads.
DSV4_FLASH = ExpertTraffic(
    share=0.2622,
    top_k=6,
    n_experts=256,
    union={
        **{1: 6.0, 2: 11.78, 3: 17.3, 4: 22.55, 5: 27.58, 6: 32.39, 7: 36.94, 8: 41.33},
        **{9: 45.54, 10: 49.58, 11: 53.42, 12: 57.14, 13: 60.67, 14: 64.08, 15: 67.37},
        16: 70.56,
    },
)


def _interpolate(points: Mapping[int, float], m: float) -> float:
    """Linear between the points, flat outside them."""
    ms = sorted(points)
    if m <= ms[0] or m >= ms[-1]:
        return points[ms[0] if m <= ms[0] else ms[-1]]
    lo, hi = next((a, b) for a, b in zip(ms, ms[1:]) if m <= b)
    return points[lo] + (points[hi] - points[lo]) * (m - lo) / (hi - lo)


def _bound(cycles: Mapping[int, float], stream_bytes: float, chip: str, rows: int) -> float:
    """Time of an M-row pass in units of the pass's bytes at peak bandwidth: 1 while the ALUs
    keep up, cycles·M / budget past that."""
    budget = gpu(chip).budget(stream_bytes)
    return max(1.0, _interpolate(cycles, rows) * rows / budget)


def _weights_time(rows: float, chip: str, path: str) -> float:
    """Time of a `rows`-row pass over the weights, in units of a 1-row pure pass's bytes."""
    if path == "pure" or rows > MAX_M:  # the kernels take at most MAX_M rows, then MLX's
        return _interpolate(PURE_VERIFY[chip_family(chip)], rows)
    return _bound(KERNEL_CYCLES, KERNEL_STREAM_BYTES, chip, rows)


def verify_cost(
    rows: int,
    chip: str = DEFAULT_CHIP,
    path: str = DEFAULT_PATH,
    kv_fraction: float = 0.0,
    experts: ExpertTraffic | None = None,
) -> float:
    """v(M): time of a `rows`-row target pass over a 1-row one on `chip` ("M4 Max", ...).

    kv_fraction: KV bytes read by the pass / its weight bytes (0: weights only). The attention
    part follows the nested-KV kernel's counts on both paths (the pure path's attention is
    MLX's own, for which there are no published multi-row timings). `experts`: a MoE's routed
    experts (`ExpertTraffic`): the pass reads the union of the experts its rows route to."""
    if rows < 1:
        raise ValueError(f"a verify pass has at least 1 row, got {rows}")
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if experts is None:
        weights = _weights_time(rows, chip, path)
        weights_1 = _weights_time(1, chip, path)
    else:
        weights = experts.time(rows, lambda m: _weights_time(m, chip, path))
        weights_1 = experts.time(1, lambda m: _weights_time(m, chip, path))
    if kv_fraction <= 0:
        return weights / weights_1
    # Past MAX_M rows attention is MLX's: priced at the kernel's count per row at MAX_M.
    kv = _bound(KV8_CYCLES, KV8_STREAM_BYTES, chip, rows)
    kv_1 = _bound(KV8_CYCLES, KV8_STREAM_BYTES, chip, 1)
    return (weights + kv_fraction * kv) / (weights_1 + kv_fraction * kv_1)


def verify_table(
    chips: Sequence[str] = REPORT_CHIPS, rows: Sequence[int] = (1, 2, 4, 8, 16)
) -> dict:
    """{path: {chip: {M: v(M)}}} for the reports (eval, bench, doctor, the docs)."""
    return {
        path: {chip: {m: verify_cost(m, chip, path) for m in rows} for chip in chips}
        for path in PATHS
    }


# --------------------------------------------------------------------------------------------
# Rounds and their cost


@dataclass(frozen=True)
class Round:
    """One round of the speculative loop as the speed model sees it.

    source: what drafted ("model", "ngram", "ngram+model"; "target" for a γ = 0 step);
    draft_calls: the rows of each draft-model call (a chain of γ: γ ones; an n-gram prefix of
    L extended by the model: L + 1, then ones; an n-gram draft alone: none)."""

    source: str
    drafted: int
    accepted: int
    draft_calls: tuple[int, ...] = ()

    @property
    def tokens(self) -> int:
        return self.accepted + 1


@dataclass(frozen=True)
class CostModel:
    """Round costs in target steps.

    Bytes only (`target_step` None): draft calls at c · v(rows), verify at v(drafted + 1).

    Step time (`target_step` and `draft_step`, `step_time.Step`: bytes, kernels): each pass costs
    its bytes' time · v(rows) plus its kernels · t_k (v(M) scales the bytes only: M rows launch
    one step's kernels), a round adds `round_syncs` host syncs · t_sync (the acceptance read),
    all over a target-only step: its bytes, kernels and `target_step.syncs` (0 when decoding is
    pipelined with mx.async_eval, as mlx-lm's generate_step and ours: each token's read waits
    on work already launched with the next step queued behind it). `verify_kernels`: (rows,
    kernels) of target passes of several rows as counted (the kernel path quantizes each
    projection's input in its own launch past 2 rows); a pass of M > 1 rows launches those of
    the fewest counted rows >= M (the widest counted past them), so a count between two
    counted widths errs high. `constants` (default: `step_time.constants(chip)`) may carry a
    doctor's t_k and t_sync for this Mac."""

    cost_ratio: float
    chip: str = DEFAULT_CHIP
    path: str = DEFAULT_PATH
    kv_fraction: float = 0.0
    experts: ExpertTraffic | None = None  # a MoE: its passes read the experts' union
    target_step: Step | None = None
    draft_step: Step | None = None
    round_syncs: float = 1.0
    constants: StepConstants | None = None
    verify_kernels: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if (self.target_step is None) != (self.draft_step is None):
            raise ValueError("give both target_step and draft_step, or neither (bytes only)")

    @property
    def timed(self) -> bool:
        """Priced by step time (bytes, kernels, syncs) rather than bytes alone."""
        return self.target_step is not None

    def verify(self, rows: int) -> float:
        """v(M): the bytes of an M-row target pass over a 1-row one (`verify_cost`)."""
        return verify_cost(rows, self.chip, self.path, self.kv_fraction, self.experts)

    def _step_constants(self) -> StepConstants:
        return self.constants or step_constants(self.chip)

    def _pass(self, step: Step, rows: int, kernels: float | None = None) -> float:
        """Seconds of one pass of `rows` rows: v(rows) on the bytes, `kernels` (default: one
        step's) launched once."""
        c = self._step_constants()
        kernels = step.kernels if kernels is None else kernels
        return c.bytes_seconds(step.nbytes) * self.verify(rows) + kernels * c.t_kernel

    def target_kernels(self, rows: int) -> float:
        """Kernels a target pass of `rows` rows launches (step time only)."""
        if rows <= 1 or not self.verify_kernels:
            return self.target_step.kernels
        counted = sorted(self.verify_kernels)
        return next((k for m, k in counted if m >= rows), counted[-1][1])

    def target_seconds(self) -> float:
        """Seconds of a target-only step, the unit of every cost here (step time only)."""
        return step_seconds(self.target_step, self._step_constants())

    def verify_pass(self, rows: int) -> float:
        """A target pass of `rows` rows in target steps: v(rows) when bytes only."""
        if not self.timed:
            return self.verify(rows)
        kernels = self.target_kernels(rows)
        return self._pass(self.target_step, rows, kernels) / self.target_seconds()

    def draft(self, calls: Sequence[int]) -> float:
        if not self.timed:
            return self.cost_ratio * sum(self.verify(r) for r in calls)
        return sum(self._pass(self.draft_step, r) for r in calls) / self.target_seconds()

    def syncs(self) -> float:
        """A round's host syncs in target steps (0 when bytes only)."""
        if not self.timed:
            return 0.0
        return self.round_syncs * self._step_constants().t_sync / self.target_seconds()

    def round(self, r: Round) -> float:
        return self.draft(r.draft_calls) + self.verify_pass(r.drafted + 1) + self.syncs()

    def chain(self, gamma: int) -> float:
        """A round drafting a chain of γ one-row calls: γ · c + v(γ + 1) when bytes only."""
        if not self.timed:
            return gamma * self.cost_ratio + self.verify(gamma + 1)
        return self.round(Round("model", gamma, 0, (1,) * gamma))


def step_cost_model(
    target_bytes: float,
    draft_bytes: float,
    target_kernels: float,
    draft_kernels: float,
    chip: str = DEFAULT_CHIP,
    path: str = DEFAULT_PATH,
    kv_fraction: float = 0.0,
    round_syncs: float = 1.0,
    target_syncs: float = 0.0,
    constants: StepConstants | None = None,
    experts: ExpertTraffic | None = None,
    verify_kernels: Sequence[tuple[int, float]] = (),
) -> CostModel:
    """A step-time CostModel for `chip` from a package's bytes per token (roofline, at the
    context the rounds run at; `kv_fraction` its KV share of the verify pass) and its kernels
    per token (`bench --dispatches`: per layer x layers + outside; `verify_kernels` those of
    wider target passes, `CostModel`)."""
    return CostModel(
        draft_bytes / target_bytes,
        chip,
        path,
        kv_fraction,
        experts,
        target_step=Step(target_bytes, target_kernels, target_syncs),
        draft_step=Step(draft_bytes, draft_kernels),
        round_syncs=round_syncs,
        constants=constants,
        verify_kernels=tuple(verify_kernels),
    )


def rounds_speedup(rounds: Sequence[Round], cost: CostModel) -> float | None:
    """Tokens emitted over the target steps they cost: the speed over target-only decoding
    (1 token a step) of the rounds as they ran, at `cost`'s chip. None without rounds."""
    spent = sum(cost.round(r) for r in rounds)
    return sum(r.tokens for r in rounds) / spent if rounds else None


# --------------------------------------------------------------------------------------------
# Chains of γ drafts with i.i.d. acceptance


def iid_tokens_per_round(alpha: float, gamma: int) -> float:
    """Expected tokens per round of γ drafts when each is accepted independently with
    probability α: 1 + α + ... + α^γ = (1 - α^(γ+1)) / (1 - α)."""
    if alpha >= 1:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def projected_speedup(
    tokens_per_round: float, gamma: int, cost_ratio: float, verify: float = 1.0
) -> float:
    """Speculative tok/s over target-only tok/s when decoding is bandwidth-bound: a round
    emits `tokens_per_round` tokens and costs γ draft steps (c each) plus one verify pass of
    γ+1 rows costing `verify` = v(γ+1) target steps."""
    return tokens_per_round / (gamma * cost_ratio + verify)


SPEEDUP_GAMMAS = range(1, 9)  # the draft lengths a projection may pick


def best_iid_speedup(alpha: float, cost: CostModel) -> tuple[float, int]:
    """(projected speedup, γ) at the best γ of SPEEDUP_GAMMAS for i.i.d. acceptance α."""
    return max((iid_tokens_per_round(alpha, g) / cost.chain(g), g) for g in SPEEDUP_GAMMAS)


def speed_model(
    bytes_per_token: Mapping[str, float],
    alpha: float,
    tokens_per_round: Mapping[int, float | None],
    chip: str = DEFAULT_CHIP,
    path: str = DEFAULT_PATH,
    cost: CostModel | None = None,
) -> dict:
    """Projected speedup on `chip` at each γ of `tokens_per_round`, from the measured tokens
    per round (None: not measured) and from the i.i.d. formula with per-draft acceptance
    `alpha`; the best γ of each, and the v(M) used. `cost` (e.g. `step_cost_model`) replaces
    the bytes-only model built from `bytes_per_token`; its chip and path are then reported."""
    if cost is None:
        cost = CostModel(bytes_per_token["draft"] / bytes_per_token["target"], chip, path)
    chip, path = cost.chip, cost.path
    rows = {}
    for gamma, measured in sorted(tokens_per_round.items()):
        iid = iid_tokens_per_round(alpha, gamma)
        spent = cost.chain(gamma)
        rows[str(gamma)] = {
            "verify_cost": cost.verify(gamma + 1),
            "measured_tokens_per_round": measured,
            "measured_speedup": None if measured is None else measured / spent,
            "iid_tokens_per_round": iid,
            "iid_speedup": iid / spent,
        }
    measured_rows = [g for g in rows if rows[g]["measured_speedup"] is not None]
    best = max(measured_rows, key=lambda g: rows[g]["measured_speedup"], default=None)
    best_iid = max(rows, key=lambda g: rows[g]["iid_speedup"], default=None)
    return {
        "chip": chip,
        "path": path,
        "cost_ratio": cost.cost_ratio,
        "alpha": alpha,
        "gammas": rows,
        "best_gamma": None if best is None else int(best),
        "best_speedup": None if best is None else rows[best]["measured_speedup"],
        "best_gamma_iid": None if best_iid is None else int(best_iid),
        "best_speedup_iid": None if best_iid is None else rows[best_iid]["iid_speedup"],
    }
