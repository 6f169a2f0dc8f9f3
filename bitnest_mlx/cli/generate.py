"""`python -m bitnest_mlx.generate` (`bitnest-generate`): stream text (default model: the demo)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import stream_generate
from tqdm import tqdm

from ..layers.cache_files import PromptCacheError, check_fits, load_prompt_cache
from ..layers.draft_vocab import draft_tokens
from ..runtime import speculative
from ..runtime.demo import DEMO, resolve_model
from ..runtime.draft_kv import resolve_draft_kv
from ..runtime.draftless import NoDraftError, draft_source_for
from ..runtime.loader import LOAD_ERRORS, load
from ..runtime.sampling import SeededSampler
from ..runtime.sampling import make_sampler as bitnest_make_sampler
from .args import default_mode, refuse
from .generate_args import build_parser


def encode_prompt(tokenizer, prompt: str, args: argparse.Namespace, tokenize: bool = True):
    if args.ignore_chat_template or not getattr(tokenizer, "has_chat_template", False):
        if args.system_prompt:
            print(
                "[generate] --system-prompt is not used: "
                + (
                    "--ignore-chat-template is set"
                    if args.ignore_chat_template
                    else "the model has no chat template"
                ),
                file=sys.stderr,
            )
        return tokenizer.encode(prompt) if tokenize else prompt
    messages = [{"role": "user", "content": prompt}]
    if args.system_prompt:
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=tokenize, **args.chat_template_config
    )


class Refused(Exception):
    """A reason to stop before generating: one line on stderr, exit status 2."""


@dataclass
class Job:
    """What one run decodes: the loaded model, the prompt and its budget."""

    model: nn.Module
    tokenizer: object
    prompt: list[int]
    max_tokens: int
    cache: list | None  # a --prompt-cache-file's cache, which holds what precedes the prompt
    load_s: float


def _load(args: argparse.Namespace, group) -> tuple[nn.Module, object, float]:
    tic = time.perf_counter()
    try:
        model, tokenizer = load(
            resolve_model(args.model),
            mode="draft" if args.mode == "draft" else "target",
            pipeline=group,
            max_expert_memory=args.max_expert_memory,
            verify=args.verify,
        )
    except LOAD_ERRORS as e:
        raise Refused(e) from None
    if tokenizer is None:
        raise Refused(f"{args.model} has no tokenizer files (tokenizer.json, ...)")
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    return model, tokenizer, time.perf_counter() - tic


def _choose_mode(args: argparse.Namespace, model: nn.Module) -> str:
    """The mode to run; the note saying why, when the hardware chose it."""
    if not model.supports_draft:
        # One precision only (DeepSeek-V4 bundles): no draft plane, so n-gram copies only.
        if args.mode == "draft":
            raise Refused(f"{args.model} has no draft plane (--mode draft needs a bitnest package)")
        try:
            draft_source_for(args.draft_source, str(args.model))
        except NoDraftError as e:
            raise Refused(e) from None
        if args.draft_source == "none" or args.num_draft_tokens == 0:
            args.mode = "target"
    args.mode, note = default_mode(args.mode, speculates=True)
    return note


def _read_cache_file(path: str | None) -> tuple[list | None, dict]:
    """A --prompt-cache-file's caches and metadata, read once (None, {} without one)."""
    if path is None:
        return None, {}
    try:
        return load_prompt_cache(path)
    except PromptCacheError as e:
        raise Refused(e) from None


def _fit_cache(args: argparse.Namespace, model: nn.Module, cache: list | None) -> list | None:
    if cache is None:
        return None
    if not model.supports_draft:
        raise Refused(
            f"--prompt-cache-file: {args.model} is a DeepSeek-V4 bundle, whose cache a "
            "prompt-cache file cannot restore; it works with bitnest packages"
        )
    try:
        check_fits(cache, model.make_cache(), args.prompt_cache_file)
    except PromptCacheError as e:
        raise Refused(e) from None
    return cache


def _encode(args: argparse.Namespace, tokenizer, cached: bool) -> list[int]:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not text:
        raise Refused("the prompt read from stdin is empty")
    if not cached:
        return encode_prompt(tokenizer, text, args)
    if args.ignore_chat_template or not getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode(text, add_special_tokens=False)
    # mlx-lm's rule for a cached prefix: the templated prompt from where the query starts.
    marked = encode_prompt(tokenizer, "<query>", args, tokenize=False)
    full = encode_prompt(tokenizer, text, args, tokenize=False)
    return tokenizer.encode(full[marked.index("<query>") :], add_special_tokens=False)


def _budget(args: argparse.Namespace, model: nn.Module, prompt: list[int], held: int) -> int:
    """--max-tokens within the context (and --max-kv-size): the cache holds `held` already."""
    context = model.args.max_position_embeddings
    limit, what = context, f"the model's {context}-token context"
    if args.max_kv_size is not None and args.max_kv_size < context:
        limit, what = args.max_kv_size, f"--max-kv-size {args.max_kv_size}"
    used = held + len(prompt)
    if used >= limit:
        raise Refused(f"the prompt is {used} tokens, {what} holds {limit}")
    max_tokens = min(args.max_tokens, limit - used)
    if max_tokens < args.max_tokens and args.verbose:
        print(
            f"[generate] --max-tokens {args.max_tokens} capped at {max_tokens}: the prompt's "
            f"{used} tokens leave that much of {what}",
            file=sys.stderr,
        )
    return max_tokens


def prepare(args: argparse.Namespace, group, notes: bool) -> Job:
    """Load, choose the mode, read the prompt (and a cached prefix) and size the run."""
    cache, metadata = _read_cache_file(args.prompt_cache_file)
    if args.model is None:  # a prompt-cache file names its model, as in mlx-lm
        args.model = metadata.get("model") or DEMO
    model, tokenizer, load_s = _load(args, group)
    note = _choose_mode(args, model)
    if note and notes:
        print(note, file=sys.stderr)
    cache = _fit_cache(args, model, cache)
    prompt = _encode(args, tokenizer, cached=cache is not None)
    held = cache[0].offset if cache else 0
    max_tokens = _budget(args, model, prompt, held)
    return Job(model, tokenizer, prompt, max_tokens, cache, load_s)


def responses(args: argparse.Namespace, job: Job, spec_stats: speculative.SpeculativeStats):
    """The stream of GenerationResponses for the chosen mode."""
    model = job.model
    sampler = bitnest_make_sampler(
        temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p
    )
    # Seeded in every mode: generated position i draws with PositionNoise(args.seed), so the
    # text is the same run to run, and target mode (the loop with γ = 0) equals speculative.
    if args.mode == "speculative" or (args.mode == "target" and model.supports_draft):
        return speculative.stream_generate(
            model,
            job.tokenizer,
            job.prompt,
            max_tokens=job.max_tokens,
            sampler=sampler,
            num_draft_tokens=args.num_draft_tokens if args.mode == "speculative" else 0,
            fallback=not args.no_fallback,
            stats=spec_stats,
            seed=args.seed,
            draft_kv=args.draft_kv,  # decided each round from the cache length
            draft_source=args.draft_source,
            ngram_tokens=args.ngram_tokens,
            draft_vocab_join=args.draft_vocab_join == "on",
            prompt_cache=job.cache,
        )
    # The draft reading, or a model without one (DeepSeek-V4): mlx-lm's loop, same noise.
    if model.supports_draft:  # mlx-lm's loop: one KV reading, for the final context
        kv = resolve_draft_kv(args.draft_kv, model, len(job.prompt) + job.max_tokens)
        model.options = replace(model.options, draft_kv=kv)
    return stream_generate(
        model,
        job.tokenizer,
        job.prompt,
        max_tokens=job.max_tokens,
        sampler=SeededSampler(sampler, args.seed),
        prompt_cache=job.cache,
    )


def collect(args: argparse.Namespace, job: Job, stream, show: bool, notes: bool):
    """Stream the text (unless --json) and return (text, tokens, last response)."""
    text, tokens, last = [], [], None
    # --json prints at the end: a progress bar on a terminal's stderr meanwhile.
    bar = tqdm(total=job.max_tokens, unit="tok", disable=not (notes and args.json) or None)
    for r in stream:
        text.append(r.text)
        if r.finish_reason != "stop":
            tokens.append(r.token)
        if show and not args.json:
            print(r.text, end="", flush=True)
        bar.update()
        last = r
    bar.close()
    return "".join(text), tokens, last


def run_stats(args, job: Job, tokens: list[int], last, spec: speculative.SpeculativeStats) -> dict:
    stats = {
        "load_s": round(job.load_s, 3),
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tokens": len(tokens),
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(last.peak_memory, 4),
        "finish_reason": last.finish_reason,
    }
    if args.mode == "speculative":
        stats.update(
            acceptance_rate=round(spec.acceptance_rate, 4),
            mean_accepted=round(spec.mean_accepted, 3),
            draft_s=round(spec.draft_s, 4),
            verify_s=round(spec.verify_s, 4),
            fallback=spec.fallback,
            num_draft_tokens=args.num_draft_tokens,
            mean_drafted=round(spec.mean_drafted, 3),
            draft_vocab=draft_tokens(job.model),
            draft_vocab_joined=spec.draft_vocab_joined,
            draft_source=args.draft_source,
            sources=spec.sources,
        )
    return stats


def stats_lines(mode: str, stats: dict, vocab_size: int) -> list[str]:
    lines = [
        f"[{mode}] prompt: {stats['prompt_tokens']} tokens, {stats['prompt_tps']} tok/s"
        f" | generation: {stats['generation_tokens']} tokens, {stats['generation_tps']} tok/s"
        f" | peak memory: {stats['peak_memory_gb']:.3f} GB"
    ]
    if mode != "speculative":
        return lines
    vocab = stats["draft_vocab"]
    lines.append(
        f"[speculative] acceptance: {stats['acceptance_rate']:.1%}"
        f" | mean accepted: {stats['mean_accepted']} of {stats['mean_drafted']}"
        f" drafted per round | draft {stats['draft_s']} s, verify {stats['verify_s']} s"
        f" | fallback: {'yes' if stats['fallback'] else 'no'}"
        + (f" | draft vocabulary: {vocab} of {vocab_size}" if vocab < vocab_size else "")
    )
    if stats["sources"]:
        lines.append(f"[speculative] {sources_line(stats['sources'])}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mx.random.seed(args.seed)
    # Every rank computes the same logits and tokens; rank 0 speaks for the group.
    group = mx.distributed.init() if args.pipeline else None
    show = group is None or group.rank() == 0
    args.verbose = show and args.verbose  # --verbose false: the text only
    try:
        job = prepare(args, group, args.verbose)
    except Refused as e:
        return refuse(e)
    spec_stats = speculative.SpeculativeStats()
    stream = responses(args, job, spec_stats)
    text, tokens, last = collect(args, job, stream, show, args.verbose)
    stats = run_stats(args, job, tokens, last, spec_stats)
    if not show:  # another pipeline rank: the same text and stats as rank 0's
        return 0
    if args.json:
        out = {"text": text, "tokens": tokens, "mode": args.mode, "stats": stats}
        print(json.dumps(out, ensure_ascii=False))
        return 0
    print()
    if args.verbose:
        for line in stats_lines(args.mode, stats, job.model.args.vocab_size):
            print(line, file=sys.stderr)
    return 0


def sources_line(sources: dict) -> str:
    """`model: 26 rounds, 33 of 36 accepted | ngram: ...`: the per-source stats in one line."""
    return " | ".join(
        f"{name}: {s['rounds']} rounds, {s['accepted']} of {s['drafted']} accepted"
        for name, s in sorted(sources.items())
    )


if __name__ == "__main__":
    sys.exit(main())
