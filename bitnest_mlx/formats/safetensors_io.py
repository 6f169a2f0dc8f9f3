"""Reading JSON and safetensors files defensively, for every format: a broken file becomes one
error of the format's own type (passed in) naming the file and what was expected, never a
traceback from deep inside a parser or a load."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx


class FormatError(ValueError):
    """A file that breaks its format's rules (base of PackageError and BundleError).

    The message is one line, which the faces print as it is: whatever it quotes from a broken
    file (a key with a newline in it, a parser's own multi-line text) is joined with spaces.
    """

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).splitlines()))


def read_json(f: Path, error: type[Exception]) -> dict:
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{f}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise error(f"{f}: expected a JSON object, found {type(data).__name__}")
    return data


def check_safetensors(f: Path, error: type[Exception]) -> None:
    """Header sanity and size, so a truncated file is named instead of failing deep in a load."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise error(
                f"{f}: truncated safetensors file ({size} bytes; expected an 8-byte header length)"
            )
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise error(f"{f}: truncated safetensors file: header says {n} bytes, file has {size}")
        try:
            header = json.loads(fh.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, AttributeError, KeyError, TypeError, IndexError) as e:
            # ValueError covers JSONDecodeError and UnicodeDecodeError.
            raise error(
                f"{f}: unreadable safetensors header ({type(e).__name__}: {e}); expected a JSON "
                "object of tensors with data_offsets"
            ) from e
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise error(
            f"{f}: truncated safetensors file: its tensors need {need} bytes, file has {size}"
        )


def load_safetensors(f: Path, error: type[Exception]) -> dict[str, mx.array]:
    """All tensors of one file, after `check_safetensors`."""
    check_safetensors(f, error)
    try:
        return mx.load(str(f))
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise error(f"{f}: unreadable safetensors file ({e})") from e


def string_map(mapping: object, f: Path, key: str, error: type[Exception]) -> dict[str, str]:
    """`mapping` as a non-empty {str: str} (an index's weight_map), else `error`."""
    if (
        not isinstance(mapping, dict)
        or not mapping
        or not all(isinstance(v, str) for v in mapping.values())
    ):
        raise error(f"{f}: expected a non-empty {key!r} object (tensor name -> shard file)")
    return mapping
