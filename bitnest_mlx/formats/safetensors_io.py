"""Reading JSON and safetensors files defensively, for every format: a broken file becomes one
error of the format's own type (passed in) naming the file and what was expected, never a
traceback from deep inside a parser or a load."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx


class FormatError(ValueError):
    """A file that breaks its format's rules (base of PackageError and BundleError).

    The message is one line, which the faces print as it is: whatever it quotes from a broken
    file (a key with a newline in it, a parser's own multi-line text) is joined with spaces.
    """

    def __init__(self, message: object = "") -> None:
        super().__init__(" ".join(str(message).splitlines()))


# Tokenizer files transformers parses as JSON objects, and the text files it reads; each is
# checked by `check_tokenizer_files` before mlx-lm's load_tokenizer sees it.
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "added_tokens.json",
    "vocab.json",
    "chat_template.json",
)
TOKENIZER_TEXT = ("chat_template.jinja", "merges.txt")


def read_text(f: Path, error: type[Exception]) -> str:
    """A UTF-8 text file, else `error` naming it."""
    try:
        return f.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{f}: unreadable text ({type(e).__name__}: {e}); expected UTF-8") from e


def read_json(f: Path, error: type[Exception]) -> dict:
    """The one reader of the JSON files we parse: a UTF-8 file holding a JSON object, else
    `error` with one line naming the file (unreadable, not UTF-8, not JSON, not an object)."""
    try:
        data = json.loads(read_text(f, error))
    except json.JSONDecodeError as e:
        raise error(f"{f}: unreadable JSON ({e})") from e
    if not isinstance(data, dict):
        raise error(f"{f}: expected a JSON object, found {type(data).__name__}")
    return data


def check_tokenizer_files(path: Path, error: type[Exception]) -> None:
    """The tokenizer files of a directory that exist: JSON objects, UTF-8 text, and chat
    templates that compile, so that a corrupted one is named in our one line instead of failing
    inside transformers or at the first chat prompt."""
    templates: list[tuple[Path, object]] = []
    for name in TOKENIZER_JSON:
        if (path / name).is_file():
            doc = read_json(path / name, error)
            if name in ("tokenizer_config.json", "chat_template.json"):
                templates.append((path / name, doc.get("chat_template")))
    for name in TOKENIZER_TEXT:
        if (path / name).is_file():
            text = read_text(path / name, error)
            if name.endswith(".jinja"):
                templates.append((path / name, text))
    for f, template in templates:
        _check_template(f, template, error)


def _check_template(f: Path, template: object, error: type[Exception]) -> None:
    """None, a template string, or transformers' list of {"name", "template"}; each compiles."""
    if template is None:
        return
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in template
    ):
        for t in template:
            _check_template(f, t.get("template"), error)
        return
    if not isinstance(template, str):
        raise error(
            f"{f}: chat_template is a {type(template).__name__}, expected a string or a list of "
            '{"name", "template"} objects'
        )
    import jinja2

    try:  # compiled as transformers will (its extensions: loop controls, generation blocks)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # without transformers there is no tokenizer to load either
        return
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise error(f"{f}: chat template does not compile (line {e.lineno}: {e.message})") from e


# Bytes per element of every dtype a safetensors header may name that a reader here can size
# (the sub-byte float types are left out: no format of ours stores them).
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file as its header frames it; `begin`/`end` are absolute
    offsets in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"key {twice!r} appears twice")
    return dict(pairs)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(f: Path, error: type[Exception]) -> dict[str, TensorSpan]:
    """The tensors of a safetensors file, after checking its framing the way the `safetensors`
    library does (mx.load does not: a header one byte short loads every tensor shifted).

    Rules: an 8-byte little-endian header length n with 8 + n within the file; the header a UTF-8
    JSON object without repeated keys; `__metadata__`, if present, null or an object of strings;
    every other entry an object with a known `dtype`, a `shape` of non-negative integers and
    `data_offsets` [begin, end] with end - begin = itemsize x prod(shape); sorted by offset, the
    tensors tile the data section exactly: the first begins at 0, each begins where the previous
    ends, the last ends at the end of the file. Only the header is read. A refusal is `error`
    with one line naming the file, the tensor (when one is at fault) and the rule.
    """

    def fail(what: str) -> Exception:
        return error(" ".join(f"{f}: {what}".splitlines()))

    header, n, size = _header_object(f, fail)
    spans = {name: _span(name, entry, n, fail) for name, entry in header.items()}
    _check_tiling(spans, n, size, fail)
    return spans


def _header_object(f: Path, fail: Callable[[str], Exception]) -> tuple[dict, int, int]:
    """The header's tensor entries (`__metadata__` checked and removed), the header's length
    and the file's size."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            text = fh.read(n) if 0 <= n <= size - 8 else b""
    except OSError as e:
        raise fail(f"unreadable safetensors file ({e})") from e
    if n < 0:
        raise fail(f"truncated safetensors file ({size} bytes; expected an 8-byte header length)")
    if n > size - 8:
        raise fail(
            f"truncated safetensors file: header says {n} bytes, file has {size} (safetensors "
            "framing: the header must lie within the file)"
        )
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, a repeated key
        raise fail(
            f"unreadable safetensors header ({type(e).__name__}: {e}); safetensors framing: "
            "expected UTF-8 JSON without repeated keys"
        ) from e
    if not isinstance(header, dict):
        raise fail(
            f"unreadable safetensors header: a JSON {type(header).__name__}; safetensors "
            "framing: expected an object (tensor name -> dtype, shape, data_offsets)"
        )
    meta = header.pop("__metadata__", None)  # mx.save_safetensors writes null without metadata
    if not (
        meta is None or isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise fail("safetensors framing: __metadata__ is not null or an object of strings")
    return header, n, size


def _span(name: str, entry, n: int, fail: Callable[[str], Exception]) -> TensorSpan:
    """One header entry's dtype, shape and place in the file (the header being n bytes)."""
    where = f"tensor {name}: safetensors framing:"
    if not isinstance(entry, dict):
        raise fail(f"{where} entry is {entry!r}, expected an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise fail(f"{where} dtype {dtype!r}, expected one of {', '.join(DTYPE_SIZES)}")
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise fail(f"{where} shape {shape!r}, expected a list of non-negative integers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise fail(
            f"{where} data_offsets {offsets!r}, expected [begin, end] with 0 <= begin <= end"
        )
    need = DTYPE_SIZES[dtype] * math.prod(shape)
    if offsets[1] - offsets[0] != need:
        raise fail(
            f"{where} data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, "
            f"expected {need} ({dtype} {shape})"
        )
    return TensorSpan(dtype, tuple(shape), 8 + n + offsets[0], 8 + n + offsets[1])


def _check_tiling(
    spans: dict[str, TensorSpan], n: int, size: int, fail: Callable[[str], Exception]
) -> None:
    """Sorted by offset, the tensors tile the data section: no gap, overlap or trailing bytes."""
    at = 8 + n  # where the next tensor must begin: the data section is tiled exactly
    for name, span in sorted(spans.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if span.begin != at:
            gap = "a gap" if span.begin > at else "an overlap"
            raise fail(
                f"tensor {name}: safetensors framing: data_offsets begin at "
                f"{span.begin - 8 - n}, expected {at - 8 - n} ({gap}: the offsets must "
                "tile the data section)"
            )
        at = span.end
    if at > size:
        raise fail(f"truncated safetensors file: its tensors need {at} bytes, file has {size}")
    if at < size:
        raise fail(
            f"safetensors framing: {size - at} trailing bytes after the last tensor (it ends at "
            f"byte {at} of {size}; expected the data section to end with the last tensor)"
        )


def check_safetensors(f: Path, error: type[Exception]) -> None:
    """The strict framing of `read_header`, before a file's tensors are used."""
    read_header(f, error)


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
