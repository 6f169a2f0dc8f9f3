"""mlx-lm's speculative generator contract (`speculative_generate_step`) for a bitnest target
and its `PATH#draft` view, run by bitnest's shared-cache loop (`plugin.patch_generate`
puts it in place). Nothing here imports mlx_lm at module level (see `plugin`)."""

from __future__ import annotations

import inspect
import warnings

import mlx.core as mx
import mlx.nn as nn

DRAFT_SUFFIX = "#draft"


def supports_draft(model: object) -> bool:
    return getattr(model, "supports_draft", False)


class DraftView(nn.Module):
    """The draft reading (W4 weights, KV4) of a loaded bitnest target: its arrays, not a copy.

    `make_cache()` is empty: the shared-cache loop keeps one nested cache, the target's.
    """

    def __init__(self, target: nn.Module):
        super().__init__()
        self.target = target
        self.args = target.args
        self.model_type = target.model_type

    @property
    def layers(self) -> list:
        return self.target.layers

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        return self.target(inputs, cache, mode="draft")

    def make_cache(self) -> list:
        return []


def shared_cache_steps(
    prompt: mx.array,
    model: nn.Module,
    draft_model: DraftView,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler=None,
    logits_processors=None,
    prompt_cache: list | None = None,
    prefill_step_size: int = 512,
    **_kv_quantization,  # kv_bits & co: the nested cache is its own KV quantization
):
    """mlx-lm's speculative generator contract, run by bitnest's shared-cache loop."""
    from ..runtime import speculative

    if draft_model.target is not model:
        raise ValueError(f"a {DRAFT_SUFFIX} model can only draft for its own target")
    # The draft shares the target's cache: only the first len(model.layers) entries exist.
    cache = prompt_cache[: len(model.layers)] if prompt_cache is not None else None
    prompt = prompt.astype(mx.uint32)
    bitnest_sampler = as_bitnest_sampler(sampler)
    if bitnest_sampler is None:
        from mlx_lm.generate import generate_step

        warnings.warn(
            "this sampler's distribution is unknown (e.g. XTC), which rejection sampling "
            "needs: decoding with the target only",
            stacklevel=2,
        )
        steps = generate_step(
            prompt,
            model,
            max_tokens=max_tokens,
            sampler=sampler,
            logits_processors=logits_processors,
            prompt_cache=cache,
            prefill_step_size=prefill_step_size,
        )
        return ((t, lp, False) for t, lp in steps)
    steps = speculative.speculative_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        sampler=bitnest_sampler,
        logits_processors=logits_processors,
        num_draft_tokens=num_draft_tokens,
        prompt_cache=cache,
        prefill_step_size=prefill_step_size,
        # bitnest-server sets these from --draft-source / --ngram-tokens
        draft_source=getattr(draft_model, "draft_source", "auto"),
        ngram_tokens=getattr(draft_model, "ngram_tokens", 8),
    )
    return steps if cache is None else _settled(steps, model, cache, prompt.tolist())


def _settled(steps, model: nn.Module, cache: list, tokens: list[int]):
    """`steps`, leaving `cache` as mlx-lm's own generators do when they end or are closed:
    holding what it held before, the prompt and every token yielded, no more, no less.

    mlx-lm's server keys a saved prompt cache by those tokens and trims a reused one by their
    count. bitnest's loop ends a round holding the accepted drafts, so a consumer that stops in
    the middle of a round leaves extra positions, and the round's last token is not written yet.
    """
    start = cache[0].offset
    try:
        for step in steps:
            tokens.append(step[0])
            yield step
    except GeneratorExit:
        steps.close()
        _settle(model, cache, start + len(tokens), tokens)
        raise
    _settle(model, cache, start + len(tokens), tokens)


def _settle(model: nn.Module, cache: list, want: int, tokens: list[int]) -> None:
    extra = cache[0].offset - want
    if extra > 0:
        for c in cache:
            c.trim(extra)
    elif extra < 0:  # write the missing positions, as the target does
        model(mx.array([tokens[extra:]], dtype=mx.uint32), cache)
        mx.eval([c.state for c in cache])


def as_bitnest_sampler(sampler):
    """bitnest's Sampler with the same distribution as an mlx-lm sampler, or None if unknown.

    Rejection sampling needs the distribution, and mlx-lm's `make_sampler` returns an opaque
    closure: its parameters are read back from the closure (temp, and the top_p / min_p /
    top_k filters); any other filter (XTC) or a foreign sampler gives None.
    """
    from mlx_lm.sample_utils import greedy_sampler

    from ..runtime.sampling import Sampler

    if sampler is None or sampler is greedy_sampler:
        return Sampler()
    if isinstance(sampler, Sampler):
        return sampler
    if getattr(sampler, "__qualname__", "") != "make_sampler.<locals>.sampler":
        return None
    try:
        outer = inspect.getclosurevars(sampler).nonlocals
        params = {"temp": outer["temp"]}
        for method in outer["sampling_methods"]:
            params.update(inspect.getclosurevars(method).nonlocals)
    except (KeyError, TypeError):
        return None
    if not set(params) <= {"temp", "top_p", "min_p", "min_tokens_to_keep", "top_k"}:
        return None
    return Sampler(**params)
