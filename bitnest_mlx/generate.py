"""`python -m bitnest_mlx.generate`: stream text from a bitnest package (default: the demo)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from . import load
from .formats.bitnest import PackageError
from .hub import ModelNotFound


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bitnest_mlx.generate",
        description="Generate text with a bitnest package. Without --model the embedded demo "
        "package is built (offline, once) and used.",
    )
    p.add_argument("--model", help="package directory or Hub id org/repo[@rev] (default: demo)")
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text (default: %(default)r)")
    p.add_argument("--max-tokens", "-m", type=int, default=100, help="tokens to generate")
    p.add_argument("--temp", type=float, default=0.8, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p sampling (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument(
        "--mode",
        choices=("draft", "target"),
        default="target",
        help="draft = W4 weights + KV4 reads; target = W8 + KV8 (default)",
    )
    p.add_argument("--ignore-chat-template", action="store_true", help="use the raw prompt")
    p.add_argument("--system-prompt", help="system message for the chat template")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object (text, tokens, mode, stats)"
    )
    return p


def encode_prompt(tokenizer, prompt: str, args: argparse.Namespace) -> list[int]:
    if args.ignore_chat_template or not getattr(tokenizer, "has_chat_template", False):
        return tokenizer.encode(prompt)
    messages = [{"role": "user", "content": prompt}]
    if args.system_prompt:
        messages.insert(0, {"role": "system", "content": args.system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mx.random.seed(args.seed)
    model_path = args.model
    if model_path is None:
        from .demo import demo_path

        model_path = demo_path()
    try:
        tic = time.perf_counter()
        model, tokenizer = load(model_path, mode=args.mode)
        load_s = time.perf_counter() - tic
    except (PackageError, ModelNotFound) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    prompt = encode_prompt(tokenizer, args.prompt, args)
    context = model.args.max_position_embeddings
    if len(prompt) >= context:
        print(
            f"error: the prompt is {len(prompt)} tokens, the model's context is {context}",
            file=sys.stderr,
        )
        return 2
    max_tokens = min(args.max_tokens, context - len(prompt))
    sampler = make_sampler(args.temp, args.top_p, top_k=args.top_k, min_p=args.min_p)

    text, tokens, last = [], [], None
    for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler):
        text.append(r.text)
        if r.finish_reason != "stop":
            tokens.append(r.token)
        if not args.json:
            print(r.text, end="", flush=True)
        last = r
    stats = {
        "load_s": round(load_s, 3),
        "prompt_tokens": last.prompt_tokens,
        "prompt_tps": round(last.prompt_tps, 2),
        "generation_tokens": len(tokens),
        "generation_tps": round(last.generation_tps, 2),
        "peak_memory_gb": round(last.peak_memory, 4),
        "finish_reason": last.finish_reason,
    }
    if args.json:
        out = {"text": "".join(text), "tokens": tokens, "mode": args.mode, "stats": stats}
        print(json.dumps(out, ensure_ascii=False))
    else:
        print()
        print(
            f"[{args.mode}] prompt: {stats['prompt_tokens']} tokens, {stats['prompt_tps']} tok/s"
            f" | generation: {stats['generation_tokens']} tokens, {stats['generation_tps']} tok/s"
            f" | peak memory: {stats['peak_memory_gb']:.3f} GB",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
