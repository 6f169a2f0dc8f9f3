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
"""

from __future__ import annotations

import argparse
import sys

from ..demo import resolve_model
from ..hub import HubError, resolve
from ..loader import LOAD_ERRORS, supports_draft, verify_path
from ..mlx_lm_plugin import DRAFT_SUFFIX, register
from .args import refuse


def server_argv(argv: list[str]) -> list[str]:
    """mlx-lm server arguments for ours: --model resolved, --draft-model defaulted."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--draft-model")
    p.add_argument("--target-only", action="store_true")
    p.add_argument("--verify", action="store_true")
    ours, rest = p.parse_known_args(argv)
    if ours.model is None:
        raise HubError("--model is required (a bitnest package, a DSV4 bundle, a Hub id, or demo)")
    model = str(resolve(resolve_model(ours.model)))
    if ours.verify:  # before the port opens, like every other load error
        verify_path(model)
    draft = ours.draft_model
    if draft is None and not ours.target_only and supports_draft(model):
        draft = model + DRAFT_SUFFIX
    return ["--model", model, *(["--draft-model", draft] if draft else []), *rest]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    aliases: tuple[str, ...] = ()
    if {"-h", "--help"} & set(argv):  # ours, then mlx-lm's own help
        print(__doc__.strip() + "\n\nbitnest flags: --target-only, --verify\n", flush=True)
        args = argv
    else:
        try:
            args = server_argv(argv)
        except LOAD_ERRORS as e:
            return refuse(e)
        aliases = (_given_model(argv),)
    register()
    from . import serving

    try:
        serving.main(args, aliases)
    except (*LOAD_ERRORS, serving.LoadFailed) as e:
        return refuse(e)
    return 0


def _given_model(argv: list[str]) -> str:
    """--model as the user wrote it (a Hub id, a relative path): clients may name it so."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    return p.parse_known_args(argv)[0].model


if __name__ == "__main__":
    sys.exit(main())
