"""`python -m bitnest_mlx.chat` (`bitnest-chat`): a multi-turn chat on the model's chat template.

Each line read is a user turn; the reply streams to stdout. `/reset` forgets the conversation,
`/exit` (or end of input) ends it, `/help` lists the commands (`mlx_lm.chat`'s q, r and h too).
The KV cache is kept from turn to turn: a turn prefills only the tokens the cache does not hold.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from ..runtime import speculative
from ..runtime.demo import DEMO, resolve_model
from ..runtime.loader import LOAD_ERRORS, load
from ..runtime.sampling import SeededSampler
from ..runtime.sampling import make_sampler as bitnest_make_sampler
from .args import (
    Parser,
    add_chat_template_config,
    add_draft_source,
    add_mode,
    add_sampling,
    default_mode,
    non_negative_int,
    positive_int,
    refuse,
)

EXIT, RESET, HELP = ("/exit", "/quit", "q"), ("/reset", "r"), ("/help", "h")
HELP_TEXT = "commands: /reset (or r) forgets the conversation, /exit (or q) ends it, /help (or h)"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.chat",
        description="Chat with a bitnest package or DeepSeek-V4 bundle on its chat template. "
        "Each line of input is a user turn; replies stream to stdout. " + HELP_TEXT + ".",
    )
    p.add_argument(
        "--model",
        default=DEMO,
        help="package directory, Hub id org/repo[@rev], or 'demo' (the shipped demo package, "
        "whose template the model was not trained on; the default)",
    )
    p.add_argument("--system-prompt", help="system message for every turn (default: none)")
    p.add_argument(
        "--max-tokens",
        "-m",
        type=positive_int,
        default=256,
        help="most tokens per reply (default %(default)s)",
    )
    add_sampling(p, temp=0.0)  # as mlx_lm.chat: greedy
    add_mode(p)
    p.add_argument(
        "--num-draft-tokens",
        type=non_negative_int,
        default=3,
        help="speculative: most W4 draft tokens per round (default %(default)s)",
    )
    add_draft_source(p)
    add_chat_template_config(p)
    p.add_argument(
        "--stats",
        action="store_true",
        help="after each reply, one line on stderr: tokens, tok/s and the speculative stats",
    )
    return p


class Conversation:
    """The messages so far, and the KV cache holding the tokens of the last turn."""

    def __init__(self, model: nn.Module, tokenizer, args: argparse.Namespace):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.reset()

    def reset(self) -> None:
        system = self.args.system_prompt
        self.messages = [{"role": "system", "content": system}] if system else []
        self.cache = self.model.make_cache()
        self.cached: list[int] = []  # the tokens the cache holds, in order

    def _reuse(self, tokens: list[int]) -> list[int]:
        """Trim the cache to its longest prefix of `tokens`; the tokens still to prefill."""
        keep = 0
        for a, b in zip(self.cached, tokens[:-1]):  # at least one token left to start from
            if a != b:
                break
            keep += 1
        try:
            for c in self.cache:
                c.trim(self.cache[0].offset - keep)
        except ValueError:  # a cache that cannot roll back that far: start it again
            self.cache, keep = self.model.make_cache(), 0
        self.cached = tokens[:keep]
        return tokens[keep:]

    def reply(self, text: str, stats: speculative.SpeculativeStats) -> Iterator[GenerationResponse]:
        """Stream the reply to the user's `text`; the conversation keeps both turns."""
        messages = [*self.messages, {"role": "user", "content": text}]
        tokens = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **self.args.chat_template_config
        )
        context = self.model.args.max_position_embeddings
        if len(tokens) >= context:
            raise ValueError(
                f"the conversation is {len(tokens)} tokens, the model's context is {context}: "
                "/reset to start again"
            )
        new = self._reuse(tokens)
        out: list[int] = []
        answer = []
        try:
            for r in self._generate(new, min(self.args.max_tokens, context - len(tokens)), stats):
                out.append(r.token)
                answer.append(r.text)
                yield r
        finally:
            self._settle(tokens + out)
        self.messages = [*messages, {"role": "assistant", "content": "".join(answer)}]

    def _generate(
        self, prompt: list[int], max_tokens: int, stats: speculative.SpeculativeStats
    ) -> Iterator[GenerationResponse]:
        a = self.args
        sampler = bitnest_make_sampler(temp=a.temp, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p)
        if self.model.supports_draft and a.mode != "draft":
            yield from speculative.stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=sampler,
                num_draft_tokens=a.num_draft_tokens if a.mode == "speculative" else 0,
                stats=stats,
                seed=a.seed,
                prompt_cache=self.cache,
                draft_source=a.draft_source,
                ngram_tokens=a.ngram_tokens,
            )
        else:  # the W4 reading, or a model with no draft plane: mlx-lm's loop, same noise
            yield from mlx_lm_stream_generate(
                self.model,
                self.tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=SeededSampler(sampler, a.seed),
                prompt_cache=self.cache,
            )

    def _settle(self, known: list[int]) -> None:
        """Drop what the cache holds past the tokens seen (a round's drafts after the end)."""
        extra = self.cache[0].offset - len(known)
        if extra > 0:
            for c in self.cache:
                c.trim(extra)
        self.cached = known[: self.cache[0].offset]


def turns(stream) -> Iterator[str]:
    """User turns: lines typed at a prompt on a terminal, else the lines of the input."""
    interactive = stream.isatty()
    while True:
        if interactive:
            try:
                line = input(">> ")
            except EOFError:
                return
        else:
            line = stream.readline()
            if not line:
                return
        if line.strip():
            yield line.strip()


def stats_line(r: GenerationResponse, stats: speculative.SpeculativeStats, mode: str) -> str:
    from .generate import sources_line

    line = (
        f"[{mode}] prompt: {r.prompt_tokens} tokens, {r.prompt_tps:.1f} tok/s | reply: "
        f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s"
    )
    if mode == "speculative" and stats.sources:
        line += f" | {sources_line(stats.sources)}"
    return line


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    mx.random.seed(args.seed)
    model_path = resolve_model(args.model)
    try:
        model, tokenizer = load(model_path, mode="draft" if args.mode == "draft" else "target")
    except LOAD_ERRORS as e:
        return refuse(e)
    if tokenizer is None or not tokenizer.has_chat_template:
        return refuse(
            f"{model_path} has no chat template (no 'chat_template' in tokenizer_config.json or "
            "chat_template.jinja): chat needs one; python -m bitnest_mlx.generate completes "
            "plain text"
        )
    args.mode, note = default_mode(args.mode, speculates=model.supports_draft)
    if note:
        print(note, file=sys.stderr)
    chat = Conversation(model, tokenizer, args)
    for text in turns(sys.stdin):
        if text in EXIT:
            break
        if text in RESET:
            chat.reset()
            print("[chat] the conversation is reset", file=sys.stderr)
            continue
        if text in HELP:
            print(f"[chat] {HELP_TEXT}", file=sys.stderr)
            continue
        stats = speculative.SpeculativeStats()
        last = None
        try:
            for last in chat.reply(text, stats):
                print(last.text, end="", flush=True)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        print(flush=True)
        if args.stats and last is not None:
            print(stats_line(last, stats, args.mode), file=sys.stderr)
    return 0
