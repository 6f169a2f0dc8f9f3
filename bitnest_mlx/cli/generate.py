"""`python -m bitnest_mlx.generate` (`bitnest-generate`): stream text (default model: the demo)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import stream_generate
from tqdm import tqdm

from .. import speculative
from ..demo import DEMO, resolve_model
from ..draftless import NoDraftError, draft_source_for
from ..layers.draft_vocab import draft_tokens
from ..loader import LOAD_ERRORS, load
from ..roofline import resolve_draft_kv
from ..sampling import SeededSampler
from ..sampling import make_sampler as bitnest_make_sampler
from .args import (
    Parser,
    add_chat_template_config,
    add_draft_kv,
    add_draft_source,
    add_draft_vocab_join,
    add_mode,
    add_verify,
    default_mode,
    fraction,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
    str_to_bool,
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.generate",
        description="Generate text with a bitnest package. Without --model (or with --model "
        "demo) it uses the demo package shipped with bitnest_mlx: a small Llama trained on "
        "Debian's license texts (offline).",
    )
    p.add_argument(
        "--model",
        default=DEMO,
        help="package directory, Hub id org/repo[@rev], or 'demo' (the shipped demo package; "
        "the default)",
    )
    p.add_argument(
        "--prompt",
        "-p",
        type=non_empty,
        default="Hello",
        help="prompt text, not empty; '-' reads it from stdin (default: %(default)r)",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=positive_int,
        default=100,
        help="maximum tokens to generate (>= 1; default %(default)s); generation stops earlier "
        "at an end-of-sequence token or at the end of the model's context, whichever comes first",
    )
    p.add_argument(
        "--temp",
        type=non_negative_float,
        default=0.8,
        help="sampling temperature (>= 0; 0 = greedy; default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        help="nucleus sampling threshold, in (0, 1] (1 = off)",
    )
    p.add_argument(
        "--top-k", type=non_negative_int, default=0, help="top-k sampling (>= 0; 0 = off)"
    )
    p.add_argument(
        "--min-p", type=fraction, default=0.0, help="min-p sampling, in [0, 1) (0 = off)"
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="random seed, >= 0 (default: %(default)s)"
    )
    add_mode(p)
    p.add_argument(
        "--num-draft-tokens",
        type=non_negative_int,
        default=3,
        help="speculative: maximum draft length per round (>= 0), adapted down from acceptance "
        "and measured costs; 0 = target-only (default: %(default)s)",
    )
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="speculative: never fall back to target-only decoding, even when measured faster",
    )
    add_draft_kv(p)
    add_draft_source(p)
    add_draft_vocab_join(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", help="system message for the chat template (default: none)")
    add_chat_template_config(p)
    p.add_argument(
        "--extra-eos-token",
        nargs="+",
        default=[],
        metavar="TOKEN",
        help="more tokens that end generation, beside the tokenizer's end-of-sequence "
        "(as mlx_lm.generate; default: none)",
    )
    p.add_argument(
        "--verbose",
        type=str_to_bool,
        default=True,
        metavar="{true,false}",
        help="false prints the generated text only: no notes or statistics on stderr "
        "(as mlx_lm.generate; default %(default)s)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (text, tokens, mode, stats)"
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="split the model's layers over the ranks of an mx.distributed group (run one "
        "process per rank with mlx.launch; DeepSeek-V4 bundles); only rank 0 prints",
    )
    p.add_argument(
        "--max-expert-memory",
        type=non_negative_float,
        metavar="GB",
        help="DeepSeek-V4: keep routed experts on disk and the most recently used in an LRU of "
        "this many GB (same output, less memory)",
    )
    add_verify(p)
    return p


def encode_prompt(tokenizer, prompt: str, args: argparse.Namespace) -> list[int]:
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
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    if args.system_prompt:
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, **args.chat_template_config
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mx.random.seed(args.seed)
    model_path = resolve_model(args.model)
    # Every rank computes the same logits and tokens; rank 0 speaks for the group.
    group = mx.distributed.init() if args.pipeline else None
    show = group is None or group.rank() == 0
    notes = show and args.verbose  # --verbose false: the text only
    try:
        tic = time.perf_counter()
        mode = "draft" if args.mode == "draft" else "target"
        model, tokenizer = load(
            model_path,
            mode=mode,
            pipeline=group,
            max_expert_memory=args.max_expert_memory,
            verify=args.verify,
        )
        load_s = time.perf_counter() - tic
    except LOAD_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if tokenizer is None:
        print(f"error: {model_path} has no tokenizer files (tokenizer.json, ...)", file=sys.stderr)
        return 2
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    if not model.supports_draft:
        # One precision only (DeepSeek-V4 bundles): no draft plane, so n-gram copies only.
        if args.mode == "draft":
            print(
                f"error: {model_path} has no draft plane (--mode draft needs a bitnest package)",
                file=sys.stderr,
            )
            return 2
        try:
            draft_source_for(args.draft_source, str(model_path))
        except NoDraftError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if args.draft_source == "none" or args.num_draft_tokens == 0:
            args.mode = "target"
    args.mode, note = default_mode(args.mode, speculates=True)
    if note and notes:
        print(note, file=sys.stderr)
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt_text:
        print("error: the prompt read from stdin is empty", file=sys.stderr)
        return 2
    prompt = encode_prompt(tokenizer, prompt_text, args)
    context = model.args.max_position_embeddings
    if len(prompt) >= context:
        print(
            f"error: the prompt is {len(prompt)} tokens, the model's context is {context}",
            file=sys.stderr,
        )
        return 2
    max_tokens = min(args.max_tokens, context - len(prompt))
    if max_tokens < args.max_tokens and notes:
        print(
            f"[generate] --max-tokens {args.max_tokens} capped at {max_tokens}: the prompt's "
            f"{len(prompt)} tokens leave that much of the model's {context}-token context",
            file=sys.stderr,
        )
    sampling = dict(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    spec_stats = speculative.SpeculativeStats()
    # Seeded in every mode: generated position i draws with PositionNoise(args.seed), so the
    # text is the same run to run, and target mode (the loop with γ = 0) equals speculative.
    if args.mode == "speculative" or (args.mode == "target" and model.supports_draft):
        responses = speculative.stream_generate(
            model,
            tokenizer,
            prompt,
            max_tokens=max_tokens,
            sampler=bitnest_make_sampler(**sampling),
            num_draft_tokens=args.num_draft_tokens if args.mode == "speculative" else 0,
            fallback=not args.no_fallback,
            stats=spec_stats,
            seed=args.seed,
            draft_kv=args.draft_kv,  # decided each round from the cache length
            draft_source=args.draft_source,
            ngram_tokens=args.ngram_tokens,
            draft_vocab_join=args.draft_vocab_join == "on",
        )
    else:  # the draft reading, or a model without one (DeepSeek-V4): mlx-lm's loop, same noise
        if model.supports_draft:  # mlx-lm's loop: one KV reading, for the final context
            kv = resolve_draft_kv(args.draft_kv, model, len(prompt) + max_tokens)
            model.options = replace(model.options, draft_kv=kv)
        seeded = SeededSampler(bitnest_make_sampler(**sampling), args.seed)
        responses = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=seeded)

    text, tokens, last = [], [], None
    # --json prints at the end: a progress bar on a terminal's stderr meanwhile.
    bar = tqdm(total=max_tokens, unit="tok", disable=not (notes and args.json) or None)
    for r in responses:
        text.append(r.text)
        if r.finish_reason != "stop":
            tokens.append(r.token)
        if show and not args.json:
            print(r.text, end="", flush=True)
        bar.update()
        last = r
    bar.close()
    stats = {
        "load_s": round(load_s, 3),
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tokens": len(tokens),
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(last.peak_memory, 4),
        "finish_reason": last.finish_reason,
    }
    if args.mode == "speculative":
        stats.update(
            acceptance_rate=round(spec_stats.acceptance_rate, 4),
            mean_accepted=round(spec_stats.mean_accepted, 3),
            draft_s=round(spec_stats.draft_s, 4),
            verify_s=round(spec_stats.verify_s, 4),
            fallback=spec_stats.fallback,
            num_draft_tokens=args.num_draft_tokens,
            mean_drafted=round(spec_stats.mean_drafted, 3),
            draft_vocab=draft_tokens(model),
            draft_vocab_joined=spec_stats.draft_vocab_joined,
            draft_source=args.draft_source,
            sources=spec_stats.sources,
        )
    if not show:  # another pipeline rank: the same text and stats as rank 0's
        return 0
    if args.json:
        out = {"text": "".join(text), "tokens": tokens, "mode": args.mode, "stats": stats}
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
        if not args.verbose:
            return 0
        print(
            f"[{args.mode}] prompt: {stats['prompt_tokens']} tokens, {stats['prompt_tps']} tok/s"
            f" | generation: {stats['generation_tokens']} tokens, {stats['generation_tps']} tok/s"
            f" | peak memory: {stats['peak_memory_gb']:.3f} GB",
            file=sys.stderr,
        )
        if args.mode == "speculative":
            print(
                f"[speculative] acceptance: {stats['acceptance_rate']:.1%}"
                f" | mean accepted: {stats['mean_accepted']} of {stats['mean_drafted']}"
                f" drafted per round | draft {stats['draft_s']} s, verify {stats['verify_s']} s"
                f" | fallback: {'yes' if stats['fallback'] else 'no'}"
                + (
                    f" | draft vocabulary: {stats['draft_vocab']} of {model.args.vocab_size}"
                    if stats["draft_vocab"] < model.args.vocab_size
                    else ""
                ),
                file=sys.stderr,
            )
            if stats["sources"]:
                print(f"[speculative] {sources_line(stats['sources'])}", file=sys.stderr)
    return 0


def sources_line(sources: dict) -> str:
    """`model: 26 rounds, 33 of 36 accepted | ngram: ...`: the per-source stats in one line."""
    return " | ".join(
        f"{name}: {s['rounds']} rounds, {s['accepted']} of {s['drafted']} accepted"
        for name, s in sorted(sources.items())
    )


if __name__ == "__main__":
    sys.exit(main())
