"""What the commands share about their arguments: argparse `type=` validators that name the bound,
and a parser whose refusals are one line.

A value out of range is refused before anything is loaded: exit status 2 and one line on stderr,
`error: argument --top-p: must be in (0, 1], got 1.5`, with no usage block and no traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends every option taking a value with its default, unless the text already
    says it: `(default: 0.8)`, `(default: none)`. Flags (on when given) and required options
    need none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.required
            or action.nargs == 0  # store_true / store_false / help / version
            or action.default is argparse.SUPPRESS
            or "default" in text.lower()
        ):
            return text
        shown = "none" if action.default in (None, [], {}) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `error: <what>`, with exit status 2, and
    whose help gives every default (`DefaultsFormatter`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # argparse's hook for every refusal it makes
        self.exit(2, f"error: {one_line(message)}\n")


def one_line(message: object) -> str:
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def refuse(message: object) -> int:
    """Print `error: <message>` as one line on stderr; the exit status of a refusal (2)."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    return 2


def _parse(kind: type, text: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bounded(
    kind: type, low: float, high: float | None, low_open: bool, high_open: bool
) -> Callable[[str], int | float]:
    if high is None:
        rule = f"must be {'>' if low_open else '>='} {low:g}"
    else:
        rule = f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(text: str) -> int | float:
        value = _parse(kind, text)
        below = value <= low if low_open else value < low
        above = high is not None and (value >= high if high_open else value > high)
        if below or above:
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    check.__name__ = kind.__name__  # argparse names the type in some of its own messages
    return check


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= low."""
    return _bounded(int, low, None, False, False)


def float_at_least(low: float) -> Callable[[str], float]:
    """A finite number >= low."""
    return _bounded(float, low, None, False, False)


def float_in(
    low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> Callable[[str], float]:
    """A finite number in [low, high], either end open on request."""
    return _bounded(float, low, high, low_open, high_open)


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
non_negative_float = float_at_least(0.0)
probability = float_in(0.0, 1.0, low_open=True)  # (0, 1]: top-p
fraction = float_in(0.0, 1.0, high_open=True)  # [0, 1): min-p


def non_empty(text: str) -> str:
    """A string with at least one character (whitespace counts)."""
    if text == "":
        raise argparse.ArgumentTypeError("must not be empty")
    return text


non_empty.__name__ = "str"


def draft_kv(text: str) -> int | str:
    """--draft-kv: 4, 8 or auto."""
    if text in ("4", "8"):
        return int(text)
    if text == "auto":
        return text
    raise argparse.ArgumentTypeError(f"must be 4, 8 or auto, got {text!r}")


draft_kv.__name__ = "str"


def add_verify(p: argparse.ArgumentParser) -> None:
    """The --verify flag, the same on every command that loads a model."""
    p.add_argument(
        "--verify",
        action="store_true",
        help="before loading, hash every file against the sha256 checksums its writer recorded "
        "and refuse the first that differs (as bitnest-verify; reads all the data once)",
    )


def add_draft_kv(p: argparse.ArgumentParser) -> None:
    """The --draft-kv flag, the same on every command that runs the draft."""
    p.add_argument(
        "--draft-kv",
        type=draft_kv,
        default="auto",
        metavar="{4,8,auto}",
        help="KV the draft reads: 4 (KV4, the hi plane), 8 (KV8, both planes, as the target) or "
        "auto (KV8 while it adds at most 10%% to the draft's bytes per token, by context "
        "length; default %(default)s). The target always reads KV8.",
    )


def add_draft_source(p: argparse.ArgumentParser) -> None:
    """--draft-source and --ngram-tokens, the same on every command that speculates."""
    from ..runtime.draft_control import DRAFT_SOURCES

    p.add_argument(
        "--draft-source",
        choices=DRAFT_SOURCES,
        default="auto",
        help="what proposes the drafts: model (the W4 draft's chain), ngram (copies of the text "
        "that followed the longest earlier match of the prompt and output so far; costs no "
        "draft step), auto (each round the plan with the most expected tokens per cost: a "
        "chain, a copy, or a copy extended by the W4 draft; default) or none (target-only)",
    )
    p.add_argument(
        "--ngram-tokens",
        type=positive_int,
        default=8,
        help="most tokens an n-gram copy drafts in a round (>= 1; default %(default)s)",
    )


def add_draft_vocab_join(p: argparse.ArgumentParser) -> None:
    """--draft-vocab-join, the same on every command that speculates (the server keeps the
    API's default)."""
    p.add_argument(
        "--draft-vocab-join",
        choices=("on", "off"),
        default="on",
        help="on: a package's reduced draft vocabulary also scores the token ids of the prompt "
        "and of the text so far (their lm_head rows gathered once per generation; the output "
        "is the same either way); default %(default)s",
    )


MODES = ("speculative", "target", "draft")


def add_mode(p: argparse.ArgumentParser) -> None:
    """--mode, the same on every command that decodes; its default follows the hardware."""
    p.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="speculative = the W4 draft (or an n-gram copy) proposes, the W8 target verifies, "
        "lossless; target = W8 weights + KV8 reads; draft = W4 weights, KV per --draft-kv "
        "(default: speculative on a GPU; target on a CPU device, where verification is "
        "compute-bound and speculation cannot pay)",
    )


def default_mode(chosen: str | None, speculates: bool, device: object = None) -> tuple[str, str]:
    """The mode to run and why, when it was not chosen: speculation pays only where a target
    pass over several rows costs about one row's time, a bandwidth-bound GPU
    (docs/speculative.md, "When it pays"). A model that cannot speculate runs its target.

    Returns (mode, note); the note is empty when the user chose or nothing needs saying."""
    if chosen is not None:
        return chosen, ""
    if not speculates:
        return "target", ""
    import mlx.core as mx

    device = device or mx.default_device()
    if device.type == mx.DeviceType.gpu:
        return "speculative", ""
    return "target", (
        f"[mode] target-only: on a CPU device ({device}) verifying a draft costs about as much "
        "as generating it, so speculation cannot pay; --mode speculative forces it"
    )


def str_to_bool(text: str) -> bool:
    """true/false (as mlx-lm's `str2bool`: t, true, 1, yes / f, false, 0, no; any case)."""
    low = text.lower()
    if low in ("t", "true", "1", "yes", "y"):
        return True
    if low in ("f", "false", "0", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


str_to_bool.__name__ = "bool"


def json_object(text: str) -> dict:
    """A JSON object, e.g. '{"enable_thinking": false}'."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


json_object.__name__ = "JSON"


def add_chat_template_config(p: argparse.ArgumentParser) -> None:
    """--chat-template-config, as mlx-lm's: more arguments for the chat template."""
    p.add_argument(
        "--chat-template-config",
        type=json_object,
        default={},
        metavar="JSON",
        help='a JSON object of extra chat-template arguments, e.g. \'{"enable_thinking": '
        "false}' (as mlx_lm.generate; default: none)",
    )


def add_sampling(p: argparse.ArgumentParser, temp: float) -> None:
    """--temp, --top-p, --top-k, --min-p and --seed, the same on every command that samples;
    `temp` is the command's default temperature."""
    p.add_argument(
        "--temp",
        type=non_negative_float,
        default=temp,
        help="sampling temperature (>= 0; 0 = greedy; default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=probability,
        default=1.0,
        help="nucleus sampling threshold, in (0, 1] (1 = off)",
    )
    p.add_argument(
        "--top-k", type=non_negative_int, default=0, help="top-k sampling (>= 0; 0 = off)"
    )
    p.add_argument(
        "--min-p", type=fraction, default=0.0, help="min-p sampling, in [0, 1) (0 = off)"
    )
    p.add_argument(
        "--seed", type=non_negative_int, default=0, help="random seed, >= 0 (default: %(default)s)"
    )
