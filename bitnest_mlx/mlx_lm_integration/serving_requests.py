"""bitnest-server's request handler: mlx-lm's APIHandler with stricter checks, OpenAI-shaped
errors and clients that may go away at any time.

* A bad request gets a 4xx and OpenAI's error body `{"error": {"message", "type", "param",
  "code"}}`, mlx-lm's own refusals included (its bodies are reshaped as they are written):
  what mlx-lm refuses, plus non-finite numbers, ids outside the vocabulary, a malformed `stop` /
  `stream_options` / `messages`, an empty prompt, images for a text model, a model other than
  the served one.
* A response names the served model (mlx-lm echoes the request's `model`, "default_model" when
  it has none).
* A client that goes away, streamed or not, is one log line, and its generation stops at the
  next token: the socket is checked for a hang-up before each token is taken.
"""

from __future__ import annotations

import json
import logging
import math
import re
import select
import socket
import sys
from typing import Any

import mlx_lm.server as mlx_server

from ..cli.args import one_line

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
# mlx-lm names some request fields by its attribute ("requested_model must be of type str").
_FIELDS = {
    "requested_model": "model",
    "requested_draft_model": "draft_model",
    "adapter": "adapters",
}


class RequestError(ValueError):
    """A request the server refuses: answered with `status` and OpenAI's error body."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error object; `param` is guessed from mlx-lm's "<field> must ..." wording."""
    if param is None and (m := re.match(r"(\w+) must ", message)):
        param = _FIELDS.get(m.group(1), m.group(1))
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _ErrorShaping:
    """The handler's wfile: an error status's body, as mlx-lm writes it (`{"error": "..."}` or
    plain text, in one write), becomes OpenAI's error object. Everything else passes."""

    def __init__(self, handler: Handler, raw: Any):
        self._handler, self._raw = handler, raw

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def write(self, data: bytes) -> int:
        h = self._handler
        if h._status >= 400 and h._headers_sent and not h._error_written:
            h._error_written = True
            try:
                body = json.loads(data)
            except ValueError:
                body = {"error": data.decode(errors="replace").strip()}
            if isinstance(body, dict) and isinstance(body.get("error"), str):
                # mlx-lm writes inside its `except`: our own refusal still says its field.
                e = sys.exc_info()[1]
                param, code = (e.param, e.code) if isinstance(e, RequestError) else (None, None)
                data = json.dumps(error_body(h._status, body["error"], param, code)).encode()
        return self._raw.write(data)


class _Watched:
    """The shared generator as one handler sees it: each token is taken only while the client is
    still connected; otherwise the request is stopped and the handler ends (a disconnect)."""

    def __init__(self, generator: Any, gone: Any):
        self._generator, self._gone = generator, gone

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def generate(self, request: Any, args: Any, progress_callback: Any = None) -> tuple:
        ctx, responses = self._generator.generate(request, args, progress_callback)
        return ctx, self._watch(ctx, responses)

    def _watch(self, ctx: Any, responses: Any):
        for response in responses:
            if self._gone():
                ctx.stop()  # the generation thread drops it at its next token
                raise ConnectionAbortedError("the client closed the connection")
            yield response


class Handler(mlx_server.APIHandler):
    """mlx-lm's request handler with the module's refusals, error shape and disconnects."""

    timeout = 300  # seconds a client may stay silent (a request never sent, a stream not read)
    _headers_sent = False
    _status = 200
    _error_written = False

    def setup(self) -> None:
        super().setup()
        self.wfile = _ErrorShaping(self, self.wfile)

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def end_headers(self) -> None:
        super().end_headers()
        self._headers_sent = True  # after: the headers themselves are written by end_headers

    def handle(self) -> None:
        try:
            super().handle()
        except DISCONNECTS as e:
            self.close_connection = True
            logging.info("client %s went away (%s)", self.client_address[0], type(e).__name__)

    def client_gone(self) -> bool:
        """Whether the client hung up (its end of the socket reads as closed)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def handle_completion(self, request: Any, stop_words: list[str]) -> None:
        shared = self.response_generator
        self.response_generator = _Watched(shared, self.client_gone)
        try:
            super().handle_completion(request, stop_words)
        finally:
            self.response_generator = shared

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
        self._error_written = True  # already in its final shape
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
            return self._send_json(status, error_body(status, f"invalid Content-Length {length}"))
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
        param, code = (e.param, e.code) if isinstance(e, RequestError) else (None, None)
        if not self._headers_sent:
            self._headers_buffer = []  # http.server's: drop a status line mlx-lm buffered
            status = 400 if isinstance(e, (UnicodeDecodeError, RequestError)) else 500
            status = e.status if isinstance(e, RequestError) else status
            logging.error("request refused (%d): %s", status, message)
            return self._send_json(status, error_body(status, message, param, code))
        logging.error("request failed after its response began: %s", message)
        if getattr(self, "stream", False):
            event = json.dumps(error_body(500, message, param, code))
            self.wfile.write(f"data: {event}\n\n".encode())

    def validate_model_parameters(self) -> None:
        super().validate_model_parameters()
        provider = self.response_generator.model_provider
        if self.requested_model != "default_model" and self.requested_model not in provider.aliases:
            raise RequestError(
                f"model {self.requested_model!r} is not served here; "
                f"this server serves {provider.model_id!r}",
                404,
                param="model",
                code="model_not_found",
            )
        # Every accepted request names the served id: in its response, and as the batch's key
        # (mlx-lm batches only requests whose model descriptions are equal).
        self.requested_model = provider.model_id
        if self.requested_draft_model not in ("default_model", provider.cli_args.draft_model):
            raise RequestError(
                "draft_model is fixed when the server starts (--draft-model / --target-only)",
                param="draft_model",
            )
        if self.adapter is not None:
            raise RequestError("adapters are not supported by this server", param="adapters")
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
                raise RequestError(
                    f"logit_bias token id {token} is outside [0, {vocab})", param="logit_bias"
                )
            if not math.isfinite(bias):
                raise RequestError(
                    f"logit_bias for token {token} must be a finite number", param="logit_bias"
                )

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
                raise RequestError(
                    "stream_options.include_usage must be a boolean", param="stream_options"
                )
            self.stream_options = {**options, "include_usage": usage}

    def _validate_prompt(self, provider: Any) -> None:
        if self.path == "/v1/completions":
            prompt = self.body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string")
            if not prompt:
                raise RequestError("prompt must not be empty")
            return
        messages = self.body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(
                    "each message must be an object with a string role", param="messages"
                )
            content = m.get("content")
            if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
                raise RequestError("message content parts must be objects", param="messages")
            if not (content is None or isinstance(content, (str, list))):
                raise RequestError(
                    "message content must be a string or a list of parts", param="messages"
                )
        if provider.processor is None and any(mlx_server._image_parts(messages)):
            raise RequestError("this model takes no images", param="messages")

    def handle_models_request(self) -> None:
        """The served model (mlx-lm scans the Hugging Face cache, which need not exist, and
        lists models this server would not serve)."""
        provider = self.response_generator.model_provider
        wanted = "/".join(p for p in self.path.split("?")[0].split("/")[3:] if p)
        entry = {"id": provider.model_id, "object": "model", "created": self.created}
        served = not wanted or wanted in provider.aliases
        self._send_json(200, {"object": "list", "data": [entry] if served else []})
