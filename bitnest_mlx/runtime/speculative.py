"""Self-speculative decoding: the W4/KV4 draft proposes, the W8/KV8 target verifies.

One model, one shared nested KV cache (docs/bitnest-package.md §5.5). A round with draft length γ:

    draft   γ single-token steps (mode="draft") from the last emitted token y; they write
            positions P..P+γ-1 of the cache
    trim(γ) back to P
    verify  one target pass over [y, d1..dγ]: overwrites P..P+γ with target K/V, gives γ+1 rows
    accept  n drafts (rejection sampling; greedy = exact match), then one target token
    trim(γ-n) so the cache holds exactly P..P+n, all written by the target

γ = 0 is a plain target-only step, so target-only decoding and the fallback take the same path.
Sampling is lossless at any temperature (Leviathan et al. 2023 / Chen et al. 2023).

A `seed` makes runs reproducible: keyed noise per token position, the Gumbel-max coupling (the
output is the target-only sample for the seed, whatever γ) and γ from a fixed cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..layers.draft_vocab import DraftVocabJoin
from ..layers.options import RunOptions
from . import draftless
from .draft_control import DRAFT_SOURCES, DraftController, Plan
from .draft_kv import draft_kv_policy
from .prompt_lookup import PromptLookup
from .sampling import RULES, PositionNoise, Sampler, make_sampler, speculative_sample
from .sampling import gumbel_speculative_sample as coupled_sample
from .speed_model import CostModel, Round, rounds_speedup
from .token_bytes import weight_bytes

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


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    num_draft_tokens: int = 3,
    fallback: bool = True,
    adaptive: bool = True,
    parity: bool = False,
    stats: SpeculativeStats | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 512,
    options: RunOptions | None = None,
    seed: int | None = None,
    rule: str | None = None,
    draft_kv: int | str = "auto",
    draft_source: str = "auto",
    ngram_tokens: int = 8,
    ngram_min: int = 2,
    cost_model: CostModel | None = None,
    draft_vocab_join: bool = True,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield (token, target log-probabilities [V], from_draft) like mlx-lm's generator.

    `model`: a bitnest Model, or one with no draft plane (`draftless`). `num_draft_tokens` is the
    most W4 draft tokens a round holds (0 = target-only, whatever the source); `fallback=False`
    never chooses a target-only step, forcing speculation; `adaptive=False` always drafts
    `num_draft_tokens` (or the whole n-gram copy); `parity=True` see `verify`. `options`
    (RunOptions; its mode is set per call) default to the model's own. `draft_kv`: the KV the
    draft reads, 4, 8 or "auto" (decided each round from the cache length, `draft_kv`).
    `max_tokens < 0` means no limit.

    `draft_source`: "model" (the W4 draft's chain), "ngram" (copies of up to `ngram_tokens`
    tokens continuing the longest earlier match of at least `ngram_min` tokens of the prompt
    and the text so far, `prompt_lookup`), "auto" (each round the plan with the most expected
    tokens per cost among chains, copies and copies extended by the W4 draft,
    `draft_control`) or "none" (target-only).

    `seed=None` uses the global `mx.random` state and measured costs. An int makes the run
    reproducible: generated position i draws from `PositionNoise(seed)`, and the plans follow
    fixed costs (`cost_model`, default the `speed_model` table at its default chip and the
    model's draft / target bytes), not wall time. `rule`: "gumbel" (the Gumbel-max coupling:
    the output is the target-only sample for the seed, whatever is drafted; the default with a
    seed) or "rejection" (higher acceptance, output depends on the drafts; the default without).
    `draft_vocab_join`: a reduced draft vocabulary also scores the context's ids (`DraftVocabJoin`).
    """
    rule = rule or ("rejection" if seed is None else "gumbel")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, not {rule!r}")
    if draft_source not in DRAFT_SOURCES:
        raise ValueError(f"draft_source must be one of {DRAFT_SOURCES}, not {draft_source!r}")
    if prompt.size == 0:
        raise ValueError("the prompt is empty: generation starts from at least one token")
    if not getattr(model, "supports_draft", True):  # one precision (DeepSeek-V4): copies only
        adapted = draftless.adapt(model, draft_source, ngram_tokens, cost_model, prompt_cache)
        (model, draft_source, cost_model), draft_kv = adapted, 8  # 8: no draft KV policy to read
    sampler = sampler or Sampler()
    processors = list(logits_processors or [])
    stats = stats if stats is not None else SpeculativeStats()
    cache = prompt_cache if prompt_cache is not None else model.make_cache(options)
    if seed is not None and cost_model is None:
        b = weight_bytes(model)
        cost_model = CostModel(b["draft"] / b["target"])
    source = "none" if num_draft_tokens == 0 else draft_source
    control = DraftController(num_draft_tokens, source, fallback, cost=cost_model)
    lookup = PromptLookup(prompt.tolist(), min_ngram=ngram_min, max_ngram=max(ngram_min, 4))
    if seed is None and rule == "gumbel":  # the coupling needs keyed noise: draw a seed
        seed = mx.random.randint(0, 2**31 - 1).item()
    noise = None if seed is None or sampler.temp == 0 else PositionNoise(seed)
    rule = "gumbel" if sampler.temp == 0 else rule  # greedy: both are exact match; plain argmax
    vocab = model.args.vocab_size
    history = prompt
    kv_at, base = draft_kv_policy(draft_kv, model), options or model.options
    join = DraftVocabJoin.for_model(model, prompt.tolist()) if draft_vocab_join else None

    # Prefill prompt[:-1] with the target; the last prompt token starts the first round.
    for i in range(0, prompt.size - 1, prefill_step_size):
        chunk = prompt[None, i : min(i + prefill_step_size, prompt.size - 1)]
        model(chunk, cache, "target", options=options)
        mx.eval([c.state for c in cache])
    y = prompt[-1:]

    produced = 0
    while max_tokens < 0 or produced < max_tokens:
        proposal, match = lookup.propose(ngram_tokens) if control.ngram else ([], 0)
        if adaptive:
            plan = control.choose(proposal, match)
        elif proposal:
            plan = Plan(tuple(proposal), 0, match)
        else:
            plan = Plan(steps=control.max_gamma)
        if max_tokens >= 0:
            plan = plan.truncated(max_tokens - produced - 1)
        gamma = plan.gamma

        # Seeded: Gumbel rows g of positions produced..produced+γ (drafts, then the target's).
        g = None if noise is None else noise.gumbel(produced, gamma + 1, vocab)
        tic = time.perf_counter()
        # The last draft step reads P + γ positions; only the draft's KV read depends on it.
        o = replace(base, draft_kv=kv_at(cache[0].offset + gamma), draft_join=join)
        drafts, q = draft(
            model, cache, y, plan.steps, sampler, history, processors, o, g, plan.ngram
        )
        if gamma:
            mx.eval(drafts, q)
        draft_s = time.perf_counter() - tic

        tic = time.perf_counter()
        written = gamma if plan.steps else 0  # a copy alone wrote nothing
        logits = verify(model, cache, y, drafts, history, processors, parity, options, written)
        p = sampler.logprobs(logits)
        if rule == "gumbel" or (g is not None and not gamma):  # emit t_i = argmax(p_i + g_i)
            n, token = coupled_sample(drafts, p, g)
        elif g is not None:  # seeded rejection sampling
            n, token = noise.rejection_sample(drafts, q, p, produced, g)
        elif gamma:
            n, token = speculative_sample(drafts, q, p)
        else:  # unseeded target-only step: what speculative_sample does for γ = 0
            n, token = mx.array(0), sampler.sample(p[0])
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(n, token, logprobs)
        n = n.item()
        commit(cache, gamma, n)
        verify_s = time.perf_counter() - tic

        control.update(plan, n, draft_s, verify_s)
        stats.verify_s += verify_s
        stats.draft_s += draft_s if gamma else 0.0
        stats.record(plan.as_round(n))
        stats.fallback = stats.fallback or (adaptive and control.fell_back)

        out = drafts[:n].tolist() + [token.item()]
        for i, t in enumerate(out):
            yield t, logprobs[i], i < n
        produced += len(out)
        lookup.extend(out)
        stats.draft_vocab_joined = join.add(out) if join is not None else 0
        y = mx.array(out[-1:], dtype=mx.uint32)
        if processors:
            history = mx.concatenate([history, drafts[:n], y])


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | mx.array | list[int],
    max_tokens: int = 256,
    *,
    sampler: Callable | None = None,
    stats: SpeculativeStats | None = None,
    seed: int | None = None,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """mlx-lm's `stream_generate` for bitnest models, speculative by default.

    kwargs go to `speculative_generate_step` (num_draft_tokens, fallback, adaptive, parity,
    rule, logits_processors, prompt_cache, prefill_step_size). `seed` (int) makes the output
    reproducible run to run and equal to target-only decoding's (`num_draft_tokens=0`) with
    the same seed; None uses the global `mx.random` state. `sampler` must come from
    `bitnest_mlx.make_sampler(...)` (rejection sampling needs its distribution), or be None
    (greedy) or mlx-lm's greedy sampler.
    Pass a `SpeculativeStats` as `stats` to read acceptance and timing afterwards.
    """
    from mlx_lm.sample_utils import greedy_sampler

    if sampler is None or sampler is greedy_sampler:
        sampler = Sampler()
    if not isinstance(sampler, Sampler):
        raise TypeError(
            "speculative decoding needs the sampling distribution: use "
            "bitnest_mlx.make_sampler(temp, top_p, min_p, top_k=...) instead of an opaque sampler"
        )
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    if isinstance(prompt, str):
        bos = tokenizer.bos_token
        prompt = tokenizer.encode(
            prompt, add_special_tokens=bos is None or not prompt.startswith(bos)
        )
    prompt = mx.array(prompt, dtype=mx.uint32) if not isinstance(prompt, mx.array) else prompt
    stats = stats if stats is not None else SpeculativeStats()
    detokenizer = tokenizer.detokenizer

    tic = time.perf_counter()
    steps = speculative_generate_step(
        prompt, model, max_tokens=max_tokens, sampler=sampler, stats=stats, seed=seed, **kwargs
    )
    for n, (token, logprobs, from_draft) in enumerate(steps):
        if n == 0:
            prompt_tps = prompt.size / (time.perf_counter() - tic)
            tic = time.perf_counter()
        finish = "stop" if token in tokenizer.eos_token_ids else None
        if finish is None:
            detokenizer.add_token(token)
            finish = "length" if n + 1 == max_tokens else None
        if finish:
            detokenizer.finalize()
        stats.generation_tokens = n + 1 - (finish == "stop")
        stats.generation_tps = (n + 1) / max(time.perf_counter() - tic, 1e-9)
        yield GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=stats.generation_tps,
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish,
        )
        if finish:
            break


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str | list[int],
    verbose: bool = False,
    **kwargs,
) -> str:
    """The whole completion as a string (mlx-lm's `generate`); kwargs (seed, sampler, ...) as
    `stream_generate`."""
    text, r = "", None
    for r in stream_generate(model, tokenizer, prompt, **kwargs):
        text += r.text
        if verbose:
            print(r.text, end="", flush=True)
    if verbose and r is not None:
        print(
            f"\nPrompt: {r.prompt_tokens} tokens, {r.prompt_tps:.3f} tokens-per-sec\n"
            f"Generation: {r.generation_tokens} tokens, {r.generation_tps:.3f} tokens-per-sec\n"
            f"Peak memory: {r.peak_memory:.3f} GB"
        )
    return text


__all__ = [
    "DraftController",
    "PositionNoise",
    "commit",
    "draft",
    "verify",
    "Sampler",
    "SpeculativeStats",
    "generate",
    "make_sampler",
    "speculative_generate_step",
    "speculative_sample",
    "stream_generate",
]
