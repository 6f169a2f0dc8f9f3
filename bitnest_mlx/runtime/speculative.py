"""Self-speculative decoding: the W4/KV4 draft proposes, the W8/KV8 target verifies.

One model, one shared nested KV cache (docs/bitnest-package.md §5.5); `rounds.py` says what a
round does. γ = 0 is a plain target-only step, so target-only decoding and the fallback take
the same path. Sampling is lossless at any temperature (Leviathan et al. 2023 / Chen et al.
2023).

A `seed` makes runs reproducible: keyed noise per token position, the Gumbel-max coupling (the
output is the target-only sample for the seed, whatever γ) and γ from a fixed cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..layers.options import RunOptions
from .rounds import LogitsProcessor, SpeculationPolicy, SpeculativeRun, SpeculativeStats
from .sampling import Sampler, make_sampler


def speculative_generate_step(
    prompt: mx.array,
    model: nn.Module,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    stats: SpeculativeStats | None = None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 512,
    options: RunOptions | None = None,
    seed: int | None = None,
    rule: str | None = None,
    **policy,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield (token, target log-probabilities [V], from_draft) like mlx-lm's generator.

    `model`: a bitnest Model, or one with no draft plane (`draftless`: copies only). `policy`:
    the fields of `SpeculationPolicy` (num_draft_tokens, draft_source, fallback, adaptive,
    parity, draft_kv, ngram_tokens, ngram_min, cost_model, draft_vocab_join). `options`
    (RunOptions; its mode is set per call) default to the model's own. `max_tokens < 0` means
    no limit; `stats` is filled as the rounds run.

    `seed=None` uses the global `mx.random` state and measured costs. An int makes the run
    reproducible: generated position i draws from `PositionNoise(seed)`, and the plans follow
    fixed costs, not wall time. `rule`: "gumbel" (the Gumbel-max coupling: the output is the
    target-only sample for the seed, whatever is drafted; the default with a seed) or
    "rejection" (higher acceptance, output depends on the drafts; the default without).
    """
    run = SpeculativeRun.start(
        model,
        prompt,
        SpeculationPolicy(**policy),
        sampler=sampler,
        logits_processors=logits_processors,
        stats=stats,
        prompt_cache=prompt_cache,
        options=options,
        seed=seed,
        rule=rule,
    )
    y = run.prefill(prompt, prefill_step_size)
    if run.drafts_nothing:
        for token, logprobs in run.target_only(y, max_tokens):
            yield token, logprobs, False
        return
    produced = 0
    while max_tokens < 0 or produced < max_tokens:
        left = max_tokens - produced if max_tokens >= 0 else -1
        out, logprobs, n = run.round(y, produced, left)
        for i, t in enumerate(out):
            yield t, logprobs[i], i < n
        produced += len(out)
        y = mx.array(out[-1:], dtype=mx.uint32)


def _prepared(
    sampler: Callable | None, tokenizer, prompt: str | mx.array | list[int]
) -> tuple[Sampler, TokenizerWrapper, mx.array]:
    """`stream_generate`'s arguments as the loop takes them: our Sampler (mlx-lm's greedy
    sampler or None is greedy), mlx-lm's TokenizerWrapper, the prompt's token ids."""
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
    return sampler, tokenizer, prompt


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
    sampler, tokenizer, prompt = _prepared(sampler, tokenizer, prompt)
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
    "Sampler",
    "SpeculationPolicy",
    "SpeculativeStats",
    "generate",
    "make_sampler",
    "speculative_generate_step",
    "stream_generate",
]
