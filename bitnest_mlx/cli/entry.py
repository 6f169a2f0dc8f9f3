"""How every command starts and ends, whichever way it is run (`python -m bitnest_mlx.<name>`,
`python -m bitnest_mlx <name> ARGS...`, the console script `bitnest-<name>`).

This module imports nothing heavy: the command's own module (mlx, mlx-lm, transformers) is
imported inside `run`, so a Ctrl-C during those imports ends the same way as one during the
work: one line on stderr and exit status 130, never a traceback. A reader that closes stdout
early (`| head -1`) ends the command quietly with status 0.
"""

from __future__ import annotations

import importlib
import os
import sys

from . import COMMANDS

INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a process Ctrl-C stopped


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; pointing the descriptor at /dev/null keeps that
    # second write from raising a BrokenPipeError of its own.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no descriptor (a test's capture)
        pass


def run(name: str, argv: list[str] | None = None) -> int:
    """Import `bitnest_mlx.cli.<name>` and return its `main(argv)`'s exit status."""
    try:
        main = importlib.import_module(f"{__package__}.{name}").main
        status = main(argv)
        sys.stdout.flush()
        return status
    except KeyboardInterrupt:
        print(f"bitnest-{name}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return 0


def dispatch(argv: list[str]) -> str | int:
    """`python -m bitnest_mlx CMD ARGS...`: the module CMD runs as (`bitnest_mlx.CMD`, which the
    caller executes with ARGS, exactly as `python -m bitnest_mlx.CMD ARGS` would run), or the
    exit status when there is nothing to run: no command lists them, an unknown one is refused."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "bitnest-mlx commands (python -m bitnest_mlx <name> ARGS, python -m "
            "bitnest_mlx.<name> or bitnest-<name>; --help on each):"
        )
        for name, what in COMMANDS.items():
            print(f"  {name:<9} {what}")
        return 0
    if argv[0] not in COMMANDS:
        print(
            f"error: unknown command {argv[0]!r}; one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        return 2
    return f"bitnest_mlx.{argv[0]}"


def _script(name: str):
    def main(argv: list[str] | None = None) -> int:
        return run(name, argv)

    main.__doc__ = f"The console script bitnest-{name}: {COMMANDS[name]}."
    return main


# The console scripts (setup.py): one per command.
generate = _script("generate")
chat = _script("chat")
convert = _script("convert")
eval = _script("eval")  # noqa: A001 (the command's name)
bench = _script("bench")
server = _script("server")
upload = _script("upload")
verify = _script("verify")
doctor = _script("doctor")
