"""mlx-lm's OpenAI server (`mlx_lm.server`) as `bitnest-server` runs it: the same endpoints and
flags, with the failure modes of careless users, broken files and many clients closed.

* The model is loaded (by mlx-lm's ModelProvider, in the generation thread, as mlx-lm does) and
  validated before the port is bound; if it cannot be, `main` raises and nothing listens.
* One startup line: model, format, mode, speculation, kernels path, context.
* `GET /v1/models` lists the served model, with or without a Hugging Face cache.
* A client that goes away is one log line, and its generation stops at the next token.
* A bad request gets a 4xx and a JSON body `{"error": ...}`: what mlx-lm already refuses, plus
  non-finite numbers, ids outside the vocabulary, a malformed `stop` / `stream_options` /
  `messages`, images for a text model, a model other than the served one, and a prompt that
  does not fit the model's context. `max_tokens` is capped at what the context leaves.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import mlx_lm.server as mlx_server
import mlx_lm.utils as mlx_utils
from mlx_lm.models.cache import LRUPromptCache

from ..formats import detect
from ..loader import LOAD_ERRORS, uses_kernels
from .args import one_line

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused unread (413)
DISCONNECTS = (ConnectionError, TimeoutError)  # BrokenPipe, ConnectionReset, ConnectionAborted
_FINITE = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "xtc_probability",
    "xtc_threshold",
)


class LoadFailed(Exception):
    """The model could not be loaded for a reason other than one of LOAD_ERRORS."""


class RequestError(ValueError):
    """A request the server refuses: answered with `status` and `{"error": message}`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def kernels_path(model) -> str:
    """Which path the layers take: no Metal, or the model's own switch (BITNEST_MLX_KERNELS,
    read when it was loaded), else the kernels, each self-tested at first use."""
    if not mx.metal.is_available():
        return "pure-mlx (no Metal device)"
    if not uses_kernels(model):
        return "pure-mlx (BITNEST_MLX_KERNELS=0 when the model was loaded)"
    return "metal (each kernel self-tested at first use)"


class Provider(mlx_server.ModelProvider):
    """mlx-lm's ModelProvider serving one model, also known by `aliases` (--model as the user
    gave it). Its id (in /v1/models) is the Hub id the user gave, else the resolved path.
    `loaded` is set once the first load finished, `load_error` says how it failed."""

    def __init__(self, cli_args, aliases: tuple[str, ...] = ()):
        super().__init__(cli_args)
        hub_ids = [a for a in aliases if a and not Path(a).exists()]
        self.model_id = hub_ids[0] if hub_ids else str(Path(cli_args.model).resolve())
        self.aliases = {a for a in (cli_args.model, self.model_id, *aliases) if a}
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None

    def load_default(self) -> None:
        self.loader_thread = threading.current_thread()
        try:
            super().load_default()
        except Exception as e:  # reported by `run` in the main thread, before the port is bound
            logging.debug("loading %s failed", self.cli_args.model, exc_info=True)
            self.load_error = e
        finally:
            self.loaded.set()

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if model_path in self.aliases:
            model_path = "default_model"
        loaded = super().load(model_path, adapter_path, draft_model_path)
        if self.draft_model is not None:  # a DraftView: what the shared-cache loop drafts with
            self.draft_model.draft_source = getattr(self.cli_args, "draft_source", "auto")
            self.draft_model.ngram_tokens = getattr(self.cli_args, "ngram_tokens", 8)
        return loaded

    @property
    def context(self) -> int | None:
        return getattr(getattr(self.model, "args", None), "max_position_embeddings", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(getattr(self.model, "args", None), "vocab_size", None)

    def startup_line(self) -> str:
        args = self.cli_args
        if self.draft_model is not None:
            spec = (
                f"speculation=on draft={args.draft_model} max-draft-tokens={args.num_draft_tokens} "
                f"draft-source={getattr(args, 'draft_source', 'auto')}"
            )
        else:
            spec = "speculation=off"
        return (
            f"bitnest-server: model={args.model} format={detect(args.model) or 'mlx-lm'} "
            f"mode={getattr(self.model, 'mode', 'target')} {spec} "
            f"kernels={kernels_path(self.model)} context={self.context}"
        )


class Generator(mlx_server.ResponseGenerator):
    """mlx-lm's generation thread; a prompt that cannot be built or does not fit the context is
    the request's error (400), and `max_tokens` is capped at what the context leaves."""

    def _tokenize(self, tokenizer, request, args):
        try:
            result = super()._tokenize(tokenizer, request, args)
        except Exception as e:
            raise RequestError(f"cannot build the prompt: {one_line(e)}") from e
        n, context = len(result[0]), self.model_provider.context
        if context:
            if n >= context:
                raise RequestError(
                    f"the prompt is {n} tokens; this model's context is {context} tokens "
                    "(max_position_embeddings), which leaves no room to generate"
                )
            args.max_tokens = min(args.max_tokens, context - n)
        return result


class Handler(mlx_server.APIHandler):
    """mlx-lm's request handler with quiet disconnects and the extra refusals (module doc)."""

    timeout = 300  # seconds a client may stay silent (a request never sent, a stream not read)
    _headers_sent = False

    def end_headers(self) -> None:
        self._headers_sent = True
        super().end_headers()

    def handle(self) -> None:
        try:
            super().handle()
        except DISCONNECTS as e:
            self.close_connection = True
            logging.info("client %s went away (%s)", self.client_address[0], type(e).__name__)

    def _set_completion_headers(self, status_code: int = 200):
        # mlx-lm picks the status inside its `except` blocks: ours says better when it knows.
        error = sys.exc_info()[1]
        if isinstance(error, RequestError):
            status_code = error.status
        elif status_code == 404 and error is not None:  # mlx-lm's answer to any failed generate()
            status_code = 500 if self.response_generator.is_healthy else 503
        super()._set_completion_headers(status_code)

    def _send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        super()._set_completion_headers(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = 0  # mlx-lm answers a missing or malformed Content-Length itself
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True
            status = 413 if length > 0 else 400
            return self._send_json(status, {"error": f"invalid Content-Length {length}"})
        try:
            super().do_POST()
        except DISCONNECTS:
            raise
        except Exception as e:
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        """An error mlx-lm's handler let through: a 4xx/5xx if nothing was sent yet, else an
        error event (stream) and a closed connection. One log line, never a traceback."""
        self.close_connection = True
        message = one_line(e)
        if isinstance(e, UnicodeDecodeError):
            message = f"Invalid JSON in request body: not UTF-8 ({e.reason})"
        if not self._headers_sent:
            self._headers_buffer = []  # http.server's: drop a status line mlx-lm buffered
            status = 400 if isinstance(e, (UnicodeDecodeError, RequestError)) else 500
            logging.error("request refused (%d): %s", status, message)
            return self._send_json(status, {"error": message})
        logging.error("request failed after its response began: %s", message)
        if getattr(self, "stream", False):
            self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        provider = self.response_generator.model_provider
        if self.requested_model != "default_model" and self.requested_model not in provider.aliases:
            raise RequestError(
                f"model {self.requested_model!r} is not served here; "
                f"this server serves {provider.model_id!r}",
                404,
            )
        if self.requested_draft_model not in ("default_model", provider.cli_args.draft_model):
            raise RequestError(
                "draft_model is fixed when the server starts (--draft-model / --target-only)"
            )
        if self.adapter is not None:
            raise RequestError("adapters are not supported by this server")
        if isinstance(self.max_tokens, bool):
            raise RequestError("max_tokens must be of type int")
        for name in _FINITE:
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise RequestError(f"{name} must be a finite number")
        self._validate_ids(provider.vocab_size)
        self._validate_stop_and_stream_options()
        self._validate_prompt(provider)

    def _validate_ids(self, vocab: int | None) -> None:
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise RequestError("seed must be in [0, 2**64)")
        if vocab is None:
            return
        if self.top_k > vocab:
            raise RequestError(f"top_k must be at most the vocabulary size {vocab}")
        for token, bias in (self.logit_bias or {}).items():
            if not 0 <= token < vocab:
                raise RequestError(f"logit_bias token id {token} is outside [0, {vocab})")
            if not math.isfinite(bias):
                raise RequestError(f"logit_bias for token {token} must be a finite number")

    def _validate_stop_and_stream_options(self) -> None:
        stop = self.body.get("stop")
        if not (
            stop is None
            or isinstance(stop, str)
            or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
        ):
            raise RequestError("stop must be a string or a list of strings")
        options = self.stream_options
        if options is not None:
            if not isinstance(options, dict):
                raise RequestError("stream_options must be an object")
            usage = options.get("include_usage", False)
            if not isinstance(usage, bool):
                raise RequestError("stream_options.include_usage must be a boolean")
            self.stream_options = {**options, "include_usage": usage}

    def _validate_prompt(self, provider: Provider) -> None:
        if self.path == "/v1/completions":
            if not isinstance(self.body.get("prompt"), str):
                raise RequestError("prompt must be a string")
            return
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError("each message must be an object with a string role")
            content = m.get("content")
            if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
                raise RequestError("message content parts must be objects")
            if not (content is None or isinstance(content, (str, list))):
                raise RequestError("message content must be a string or a list of parts")
        if provider.processor is None and any(mlx_server._image_parts(messages)):
            raise RequestError("this model takes no images")

    def handle_models_request(self) -> None:
        """The served model (mlx-lm scans the Hugging Face cache, which need not exist, and
        lists models this server would not serve)."""
        provider = self.response_generator.model_provider
        wanted = "/".join(p for p in self.path.split("?")[0].split("/")[3:] if p)
        entry = {"id": provider.model_id, "object": "model", "created": self.created}
        served = not wanted or wanted in provider.aliases
        self._send_json(200, {"object": "list", "data": [entry] if served else []})


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # many clients connecting at once (the stdlib default is 5)
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], DISCONNECTS):
            logging.info("client %s went away", client_address[0])
        else:
            super().handle_error(request, client_address)


def stop(generator: Generator, provider: Provider) -> None:
    """Stop the generation thread and wait until its OS thread is gone.

    `Thread.join` returns before the OS thread runs its thread-local destructors. MLX's (the
    random state that building a model touches) take the GIL, and abort the process
    ("terminate called without an active exception") if the interpreter is finalizing by then.
    """
    generator.stop_and_join()
    thread = getattr(provider, "loader_thread", None)
    task = Path(f"/proc/self/task/{getattr(thread, 'native_id', None)}")
    deadline = time.monotonic() + 2.0
    if task.parent.is_dir():
        while task.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        time.sleep(0.2)


def run(host: str, port: int, provider: Provider) -> None:
    """mlx_lm.server.run with our classes, the model loaded before the port is bound."""
    group = mx.distributed.init()
    generator = Generator(provider, LRUPromptCache(provider.cli_args.prompt_cache_size))
    try:
        while not provider.loaded.wait(0.1):
            if not generator.generation_available():
                break
    except KeyboardInterrupt:
        stop(generator, provider)
        raise
    if provider.load_error is not None or provider.model is None:
        stop(generator, provider)
        e = provider.load_error
        if isinstance(e, LOAD_ERRORS):
            raise e
        raise LoadFailed(f"cannot load {provider.cli_args.model}: {one_line(e)}") from e
    logging.info(provider.startup_line())
    if group.rank() != 0:
        generator.join()
        return
    family, _, _, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    server_class = type("Server", (Server,), {"address_family": family})
    fingerprint = mlx_server.get_system_fingerprint()
    httpd = server_class(
        address, lambda *a, **k: Handler(generator, *a, system_fingerprint=fingerprint, **k)
    )
    logging.warning(
        "mlx_lm.server is not recommended for production as it only implements basic "
        "security checks."
    )
    logging.info(f"Starting httpd at {host} on port {port}...")
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        httpd.shutdown()
        stop(generator, provider)


def serve(args: argparse.Namespace, aliases: tuple[str, ...] = ()) -> None:
    """What `mlx_lm.server.main` does after parsing (wired limit, logging), with our provider,
    generator, handler and server (`run`): mlx-lm's classes, composed, nothing of it replaced.

    Raises one of LOAD_ERRORS or LoadFailed, before binding the port, if the model cannot be
    loaded.
    """
    mlx_utils.maybe_set_recommended_wired_limit()
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), None),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    run(args.host, args.port, Provider(args, aliases))
