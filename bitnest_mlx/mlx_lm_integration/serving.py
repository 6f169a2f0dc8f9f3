"""mlx-lm's OpenAI server (`mlx_lm.server`) as `bitnest-server` runs it: the same endpoints and
flags, with the failure modes of careless users, broken files and many clients closed.

* The model is loaded (by mlx-lm's ModelProvider, in the generation thread, as mlx-lm does) and
  validated before the port is bound; if it cannot be, `main` raises and nothing listens.
* One startup line: model, format, mode, speculation, kernels path, context.
* `GET /v1/models` lists the served model, with or without a Hugging Face cache.
* Concurrent requests are decoded together (mlx-lm's BatchGenerator); a lone one speculates
  when the server does (`serving_batch`).
* Bad requests, errors and disconnects: `serving_requests`.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import mlx.core as mx
import mlx_lm.server as mlx_server
import mlx_lm.utils as mlx_utils

from ..cli.args import one_line
from ..formats import detect
from ..runtime.loader import LOAD_ERRORS, uses_kernels
from .serving_batch import Generator, PromptCache
from .serving_requests import DISCONNECTS, Handler, RequestError
from .speculation import DraftView

__all__ = ["Generator", "Handler", "LoadFailed", "Provider", "RequestError", "serve"]


class LoadFailed(Exception):
    """The model could not be loaded for a reason other than one of LOAD_ERRORS."""


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
        if isinstance(self.draft_model, DraftView):  # what the shared-cache loop drafts with
            self.draft_model.draft_source = getattr(self.cli_args, "draft_source", "auto")
            self.draft_model.ngram_tokens = getattr(self.cli_args, "ngram_tokens", 8)
            # mlx-lm batches no model with a draft; ours batches in target mode what does not
            # speculate (serving_batch), over the caches' own `merge`.
            self.is_batchable = all(hasattr(c, "merge") for c in self.model.make_cache())
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
    generator = Generator(provider, PromptCache(provider.cli_args.prompt_cache_size))
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
    if getattr(provider.cli_args, "mode_note", ""):
        logging.info(provider.cli_args.mode_note)
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
