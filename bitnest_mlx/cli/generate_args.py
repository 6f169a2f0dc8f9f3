"""`bitnest-generate`'s flags (`generate.py` runs them)."""

from __future__ import annotations

import argparse

from .args import (
    Parser,
    add_chat_template_config,
    add_draft_kv,
    add_draft_source,
    add_draft_vocab_join,
    add_mode,
    add_sampling,
    add_verify,
    non_empty,
    non_negative_float,
    non_negative_int,
    positive_int,
    str_to_bool,
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.generate",
        description="Generate text with a bitnest package. Without --model (or with --model "
        "demo) it uses the demo package shipped with bitnest_mlx: a small Llama trained on "
        "Debian's license texts (offline).",
    )
    _add_prompt(p)
    add_sampling(p, temp=0.8)
    _add_speculation(p)
    _add_output(p)
    _add_memory(p)
    return p


# The flags by what they set, added in the order --help lists them.


def _add_prompt(p: argparse.ArgumentParser) -> None:
    """The model, the prompt and how long to generate."""
    p.add_argument(
        "--model",
        default=None,
        help="package directory, Hub id org/repo[@rev], or 'demo' (default: the model a "
        "--prompt-cache-file names, else demo, the shipped demo package)",
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


def _add_speculation(p: argparse.ArgumentParser) -> None:
    """Which precision runs and how the speculative loop drafts."""
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


def _add_output(p: argparse.ArgumentParser) -> None:
    """The chat template, what ends generation and what is printed."""
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


def _add_memory(p: argparse.ArgumentParser) -> None:
    """Where the model runs and how much of it is held in memory."""
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
    p.add_argument(
        "--max-kv-size",
        type=positive_int,
        metavar="N",
        help="the most positions the KV cache holds: prompt + output stop at N (the nested "
        "cache keeps every position, so unlike mlx-lm's rotating cache it caps, never slides; "
        "default: the model's context)",
    )
    p.add_argument(
        "--prompt-cache-file",
        metavar="FILE",
        help="a prompt cache saved by mlx_lm.cache_prompt: generation continues from the "
        "cached prompt with --prompt (a bitnest package; default: none)",
    )
    add_verify(p)
