"""`python -m bitnest_mlx.server` (`bitnest-server`): mlx-lm's OpenAI server with self-speculation.

The same server as `python -m mlx_lm server` (all its flags; see docs/server.md), plus:

* `--model` also takes a Hub id `org/repo[@revision]`, fetched with bitnest_mlx.hub (only the
  files the format needs, one-line errors), or `demo`, the demo package shipped with bitnest_mlx
  (clients may then name the model "demo");
* concurrent requests are decoded together, in target mode, by mlx-lm's BatchGenerator over
  a batched nested KV cache;
* for a bitnest package on a GPU, `--draft-model` defaults to `MODEL#draft`: the draft reading
  of the same weights, which decodes a lone request with bitnest's shared-cache self-speculative
  loop (`--mode target` / `--target-only` turn it off, `--mode speculative` forces it on a CPU
  device, where it is off by default with one log line; `--num-draft-tokens` is the maximum
  draft length);
* `--kv-bits` and `--pipeline` are refused for our formats, with one line;
* the model is loaded and validated before the port is bound: a broken package, bundle or Hub id
  is one line `error: ...` on stderr and exit status 2, with nothing listening; `--verify` also
  checks every file against the checksums its writer recorded first (as `bitnest-verify`);
* one startup line (model, format, mode, speculation, kernels, context), `/v1/models` without a
  Hugging Face cache, quiet client disconnects, and a 4xx OpenAI-shaped error for a bad request
  (`bitnest_mlx.mlx_lm_integration.serving`).

mlx-lm builds its parser inside `mlx_lm.server.main`, so there is no parser to extend: ours
declares the same flags (names, types, defaults; tests/test_mlx_lm_seams.py compares them with the
installed mlx-lm's) and hands the namespace to mlx-lm's classes (`serving.serve`).
"""

from __future__ import annotations

import argparse
import json
import sys

from ..formats import detect
from ..hub import HubError, resolve
from ..mlx_lm_integration.plugin import DRAFT_SUFFIX, register
from ..runtime.demo import resolve_model
from ..runtime.loader import LOAD_ERRORS, supports_draft, verify_path
from .args import add_draft_source, default_mode, refuse

OURS = ("target_only", "verify", "draft_source", "ngram_tokens", "mode")  # not mlx-lm's flags


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default at the end of its help, unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """mlx-lm server's flags (same names, types and defaults), then ours; every flag has a
    help line, and argparse adds each one's default."""
    from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START
    from mlx_lm.utils import _parse_size

    p = argparse.ArgumentParser(
        prog="bitnest-server",
        description=__doc__.split("\n\n")[0],
        formatter_class=_Help,
    )
    a = p.add_argument
    a("--model", help="a bitnest package, a DSV4 bundle, a Hub id org/repo[@revision], or demo")
    a("--adapter-path", help="adapter weights and config (an mlx-lm model only)")
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8080, help="port to listen on")
    a(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default="*",
        help="comma-separated origins for CORS (Access-Control-Allow-Origin)",
    )
    a("--draft-model", default=None, help="model that drafts; for a bitnest package: MODEL#draft")
    a("--num-draft-tokens", type=int, default=3, help="the maximum draft length")
    add_draft_source(p)
    a("--trust-remote-code", action="store_true", help="let the tokenizer run its own code")
    levels = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    a("--log-level", default="INFO", choices=levels, help="logging level (stderr)")
    a("--chat-template", default="", help="a chat template replacing the tokenizer's")
    a(
        "--use-default-chat-template",
        action="store_true",
        help="use the tokenizer's default chat template when it has none",
    )
    sampling(a)
    a(
        "--chat-template-args",
        type=json.loads,
        default="{}",
        help="JSON arguments for apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    batching(a)
    a("--prompt-cache-size", type=int, default=10, help="most conversations' KV caches kept")
    a(
        "--prompt-cache-bytes",
        type=_parse_size,
        help="most bytes of KV caches kept (e.g. 2GB; default: no limit)",
    )
    kv_and_distribution(a, DEFAULT_QUANTIZED_KV_START)
    a(
        "--mode",
        choices=("speculative", "target"),
        default=None,
        help="speculative: a lone request is drafted by the W4 reading and verified by the W8 "
        "target, concurrent ones are batched in target mode; target: no speculation (default: "
        "speculative on a GPU, target on a CPU device, where speculation cannot pay)",
    )
    a("--target-only", action="store_true", help="the same as --mode target")
    a("--verify", action="store_true", help="check the files' checksums before loading")
    return p


def sampling(a) -> None:
    """The sampling defaults of requests that do not set their own."""
    a("--temp", type=float, default=0.0, help="default sampling temperature (0: greedy)")
    a("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (1: off)")
    a("--top-k", type=int, default=0, help="default top-k sampling (0: off)")
    a("--min-p", type=float, default=0.0, help="default min-p sampling (0: off)")
    a("--max-tokens", type=int, default=512, help="default most tokens to generate")


def batching(a) -> None:
    """How many requests are decoded and prefilled together (mlx-lm's BatchGenerator)."""
    a("--decode-concurrency", type=int, default=32, help="most requests decoded together")
    a("--prompt-concurrency", type=int, default=8, help="most prompts prefilled together")
    a("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill step")


def kv_and_distribution(a, quantized_kv_start: int) -> None:
    """mlx-lm's KV quantization and distributed flags (refused for our formats: `refusal`)."""
    a(
        "--kv-bits",
        type=int,
        default=None,
        help="quantize an mlx-lm model's KV cache to this many bits (serves one request at a "
        "time); refused for a bitnest package or DSV4 bundle, whose KV is quantized already "
        "(default: full precision)",
    )
    a("--kv-group-size", type=int, default=64, help="group size of --kv-bits quantization")
    a(
        "--quantized-kv-start",
        type=int,
        default=quantized_kv_start,
        help="position from which --kv-bits quantizes the KV cache",
    )
    a(
        "--pipeline",
        action="store_true",
        help="across machines (mlx.launch), split an mlx-lm model's layers into a pipeline "
        "instead of tensor parallelism; refused for our formats, which are not sharded",
    )


def refusal(args: argparse.Namespace) -> str | None:
    """Why a flag cannot apply to the resolved model, or None."""
    fmt = detect(args.model)
    if fmt is None:
        return None
    what = "a bitnest package" if fmt == "bitnest" else "a DSV4 bundle"
    if args.kv_bits is not None:
        return (
            f"--kv-bits: {what}'s KV cache is quantized already (nested KV4/KV8 or the "
            "bundle's own); drop the flag"
        )
    if args.pipeline:
        return f"--pipeline: {what} is not sharded across machines; drop the flag"
    return None


def resolved(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --model resolved (Hub id, demo -> a local path) and --draft-model defaulted
    to MODEL#draft for a bitnest package that speculates (--mode, default by device: the note
    in `mode_note`); checksums verified first with --verify."""
    if args.model is None:
        raise HubError("--model is required (a bitnest package, a DSV4 bundle, a Hub id, or demo)")
    model = str(resolve(resolve_model(args.model)))
    if args.verify:  # before the port opens, like every other load error
        verify_path(model)
    draft, note = args.draft_model, ""
    chosen = "target" if args.target_only else args.mode
    if draft is None and chosen != "target" and supports_draft(model):
        mode, note = default_mode(chosen, True)
        if mode == "speculative":
            draft = model + DRAFT_SUFFIX
    return argparse.Namespace(
        **{**vars(args), "model": model, "draft_model": draft, "mode_note": note}
    )


def main(argv: list[str] | None = None) -> int:
    given = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        args = resolved(given)
    except LOAD_ERRORS as e:
        return refuse(e)
    if why := refusal(args):
        return refuse(why)
    register()
    from ..mlx_lm_integration import serving

    try:
        serving.serve(args, aliases=(given.model,))
    except (*LOAD_ERRORS, serving.LoadFailed) as e:
        return refuse(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
