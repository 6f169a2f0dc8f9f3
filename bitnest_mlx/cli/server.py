"""`python -m bitnest_mlx.server` (`bitnest-server`): mlx-lm's OpenAI server with self-speculation.

The same server as `python -m mlx_lm server` (all its flags; see docs/server.md), plus:

* `--model` also takes a Hub id `org/repo[@revision]`, fetched with bitnest_mlx.hub (only the
  files the format needs, one-line errors), or `demo`, the demo package shipped with bitnest_mlx
  (clients may then name the model "demo");
* for a bitnest package, `--draft-model` defaults to `MODEL#draft`: the draft reading of the
  same weights, decoded with bitnest's shared-cache self-speculative loop (`--target-only`
  turns it off; `--num-draft-tokens` is the maximum draft length);
* the model is loaded and validated before the port is bound: a broken package, bundle or Hub id
  is one line `error: ...` on stderr and exit status 2, with nothing listening; `--verify` also
  checks every file against the checksums its writer recorded first (as `bitnest-verify`);
* one startup line (model, format, mode, speculation, kernels, context), `/v1/models` without a
  Hugging Face cache, quiet client disconnects, and a 4xx JSON error for a bad request
  (`bitnest_mlx.cli.serving`).

mlx-lm builds its parser inside `mlx_lm.server.main`, so there is no parser to extend: ours
declares the same flags (names, types, defaults; tests/test_mlx_lm_seams.py compares them with the
installed mlx-lm's) and hands the namespace to mlx-lm's classes (`serving.serve`).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..demo import resolve_model
from ..hub import HubError, resolve
from ..loader import LOAD_ERRORS, supports_draft, verify_path
from ..mlx_lm_plugin import DRAFT_SUFFIX, register
from .args import add_draft_source, refuse

OURS = ("target_only", "verify", "draft_source", "ngram_tokens")  # not mlx-lm server flags


def build_parser() -> argparse.ArgumentParser:
    """mlx-lm server's flags, then ours."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
    from mlx_lm.utils import _parse_size

    p = argparse.ArgumentParser(
        prog="bitnest-server",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    a = p.add_argument
    a("--model", help="a bitnest package, a DSV4 bundle, a Hub id org/repo[@revision], or demo")
    a("--adapter-path", help="adapter weights (an mlx-lm model only)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8080)
    a("--allowed-origins", type=lambda x: x.split(","), default="*")
    a("--draft-model", default=None, help="default for a bitnest package: MODEL#draft")
    a("--num-draft-tokens", type=int, default=3, help="the maximum draft length")
    add_draft_source(p)
    a("--trust-remote-code", action="store_true")
    levels = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    a("--log-level", default="INFO", choices=levels)
    a("--chat-template", default="")
    a("--use-default-chat-template", action="store_true")
    a("--temp", type=float, default=0.0)
    a("--top-p", type=float, default=1.0)
    a("--top-k", type=int, default=0)
    a("--min-p", type=float, default=0.0)
    a("--max-tokens", type=int, default=512)
    a("--chat-template-args", type=json.loads, default="{}")
    a("--decode-concurrency", type=int, default=32)
    a("--prompt-concurrency", type=int, default=8)
    a("--prefill-step-size", type=int, default=2048)
    a("--prompt-cache-size", type=int, default=10)
    a("--prompt-cache-bytes", type=_parse_size)
    a("--kv-bits", type=int, default=None)
    a("--kv-group-size", type=int, default=64)
    a("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START)
    a("--pipeline", action="store_true")
    a("--target-only", action="store_true", help="serve the W8 target without speculation")
    a("--verify", action="store_true", help="check the files' checksums before loading")
    return p


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --model resolved (Hub id, demo -> a local path) and --draft-model defaulted
    to MODEL#draft for a bitnest package; checksums verified first with --verify."""
    if args.model is None:
        raise HubError("--model is required (a bitnest package, a DSV4 bundle, a Hub id, or demo)")
    model = str(resolve(resolve_model(args.model)))
    if args.verify:  # before the port opens, like every other load error
        verify_path(model)
    draft = args.draft_model
    if draft is None and not args.target_only and supports_draft(model):
        draft = model + DRAFT_SUFFIX
    return argparse.Namespace(**{**vars(args), "model": model, "draft_model": draft})


def main(argv: list[str] | None = None) -> int:
    given = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args = resolved(given)
    except LOAD_ERRORS as e:
        return refuse(e)
    register()
    from . import serving

    try:
        serving.serve(args, aliases=(given.model,))
    except (*LOAD_ERRORS, serving.LoadFailed) as e:
        return refuse(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
