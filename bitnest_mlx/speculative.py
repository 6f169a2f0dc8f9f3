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
from dataclasses import asdict, dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .layers.options import RunOptions
from .roofline import draft_kv_policy
from .sampling import RULES, PositionNoise, Sampler, make_sampler, speculative_sample
from .sampling import gumbel_speculative_sample as coupled_sample

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

    def as_dict(self) -> dict:
        extra = ("acceptance_rate", "mean_accepted", "mean_drafted")
        return {**asdict(self), **{k: getattr(self, k) for k in extra}}


class DraftLengthController:
    """Picks γ per round by maximizing expected tokens per second (0 = target-only step).

    Acceptance α is a decayed estimate of P(accept); a round of length γ emits
    E(γ) = (1 - α^(γ+1)) / (1 - α) tokens (Leviathan et al.) and costs γ·t_draft + t_verify(γ),
    with t_verify(k) a line fitted through the measured verify times of k+1 rows, since
    verifying is not free (on a compute-bound CPU it is ~linear in rows). The first rounds
    measure γ = max, 1 and (with fallback) 0; every `reprobe` target-only rounds one
    speculative round refreshes the estimates.

    `costs=(draft step, verify fixed, verify per row)` (in target steps) replaces the measured
    times: t_draft = costs[0], t_verify(k) = costs[1] + costs[2]·(k + 1), so γ depends only on
    the acceptances. Seeded runs use FIXED_COSTS, a bandwidth-bound decode (Apple GPUs): a
    draft step reads about half the target's bytes, each extra verified row adds a tenth of a
    step; speculation pays above α ≈ 0.65.
    """

    FIXED_COSTS = (0.55, 0.9, 0.1)

    def __init__(self, max_gamma: int, fallback: bool = True, reprobe: int = 32, costs=None):
        self.max_gamma, self.fallback, self.reprobe = max_gamma, fallback, reprobe
        self.hits, self.trials = 4.0, 5.0  # prior α = 0.8, weight of 5 drafts
        self.costs = costs
        self.t_draft: float | None = None if costs is None else costs[0]
        self.t_verify: dict[int, float] = {}
        self.since_spec = 0
        self.warm = False

    @property
    def alpha(self) -> float:
        return min(self.hits / self.trials, 0.999)

    def _verify_cost(self, k: int) -> float:
        if self.costs is not None:
            return self.costs[1] + self.costs[2] * (k + 1)
        if k in self.t_verify:
            return self.t_verify[k]
        ks = list(self.t_verify)
        if len(ks) == 1:  # proportional to rows
            return self.t_verify[ks[0]] * (k + 1) / (ks[0] + 1)
        mk = sum(ks) / len(ks)
        mt = sum(self.t_verify.values()) / len(ks)
        slope = sum((x - mk) * (self.t_verify[x] - mt) for x in ks)
        slope = max(slope / sum((x - mk) ** 2 for x in ks), 0.0)
        return mt + slope * (k - mk)

    def tokens_per_second(self, gamma: int) -> float:
        a = self.alpha
        expected = (1 - a ** (gamma + 1)) / (1 - a)
        return expected / (gamma * (self.t_draft or 0.0) + self._verify_cost(gamma))

    def choose(self) -> int:
        if self.max_gamma == 0:
            return 0
        for probe in (self.max_gamma, 1, 0) if self.costs is None else ():
            if probe not in self.t_verify and (probe > 0 or self.fallback):
                return probe
        low = 0 if self.fallback and self.since_spec < self.reprobe else 1
        return max(range(low, self.max_gamma + 1), key=self.tokens_per_second)

    def update(self, gamma: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if gamma:
            self.hits = 0.95 * self.hits + accepted
            self.trials = 0.95 * self.trials + accepted + (accepted < gamma)
        if self.costs is not None:  # the fixed model: measured times are not used
            self.since_spec = self.since_spec + 1 if gamma == 0 else 0
            return
        if not self.warm:  # the first round pays one-off costs (allocation, compilation)
            self.warm = True
            return
        ema = lambda old, new: new if old is None else 0.7 * old + 0.3 * new
        self.t_verify[gamma] = ema(self.t_verify.get(gamma), verify_s)
        if gamma == 0:
            self.since_spec += 1
            return
        self.since_spec = 0
        self.t_draft = ema(self.t_draft, draft_s / gamma)


def _apply_processors(
    processors: Sequence[LogitsProcessor], history: mx.array, logits: mx.array
) -> mx.array:
    for proc in processors:
        logits = proc(history, logits)
    return logits


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
) -> tuple[mx.array, mx.array]:
    """γ draft steps from token y [1]: writes cache positions P..P+γ-1 (W4; KV4 or KV8 reads).

    Returns the drafts [γ] and their processed log-probabilities q [γ, V]. With `noise`
    ([≥ γ, V] standard Gumbel, seeded runs) draft i is argmax(q_i + noise_i).
    """
    tokens, q_rows, x = [], [], y
    for i in range(gamma):
        logits = model(x[None], cache, "draft", options=options)[0, -1:]
        if processors:
            logits = _apply_processors(processors, mx.concatenate([history, *tokens]), logits)
        q_rows.append(sampler.logprobs(logits))
        x = sampler.sample(q_rows[-1], None if noise is None else noise[i : i + 1])
        tokens.append(x)
    if not gamma:
        return mx.zeros((0,), dtype=mx.uint32), mx.zeros((0, model.args.vocab_size))
    return mx.concatenate(tokens), mx.concatenate(q_rows)


def verify(
    model: nn.Module,
    cache: list,
    y: mx.array,
    drafts: mx.array,
    history: mx.array | None = None,
    processors: Sequence[LogitsProcessor] = (),
    parity: bool = False,
    options: RunOptions | None = None,
) -> mx.array:
    """Rewind the draft's γ writes, then one target pass over [y, drafts] (W8, KV8 reads).

    The pass overwrites positions P..P+γ with target K/V. Returns the target logits [γ+1, V]
    (logits processors applied row by row with the matching token history). `parity=True`
    verifies one token per call instead: the exact kernels of target-only decoding, for
    backends whose multi-row matmuls round differently from single-row ones (not MLX's CPU).
    """
    for c in cache:
        c.trim(drafts.size)
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
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield (token, target log-probabilities [V], from_draft) like mlx-lm's generator.

    `model` is a bitnest Model (calls take mode="draft" / "target"). `num_draft_tokens` is the
    maximum γ (0 = target-only); `fallback=False` never chooses γ = 0, forcing speculation;
    `adaptive=False` always drafts `num_draft_tokens`; `parity=True` see `verify`. `options`
    (RunOptions; its mode is set per call) default to the model's own. `draft_kv`: the KV the
    draft reads, 4, 8 or "auto" (decided each round from the cache length, `roofline`).
    `max_tokens < 0` means no limit.

    `seed=None` uses the global `mx.random` state and measured costs. An int makes the run
    reproducible: generated position i draws from `PositionNoise(seed)`, and γ follows
    `DraftLengthController.FIXED_COSTS`, not wall time. `rule`: "gumbel" (the Gumbel-max
    coupling: the output is the target-only sample for the seed, whatever γ; the default with a
    seed) or "rejection" (higher acceptance, output depends on γ; the default without).
    """
    rule = rule or ("rejection" if seed is None else "gumbel")
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, not {rule!r}")
    sampler = sampler or Sampler()
    processors = list(logits_processors or [])
    stats = stats if stats is not None else SpeculativeStats()
    cache = prompt_cache if prompt_cache is not None else model.make_cache(options)
    costs = None if seed is None else DraftLengthController.FIXED_COSTS
    control = DraftLengthController(num_draft_tokens, fallback, costs=costs)
    if seed is None and rule == "gumbel":  # the coupling needs keyed noise: draw a seed
        seed = mx.random.randint(0, 2**31 - 1).item()
    noise = None if seed is None or sampler.temp == 0 else PositionNoise(seed)
    rule = "gumbel" if sampler.temp == 0 else rule  # greedy: both are exact match; plain argmax
    vocab = model.args.vocab_size
    history = prompt
    kv_at, base = draft_kv_policy(draft_kv, model), options or model.options

    # Prefill prompt[:-1] with the target; the last prompt token starts the first round.
    for i in range(0, prompt.size - 1, prefill_step_size):
        chunk = prompt[None, i : min(i + prefill_step_size, prompt.size - 1)]
        model(chunk, cache, "target", options=options)
        mx.eval([c.state for c in cache])
    y = prompt[-1:]

    produced = 0
    while max_tokens < 0 or produced < max_tokens:
        chosen = gamma = control.choose() if adaptive else num_draft_tokens
        if max_tokens >= 0:
            gamma = min(gamma, max_tokens - produced - 1)

        # Seeded: Gumbel rows g of positions produced..produced+γ (drafts, then the target's).
        g = None if noise is None else noise.gumbel(produced, gamma + 1, vocab)
        tic = time.perf_counter()
        # The last draft step reads P + γ positions; only the draft's KV read depends on it.
        o = replace(base, draft_kv=kv_at(cache[0].offset + gamma))
        drafts, q = draft(model, cache, y, gamma, sampler, history, processors, o, g)
        if gamma:
            mx.eval(drafts, q)
        draft_s = time.perf_counter() - tic

        tic = time.perf_counter()
        logits = verify(model, cache, y, drafts, history, processors, parity, options)
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

        control.update(gamma, n, draft_s, verify_s)
        stats.verify_s += verify_s
        if gamma:
            stats.rounds += 1
            stats.drafted += gamma
            stats.accepted += n
            stats.draft_s += draft_s
        else:
            stats.target_steps += 1
            stats.fallback = stats.fallback or (chosen == 0 and num_draft_tokens > 0)

        out = drafts[:n].tolist() + [token.item()]
        for i, t in enumerate(out):
            yield t, logprobs[i], i < n
        produced += len(out)
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
    "DraftLengthController",
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
