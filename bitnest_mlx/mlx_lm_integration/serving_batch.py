"""bitnest-server's generation thread: mlx-lm's ResponseGenerator, which batches concurrent
requests with its BatchGenerator (over BatchNestedKVCache for a bitnest package), plus the rule
for a server that can also speculate:

* a request that is alone when the generation thread picks it (nothing queued, nothing in
  flight) is decoded speculatively, one sequence (mlx-lm's `_serve_single` with the `#draft`
  view: bitnest's shared-cache loop);
* any other request joins the batch, decoded by the target (W8A8KV8);
* when a request arrives while a lone one is speculating, the speculative stream stops after
  its current token and hands over: its cache (prompt and tokens sent) goes to the prompt cache,
  where the batch finds it, and the rest of it joins the batch with the newcomer, in the same
  response.

Greedy output is the target's in every case (speculation is lossless; a batched row equals the
sequence alone). Measured in docs/server.md ("Concurrency").
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any

import mlx_lm.server as mlx_server
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from ..cli.args import one_line
from .serving_requests import RequestError
from .speculation import DraftView


@dataclasses.dataclass
class Continuation(mlx_server.CompletionRequest):
    """The rest of a request that stopped speculating: its prompt is the tokens so far."""

    tokens: list[int] = dataclasses.field(default_factory=list)


class PromptCache(LRUPromptCache):
    """mlx-lm's prompt cache, which never leaves a request nothing to feed: on an exact hit the
    cache comes back one token short, and that token is the rest of the prompt. mlx-lm's batch
    path raises "empty prompt" on an exact hit, from the generation thread, which dies of it;
    a handed-over stream (its prompt is the tokens its cache holds) is such a hit by design."""

    def fetch_nearest_cache(self, model: Any, tokens: list[int]) -> tuple:
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if cache is not None and tokens and not rest:
            if not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest


class Tracked:
    """One request's response queue, as the generation thread writes it (mlx-lm puts the
    context, progress, Responses, then None or an exception): says when the request is done,
    and carries a handover (the second context swallowed, the text detokenized as one stream)."""

    def __init__(self, rqueue: Any, generator: Generator, args: Any):
        self.rqueue, self.generator, self.args = rqueue, generator, args
        self.ctx = None
        self.speculative = False  # decided once, when the generation thread first picks it
        self.preempted = self.client_stopped = False
        self.tokens: list[int] = []
        self.inner = None  # the continuation's own context (the batch checks its stop flag)
        self.detokenizer = None  # set for a continuation

    def client_stop(self) -> None:
        """The handler's `ctx.stop()` (end of response or disconnect), told apart from ours."""
        self.client_stopped = True
        for ctx in (self.ctx, self.inner):
            if ctx is not None:
                ctx._should_stop = True

    def put(self, item: Any) -> None:
        if isinstance(item, mlx_server.GenerationContext):
            if self.ctx is not None:  # a continuation's: the handler keeps the first
                self.inner = item
                item._should_stop = self.client_stopped
                return
            self.ctx = item
            item.stop = self.client_stop  # the handler calls it: ours to know it from a handover
        elif isinstance(item, mlx_server.Response):
            item = self._response(item)
        elif isinstance(item, Exception):
            self.preempted = False  # nothing to hand over
        elif item is None and self.preempted:  # not the end: the batch takes over the rest
            return
        self.rqueue.put(item)
        if item is None or isinstance(item, Exception) or self.client_stopped:
            self.generator.finished(self)

    def _response(self, r: mlx_server.Response) -> mlx_server.Response:
        self.tokens.append(r.token)
        if self.detokenizer is not None:  # mlx-lm's batch logic, on the whole stream's state
            d = self.detokenizer
            if r.finish_reason != "stop":
                d.add_token(r.token)
            if r.finish_reason is not None:
                d.finalize()
            r = dataclasses.replace(r, text=d.last_segment)
        elif self._hands_over(r):
            self.preempted = True
            self.ctx._should_stop = True  # _serve_single stops after this token
        return r

    def _hands_over(self, r: mlx_server.Response) -> bool:
        """Whether a lone speculative stream should stop here for the batch: more to come, the
        client still there, and another request waiting."""
        if not self.speculative or r.finish_reason is not None or self.client_stopped:
            return False
        return self.generator.waiting(self)

    def continuation(self, request: Any, tokenizer: Any) -> tuple:
        """(self, the rest of the request, its arguments) for the batch to take over."""
        self.preempted, self.speculative = False, False
        self.ctx._should_stop = self.client_stopped
        self.detokenizer = tokenizer.detokenizer
        for t in self.tokens:
            self.detokenizer.add_token(t)
        self.detokenizer.last_segment  # noqa: B018  (sent already, by the speculative stream)
        tokens = list(self.ctx.prompt) + self.tokens
        rest = Continuation("text", "", [], None, None, tokens=tokens)
        args = dataclasses.replace(self.args, max_tokens=self.args.max_tokens - len(self.tokens))
        self.args = args
        return self, rest, args


class Generator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread: the batch for concurrent requests, speculation for a lone one
    (module doc); a prompt that cannot be built, is empty or does not fit the context is the
    request's error (400), and `max_tokens` is capped at what the context leaves."""

    def __init__(self, model_provider: Any, prompt_cache: LRUPromptCache):
        self._lock = threading.Lock()
        self._in_flight: list[Tracked] = []
        super().__init__(model_provider, prompt_cache)  # starts the thread: state comes first

    def _next_request(self, timeout: float | None = None) -> tuple | None:
        got = super()._next_request(timeout)
        if got is None or isinstance(got[0], Tracked):  # a continuation is tracked already
            return got
        rqueue, request, args = got
        tracked = Tracked(rqueue, self, args)
        with self._lock:
            alone = not self._in_flight and self.requests.empty()
            self._in_flight.append(tracked)
        tracked.speculative = alone and self._speculates(args)
        n = len(self._in_flight)
        how = "alone: speculative" if tracked.speculative else f"batched target, {n} in flight"
        logging.info("request: %s", how)
        return tracked, request, args

    def _speculates(self, args: Any) -> bool:
        return isinstance(self.model_provider.draft_model, DraftView) and super()._is_batchable(
            args
        )

    def _is_batchable(self, args: Any) -> bool:
        if not super()._is_batchable(args):
            return False
        with self._lock:
            mine = [t for t in self._in_flight if t.args is args]
        return not (mine and mine[0].speculative)

    def waiting(self, tracked: Tracked) -> bool:
        """Whether another request waits or is in flight beside `tracked`."""
        with self._lock:
            return not self.requests.empty() or any(t is not tracked for t in self._in_flight)

    def finished(self, tracked: Tracked) -> None:
        with self._lock:
            if tracked in self._in_flight:
                self._in_flight.remove(tracked)

    def _serve_single(self, request: tuple, stream: Any) -> None:
        super()._serve_single(request, stream)
        tracked = request[0]
        if not (isinstance(tracked, Tracked) and tracked.preempted):
            return
        if tracked.client_stopped:  # gone during the handover: nothing to continue
            self.finished(tracked)
            return
        n = len(tracked.tokens)
        logging.info("request: speculative for %d tokens, the rest joins the batch", n)
        self.requests.put(tracked.continuation(request[1], self.model_provider.tokenizer))

    def _tokenize(self, tokenizer: Any, request: Any, args: Any) -> tuple:
        if isinstance(request, Continuation):
            return request.tokens, [request.tokens], ["assistant"], "normal", None
        try:
            result = super()._tokenize(tokenizer, request, args)
        except Exception as e:
            raise RequestError(f"cannot build the prompt: {one_line(e)}", param="messages") from e
        n, context = len(result[0]), self.model_provider.context
        if n == 0:
            raise RequestError("the prompt is empty (it has no tokens)", param="prompt")
        if context:
            if n >= context:
                raise RequestError(
                    f"the prompt is {n} tokens; this model's context is {context} tokens "
                    "(max_position_embeddings), which leaves no room to generate",
                    param="messages" if request.request_type == "chat" else "prompt",
                )
            args.max_tokens = min(args.max_tokens, context - n)
        return result
