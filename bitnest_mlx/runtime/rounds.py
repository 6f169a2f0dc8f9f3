"""One round of self-speculative decoding, and the state a generation keeps across rounds.

A round with draft length γ (docs/bitnest-package.md §5.5):

    draft   γ single-token steps (mode="draft") from the last emitted token y; they write
            positions P..P+γ-1 of the cache
    trim(γ) back to P
    verify  one target pass over [y, d1..dγ]: overwrites P..P+γ with target K/V, gives γ+1 rows
    accept  n drafts (rejection sampling; greedy = exact match), then one target token
    trim(γ-n) so the cache holds exactly P..P+n, all written by the target

`speculative.py` builds a `SpeculativeRun` per generation and yields what its rounds emit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from ..layers.draft_vocab import DraftVocabJoin
from ..layers.options import RunOptions
from . import draftless
from .draft_control import DRAFT_SOURCES, DraftController, Plan
from .draft_kv import draft_kv_policy
from .prompt_lookup import PromptLookup
from .sampling import RULES, PositionNoise, Sampler, speculative_sample
from .sampling import gumbel_speculative_sample as coupled_sample
from .speed_model import CostModel, Round, rounds_speedup
from .step_kernels import run_cost

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass
class SpeculativeStats:
    """Counters filled in by `speculative_generate_step` / `stream_generate`."""

    rounds: int = 0  # speculative rounds (γ >= 1)
    target_steps: int = 0  # γ = 0 rounds: target-only decoding or fallback
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    fallback: bool = False  # the controller chose target-only because it was measured faster
    draft_vocab_joined: int = 0  # lm_head rows the run-time join gathered (draft_vocab_join)
    # Per draft source ("model", "ngram", "ngram+model"): rounds, drafted, accepted.
    sources: dict[str, dict[str, int]] = field(default_factory=dict)
    round_log: list[Round] = field(default_factory=list, repr=False)  # every round, in order

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_drafted(self) -> float:
        """Draft length γ per speculative round (adaptive, at most num_draft_tokens)."""
        return self.drafted / self.rounds if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per speculative round (the emitted target token not counted)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def record(self, r: Round) -> None:
        """Count a round: γ = 0 is a target-only step, else a speculative round of its source."""
        self.round_log.append(r)
        if not r.drafted:
            self.target_steps += 1
            return
        self.rounds += 1
        self.drafted += r.drafted
        self.accepted += r.accepted
        counts = self.sources.setdefault(r.source, {"rounds": 0, "drafted": 0, "accepted": 0})
        counts["rounds"] += 1
        counts["drafted"] += r.drafted
        counts["accepted"] += r.accepted

    def projected_speedup(self, cost: CostModel) -> float | None:
        """The speed over target-only of the rounds as they ran, at `cost`'s chip and v(M)."""
        return rounds_speedup(self.round_log, cost)

    def as_dict(self) -> dict:
        extra = ("acceptance_rate", "mean_accepted", "mean_drafted")
        out = {**asdict(self), **{k: getattr(self, k) for k in extra}}
        del out["round_log"]  # one entry per round: `projected_speedup` reads it
        return out


@dataclass(frozen=True)
class SpeculationPolicy:
    """What a generation drafts each round and how it decides.

    num_draft_tokens: the most W4 draft tokens a round holds (0 = target-only, whatever the
    source). fallback=False never chooses a target-only step, forcing speculation;
    adaptive=False always drafts num_draft_tokens (or the whole n-gram copy). parity=True
    verifies one token per call (see `verify`). draft_kv: the KV the draft reads, 4, 8 or
    "auto" (decided each round from the cache length, `draft_kv`).

    draft_source: "model" (the W4 draft's chain), "ngram" (copies of up to ngram_tokens tokens
    continuing the longest earlier match of at least ngram_min tokens of the prompt and the
    text so far, `prompt_lookup`), "auto" (each round the plan with the most expected tokens
    per cost among chains, copies and copies extended by the W4 draft, `draft_control`) or
    "none" (target-only). cost_model: the costs a seeded run plans with (default
    `step_kernels.run_cost`: step time on the chip this runs on, the model's bytes at the
    prompt's length and the stored kernels of the path it runs).
    draft_vocab_join: a reduced draft vocabulary also scores the context's ids
    (`DraftVocabJoin`).
    """

    num_draft_tokens: int = 3
    fallback: bool = True
    adaptive: bool = True
    parity: bool = False
    draft_kv: int | str = "auto"
    draft_source: str = "auto"
    ngram_tokens: int = 8
    ngram_min: int = 2
    cost_model: CostModel | None = None
    draft_vocab_join: bool = True

    def __post_init__(self) -> None:
        if self.draft_source not in DRAFT_SOURCES:
            raise ValueError(
                f"draft_source must be one of {DRAFT_SOURCES}, not {self.draft_source!r}"
            )


def _apply_processors(
    processors: Sequence[LogitsProcessor], history: mx.array, logits: mx.array
) -> mx.array:
    for proc in processors:
        logits = proc(history, logits)
    return logits


def point_mass(tokens: Sequence[int], vocab: int) -> mx.array:
    """Log-probability rows [len(tokens), vocab] of drafts proposed with certainty (copies)."""
    hot = mx.arange(vocab)[None] == mx.array(list(tokens), dtype=mx.uint32)[:, None]
    return mx.where(hot, 0.0, -mx.inf)


def draft(
    model: nn.Module,
    cache: list,
    y: mx.array,
    gamma: int,
    sampler: Sampler,
    history: mx.array | None = None,
    processors: Sequence[LogitsProcessor] = (),
    options: RunOptions | None = None,
    noise: mx.array | None = None,
    prefix: Sequence[int] = (),
) -> tuple[mx.array, mx.array]:
    """`prefix` (copied tokens), then γ draft steps from token y [1]; returns the drafts
    [len(prefix) + γ] and their processed log-probabilities q (point masses for the prefix).

    The draft steps write cache positions P..P+len(prefix)+γ-1 (W4; KV4 or KV8 reads): the
    first call reads y and the prefix at once. A prefix alone (γ = 0) writes nothing. With
    `noise` ([≥ len(prefix) + γ, V] standard Gumbel, seeded runs) model draft i is
    argmax(q_i + noise_i); a copied token is its own argmax under any noise.
    """
    vocab = model.args.vocab_size
    prefix = list(prefix)
    tokens = [mx.array(prefix, dtype=mx.uint32)] if prefix else []
    q_rows = [point_mass(prefix, vocab)] if prefix else []
    x = mx.concatenate([y, *tokens])
    for i in range(gamma):
        logits = model(x[None], cache, "draft", options=options)[0, -1:]
        if processors:
            logits = _apply_processors(processors, mx.concatenate([history, *tokens]), logits)
        q_rows.append(sampler.logprobs(logits))
        row = len(prefix) + i
        x = sampler.sample(q_rows[-1], None if noise is None else noise[row : row + 1])
        tokens.append(x)
    if not tokens:
        return mx.zeros((0,), dtype=mx.uint32), mx.zeros((0, vocab))
    return mx.concatenate(tokens).astype(mx.uint32), mx.concatenate(q_rows)


def verify(
    model: nn.Module,
    cache: list,
    y: mx.array,
    drafts: mx.array,
    history: mx.array | None = None,
    processors: Sequence[LogitsProcessor] = (),
    parity: bool = False,
    options: RunOptions | None = None,
    written: int | None = None,
) -> mx.array:
    """Rewind the draft's writes (`written`, default γ), then one target pass over
    [y, drafts] (W8, KV8 reads).

    The pass overwrites positions P..P+γ with target K/V. Returns the target logits [γ+1, V]
    (logits processors applied row by row with the matching token history). `parity=True`
    verifies one token per call instead: the exact kernels of target-only decoding, for
    backends whose multi-row matmuls round differently from single-row ones (not MLX's CPU).
    """
    for c in cache:
        c.trim(drafts.size if written is None else written)
    tokens = mx.concatenate([y, drafts])
    if parity:
        rows = [model(t.reshape(1, 1), cache, "target", options=options)[0] for t in tokens]
        logits = mx.concatenate(rows)
    else:
        logits = model(tokens[None], cache, "target", options=options)[0]
    if processors:
        rows = [
            _apply_processors(processors, mx.concatenate([history, drafts[:i]]), row[None])
            for i, row in enumerate(logits)
        ]
        logits = mx.concatenate(rows)
    return logits


def commit(cache: list, gamma: int, accepted: int) -> None:
    """Keep y and the accepted drafts: the cache ends at P + accepted + 1, all target-written."""
    for c in cache:
        c.trim(gamma - accepted)


@dataclass
class SpeculativeRun:
    """One generation's state across rounds: the model and its cache, the plan's controller,
    the n-gram lookup, the seeded noise and rule, the draft's KV and vocabulary join."""

    model: nn.Module
    cache: list
    sampler: Sampler
    processors: list[LogitsProcessor]
    stats: SpeculativeStats
    policy: SpeculationPolicy
    control: DraftController
    lookup: PromptLookup
    noise: PositionNoise | None
    rule: str
    options: RunOptions | None  # the target's calls (None: the model's own)
    draft_options: RunOptions  # the draft's calls, before the round's KV read and join
    kv_at: Callable[[int], int]
    join: DraftVocabJoin | None
    history: mx.array

    @classmethod
    def start(
        cls,
        model: nn.Module,
        prompt: mx.array,
        policy: SpeculationPolicy,
        *,
        sampler: Sampler | None = None,
        logits_processors: Sequence[LogitsProcessor] | None = None,
        stats: SpeculativeStats | None = None,
        prompt_cache: list | None = None,
        options: RunOptions | None = None,
        seed: int | None = None,
        rule: str | None = None,
    ) -> SpeculativeRun:
        """The state before the prefill; `seed` and `rule` as `speculative_generate_step`."""
        rule = rule or ("rejection" if seed is None else "gumbel")
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, not {rule!r}")
        if prompt.size == 0:
            raise ValueError("the prompt is empty: generation starts from at least one token")
        if not getattr(model, "supports_draft", True):  # one precision (DeepSeek-V4): copies
            p = policy
            model, source, cost = draftless.adapt(
                model, p.draft_source, p.ngram_tokens, p.cost_model, prompt_cache
            )  # no draft KV policy to read: 8
            policy = replace(p, draft_source=source, cost_model=cost, draft_kv=8)
        sampler = sampler or Sampler()
        cost = policy.cost_model
        if seed is not None and cost is None:  # planned at this chip, priced by step time
            kv = draft_kv_policy(policy.draft_kv, model)(prompt.size)
            cost = run_cost(model, prompt.size, kv)
        source = "none" if policy.num_draft_tokens == 0 else policy.draft_source
        if seed is None and rule == "gumbel":  # the coupling needs keyed noise: draw a seed
            seed = mx.random.randint(0, 2**31 - 1).item()
        ids = prompt.tolist()
        join = DraftVocabJoin.for_model(model, ids) if policy.draft_vocab_join else None
        return cls(
            model=model,
            cache=prompt_cache if prompt_cache is not None else model.make_cache(options),
            sampler=sampler,
            processors=list(logits_processors or []),
            stats=stats if stats is not None else SpeculativeStats(),
            policy=policy,
            control=DraftController(policy.num_draft_tokens, source, policy.fallback, cost=cost),
            lookup=PromptLookup(
                ids, min_ngram=policy.ngram_min, max_ngram=max(policy.ngram_min, 4)
            ),
            noise=None if seed is None or sampler.temp == 0 else PositionNoise(seed),
            rule="gumbel" if sampler.temp == 0 else rule,  # greedy: both are exact match
            options=options,
            draft_options=options or model.options,
            kv_at=draft_kv_policy(policy.draft_kv, model),
            join=join,
            history=prompt,
        )

    def prefill(self, prompt: mx.array, step: int) -> mx.array:
        """The target writes prompt[:-1] in chunks of `step`; returns the last token, which
        starts the first round."""
        for i in range(0, prompt.size - 1, step):
            chunk = prompt[None, i : min(i + step, prompt.size - 1)]
            self.model(chunk, self.cache, "target", options=self.options)
            mx.eval([c.state for c in self.cache])
        return prompt[-1:]

    def plan(self, left: int) -> Plan:
        """This round's drafts: the controller's choice (or the fixed γ / whole copy when not
        adaptive), cut so that the round emits at most `left` tokens (< 0: no limit)."""
        proposal, match = ([], 0)
        if self.control.ngram:
            proposal, match = self.lookup.propose(self.policy.ngram_tokens)
        if self.policy.adaptive:
            plan = self.control.choose(proposal, match)
        elif proposal:
            plan = Plan(tuple(proposal), 0, match)
        else:
            plan = Plan(steps=self.control.max_gamma)
        return plan.truncated(left - 1) if left >= 0 else plan

    def round(self, y: mx.array, produced: int, left: int) -> tuple[list[int], mx.array, int]:
        """Draft, verify, accept, commit: (the emitted tokens, their target log-probabilities,
        how many of them were drafts)."""
        plan = self.plan(left)
        gamma, vocab = plan.gamma, self.model.args.vocab_size
        # Seeded: Gumbel rows g of positions produced..produced+γ (drafts, then the target's).
        g = None if self.noise is None else self.noise.gumbel(produced, gamma + 1, vocab)
        tic = time.perf_counter()
        # The last draft step reads P + γ positions; only the draft's KV read depends on it.
        kv = self.kv_at(self.cache[0].offset + gamma)
        o = replace(self.draft_options, draft_kv=kv, draft_join=self.join)
        drafts, q = draft(
            self.model, self.cache, y, plan.steps, self.sampler, self.history,
            self.processors, o, g, plan.ngram,
        )  # fmt: skip
        if gamma and self.control.cost is None:  # timing the draft apart costs a host sync
            mx.eval(drafts, q)
        draft_s, tic = time.perf_counter() - tic, time.perf_counter()
        written = gamma if plan.steps else 0  # a copy alone wrote nothing
        logits = verify(
            self.model, self.cache, y, drafts, self.history, self.processors,
            self.policy.parity, self.options, written,
        )  # fmt: skip
        n, token = self.accept(drafts, q, self.sampler.logprobs(logits), g, produced)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(n, token, logprobs)
        n = n.item()
        commit(self.cache, gamma, n)
        self.account(plan, n, draft_s, time.perf_counter() - tic)
        out = drafts.tolist()[:n] + [token.item()]  # a slice of drafts would be new work
        self.lookup.extend(out)
        self.stats.draft_vocab_joined = self.join.add(out) if self.join is not None else 0
        if self.processors:
            self.history = mx.concatenate(
                [self.history, drafts[:n], mx.array(out[-1:], dtype=mx.uint32)]
            )
        return out, logprobs, n

    @property
    def drafts_nothing(self) -> bool:
        """Whether every round is a target-only step (γ 0 or no draft source)."""
        return self.policy.num_draft_tokens == 0 or self.policy.draft_source == "none"

    def target_step(self, y: mx.array, produced: int) -> tuple[mx.array, mx.array]:
        """A γ = 0 round left lazy: (the next token [1], its log-probabilities [1, V]); the
        same calls and sampling rule as `round`, nothing read back."""
        vocab = self.model.args.vocab_size
        g = None if self.noise is None else self.noise.gumbel(produced, 1, vocab)
        none = mx.zeros((0,), dtype=mx.uint32)
        logits = verify(
            self.model, self.cache, y, none, self.history, self.processors, False, self.options, 0
        )
        _, token = self.accept(
            none, mx.zeros((0, vocab)), self.sampler.logprobs(logits), g, produced
        )
        token = token.reshape(1).astype(mx.uint32)
        if self.processors:
            self.history = mx.concatenate([self.history, token])
        return token, logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def target_only(self, y: mx.array, max_tokens: int) -> Iterator[tuple[int, mx.array]]:
        """Target-only decoding pipelined as mlx-lm's generate_step: step n + 1 is built and
        launched (`mx.async_eval`) before step n's token is read, so the host's work overlaps
        the GPU's and the one host sync a token waits on work already running."""
        step = self.target_step(y, 0)
        mx.async_eval(step)
        produced, tic = 0, time.perf_counter()
        while max_tokens < 0 or produced < max_tokens:
            token, logprobs = step
            produced += 1
            if max_tokens < 0 or produced < max_tokens:
                step = self.target_step(token, produced)
                mx.async_eval(step)
            out = token.item()
            self.stats.verify_s += time.perf_counter() - tic
            tic = time.perf_counter()
            self.stats.record(Plan().as_round(0))
            yield out, logprobs[0]

    def accept(
        self, drafts: mx.array, q: mx.array, p: mx.array, g: mx.array | None, produced: int
    ) -> tuple[mx.array, mx.array]:
        """(drafts accepted, the target's token after them) by the run's rule."""
        if self.rule == "gumbel" or (g is not None and not drafts.size):
            return coupled_sample(drafts, p, g)  # t_i = argmax(p_i + g_i)
        if g is not None:  # seeded rejection sampling
            return self.noise.rejection_sample(drafts, q, p, produced, g)
        if drafts.size:
            return speculative_sample(drafts, q, p)
        return mx.array(0), self.sampler.sample(p[0])  # what speculative_sample does for γ = 0

    def account(self, plan: Plan, accepted: int, draft_s: float, verify_s: float) -> None:
        """The controller learns the round's acceptance and costs; the stats count it."""
        self.control.update(plan, accepted, draft_s, verify_s)
        self.stats.verify_s += verify_s
        self.stats.draft_s += draft_s if plan.gamma else 0.0
        self.stats.record(plan.as_round(accepted))
        fell_back = self.policy.adaptive and self.control.fell_back
        self.stats.fallback = self.stats.fallback or fell_back
