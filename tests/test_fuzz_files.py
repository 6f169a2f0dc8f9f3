"""Seeded corruption of what frames and describes the data: safetensors framing, every JSON and
tokenizer file, and every DeepSeek-V4 config field (test_fuzz_formats.py breaks the data and
values; tests/fuzz_support.py holds the inputs and the judge).

The loads here do not verify checksums (`verify=False`, the default of `bitnest_mlx.load`): what
refuses these cases must be the rules themselves, which read no tensor data.

* framing-*: one safetensors file's header length, offsets or entries, or its bytes around the
  data, edited (the safetensors library refuses all of these; mx.load accepts many and loads
  shifted weights). Refused, or exactly the original logits.
* file-*: a JSON or template file made not UTF-8, not JSON, another top-level type, empty, cut,
  or (templates) not compiling, loaded with its tokenizer as `bitnest_mlx.load` does. The
  broken kinds must be refused naming the file; a cut one may still parse (refused or identical
  for JSON, refused or runs for a template).
* tokenizer-edit: a seeded key of a tokenizer file deleted or set to an odd value: our one-line
  error or a tokenizer that loads and encodes (an edit can be another valid tokenizer).
* config-*: each field of `dsv4_config.DSV4Config` (the one list of what the model reads) set to
  a wrong type, to a value just outside each of its bounds, or deleted, with the checksums
  stripped so that validation is what decides: wrong types and out-of-range values are refused
  naming config.json and the field; a deleted field is refused when it has no default, else
  loads its default and runs.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import MISSING
from pathlib import Path

import numpy as np
import pytest
import test_fuzz_formats
from fuzz_support import (
    build_sources,
    header,
    json_edit,
    judge,
    pick,
    strip_checksums,
    tensor_files,
    write_header,
)

from bitnest_mlx.formats import dsv4_config
from bitnest_mlx.formats.safetensors_io import DTYPE_SIZES

SEEDS = 10
FRAMING = (
    "framing-length",
    "framing-shift",
    "framing-overlap",
    "framing-gap",
    "framing-shifted-data",
    "framing-trailing",
    "framing-entry",
)
# What each source holds besides tensors: every file a load parses.
FILES = {
    "package": (
        "bitnest.json",
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ),
    "bundle": (
        "config.json",
        "model.safetensors.index.json",
        "jang_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
    ),
}
JSON_KINDS = ("not-utf8", "not-json", "top-type", "empty", "cut")
TEMPLATE_KINDS = ("not-utf8", "syntax", "cut")
BROKEN = {"not-utf8", "not-json", "top-type", "empty", "syntax"}  # refused, naming the file
TOKENIZER_JSON = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


# ---------------------------------------------------------------- framing edits


def _spans(f: Path) -> tuple[int, dict, list[str]]:
    """(header length, header, tensor names in data order)."""
    n, doc = header(f)
    names = sorted((k for k in doc if k != "__metadata__"), key=lambda k: doc[k]["data_offsets"])
    return n, doc, names


def _length(f: Path, rng: np.random.Generator) -> str:
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    k = int(rng.integers(1, 17)) * pick(rng, [-1, 1])
    data[:8] = (n + k).to_bytes(8, "little")
    f.write_bytes(bytes(data))
    return f"header length {n} -> {n + k}"


def _shift(f: Path, rng: np.random.Generator) -> str:
    _, doc, names = _spans(f)
    name = pick(rng, names)
    b, e = doc[name]["data_offsets"]
    k = int(rng.integers(1, 9)) * (1 if b == 0 else pick(rng, [-1, 1]))
    k = max(k, -b)
    doc[name]["data_offsets"] = [b + k, e + k]
    write_header(f, doc)
    return f"{name}: data_offsets [{b}, {e}] -> [{b + k}, {e + k}]"


def _overlap(f: Path, rng: np.random.Generator) -> str:
    _, doc, names = _spans(f)
    i = int(rng.integers(1, len(names)))  # not the first: it moves into its predecessor
    b0, e0 = doc[names[i - 1]]["data_offsets"]
    b, e = doc[names[i]]["data_offsets"]
    start = int(rng.integers(b0, max(e0, b0 + 1)))
    doc[names[i]]["data_offsets"] = [start, start + e - b]
    write_header(f, doc)
    return f"{names[i]} moved into {names[i - 1]}: [{b}, {e}] -> [{start}, {start + e - b}]"


def _insert(f: Path, rng: np.random.Generator, fix_offsets: bool) -> str:
    """k random bytes inserted before one tensor's data; with `fix_offsets` the later tensors'
    offsets follow them (a gap in the tiling), else they do not (every later tensor shifted)."""
    n, doc, names = _spans(f)
    i = int(rng.integers(len(names)))
    at = doc[names[i]]["data_offsets"][0]
    k = int(rng.integers(1, 33))
    if fix_offsets:
        for name in names[i:]:
            doc[name]["data_offsets"] = [o + k for o in doc[name]["data_offsets"]]
        write_header(f, doc)
        n, _ = header(f)
    data = f.read_bytes()
    f.write_bytes(data[: 8 + n + at] + rng.bytes(k) + data[8 + n + at :])
    return f"{k} bytes inserted before {names[i]}" + (" (offsets moved)" if fix_offsets else "")


def _trailing(f: Path, rng: np.random.Generator) -> str:
    k = int(rng.integers(1, 65))
    f.write_bytes(f.read_bytes() + rng.bytes(k))
    return f"{k} bytes appended"


def _entry(f: Path, rng: np.random.Generator) -> str:
    """One malformed header entry, or a malformed header."""
    _, doc, names = _spans(f)
    name = pick(rng, names)
    entry = doc[name]
    b, e = entry["data_offsets"]
    size = DTYPE_SIZES[entry["dtype"]]
    edits = [
        ("dtype", "F17"),
        ("dtype", ""),
        ("dtype", 4),
        ("dtype", "f32"),
        ("shape", [-1]),
        ("shape", [1.5]),
        ("shape", [True]),
        ("shape", "4"),
        ("shape", [*entry["shape"], 2]),
        ("data_offsets", [b]),
        ("data_offsets", [b, e, 0]),
        ("data_offsets", [str(b), str(e)]),
        ("data_offsets", [e, b] if e > b else [b + 1, b]),
        ("data_offsets", [b, e + size]),
        ("data_offsets", [b, e - size] if e - size >= b else [b, e + 1]),
        ("entry", []),
        ("entry", "x"),
        ("entry", None),
        ("metadata", {"format": 1}),
        ("metadata", ["mlx"]),
        ("duplicate", None),
        ("top", None),
    ]
    key, value = pick(rng, edits)
    if key == "entry":
        doc[name] = value
    elif key == "metadata":
        doc["__metadata__"] = value
    elif key in ("duplicate", "top"):
        text = json.dumps(doc, separators=(",", ":"))
        item = json.dumps({name: entry}, separators=(",", ":"))[1:-1]
        text = f"{text[:-1]},{item}}}" if key == "duplicate" else f"[{text}]"
        write_header(f, text)
        return f"header: {key} ({name})"
    else:
        entry[key] = value
    write_header(f, doc)
    return f"{name}: {key} = {value!r}"


FRAMING_EDITS = {
    "framing-length": _length,
    "framing-shift": _shift,
    "framing-overlap": _overlap,
    "framing-gap": lambda f, rng: _insert(f, rng, fix_offsets=True),
    "framing-shifted-data": lambda f, rng: _insert(f, rng, fix_offsets=False),
    "framing-trailing": _trailing,
    "framing-entry": _entry,
}


# ---------------------------------------------------------------- JSON and template files


def _break_file(f: Path, kind: str, rng: np.random.Generator) -> str:
    data = f.read_bytes()
    if kind == "not-utf8":
        at = int(rng.integers(len(data) + 1))
        f.write_bytes(data[:at] + b"\xff\xfe" + data[at:])
    elif kind == "not-json":
        f.write_bytes(b"{'single': 'quotes'}")
    elif kind == "top-type":
        f.write_text(json.dumps(pick(rng, [[], ["x"], "x", 1, 2.5, None, True])))
    elif kind == "empty":
        f.write_bytes(b"")
    elif kind == "syntax":
        f.write_text("{% for m in messages %}{{ m['content'] }")
    else:  # cut: anywhere but the very end
        at = int(rng.integers(max(len(data) - 1, 1)))
        f.write_bytes(data[:at])
        return f"{f.name}: cut at byte {at} of {len(data)}"
    return f"{f.name}: {kind}"


# ---------------------------------------------------------------- DSV4 config fields

_WRONG_TYPES = {
    int: ["8", 2.5, True, [1], {"v": 1}],
    float: ["1.0", True, [1.0], {"v": 1.0}, float("nan")],
    str: [1, True, ["x"], {"v": "x"}],
    bool: ["false", 0, [False]],
    list[int]: ["0,4", 4, [0.5], [None], {"0": 0}],
    dict | None: ["yarn", 1, [1], True],
}


def _out_of_range(f, config: dict) -> list[tuple[str, object]]:
    """(bound, a value just outside it) for every bound of field `f` in its metadata."""
    m, current = f.metadata, config.get(f.name, f.default)
    out = []
    if m["choices"]:
        bad = 3 if 3 not in m["choices"] else -7
        if isinstance(current, list):
            out.append(("choices", [bad, *current[1:]]))
        elif isinstance(current, bool):
            out.append(("choices", not current))
        else:
            out.append(("choices", f"{current}x" if isinstance(current, str) else bad))
    if m["gt"] is not None:
        out.append(("gt", m["gt"]))
    if isinstance(m["ge"], (int, float)):
        out.append(("ge", m["ge"] - 1))
    if isinstance(m["le"], int):
        out.append(("le", m["le"] + 1))
    if isinstance(m["le"], str):
        other = config.get(m["le"], _default(m["le"]))
        out.append((f"le-{m['le']}", other + 1))
    if m["even"]:
        out.append(("even", current + 1))
    if m["min_len"]:
        out.append(("min_len", current[: config[m["min_len"]] - 1]))
    if m["check"]:
        out.append(("check", {"rope_type": "bogus", "factor": 2.0}))
    return out


def _default(name: str) -> object:
    return next(f.default for f in dsv4_config.FIELDS if f.name == name)


def _config_cases(config: dict) -> list[tuple[str, str, object]]:
    """(field, kind, value) for every field: each wrong type, each bound, and missing."""
    cases = []
    for f in dsv4_config.FIELDS:
        for i, value in enumerate(_WRONG_TYPES[dsv4_config.TYPES[f.name]]):
            cases.append((f.name, f"type{i}", value))
        cases += [(f.name, f"range-{bound}", value) for bound, value in _out_of_range(f, config)]
        if f.name in config:
            cases.append((f.name, "missing", None))
    return cases


def _demo_config() -> dict:
    from bitnest_mlx.runtime.demo import TINY_CONFIG

    return dict(TINY_CONFIG)


CONFIG_CASES = _config_cases(_demo_config())

CASES = [(fmt, fam, s) for fmt in ("package", "bundle") for fam in FRAMING for s in range(SEEDS)]
FILE_CASES = [
    (fmt, name, kind)
    for fmt, names in FILES.items()
    for name in names
    for kind in (TEMPLATE_KINDS if name.endswith(".jinja") else JSON_KINDS)
]
TOKENIZER_CASES = [(fmt, s) for fmt in ("package", "bundle") for s in range(16)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray, list[int]]]:
    return build_sources(tmp_path_factory.mktemp("fuzz-files-sources"))


@pytest.mark.parametrize(
    "fmt, family, seed", CASES, ids=[f"{fmt}-{fam}-{s:03d}" for fmt, fam, s in CASES]
)
def test_broken_framing_is_refused_by_the_header_alone(sources, tmp_path, fmt, family, seed):
    d = shutil.copytree(sources[fmt][0], tmp_path / fmt)
    rng = np.random.default_rng([FRAMING.index(family), seed, int(fmt == "bundle"), 29])
    f = pick(rng, tensor_files(d))
    what = f"{fmt} {family} seed {seed}: {f.name}: {FRAMING_EDITS[family](f, rng)}"
    judge(d, fmt, what, sources[fmt], require="identical", verify=False, tokenizer=False)


@pytest.mark.parametrize(
    "fmt, name, kind", FILE_CASES, ids=[f"{fmt}-{n}-{k}" for fmt, n, k in FILE_CASES]
)
def test_every_parsed_file_broken_is_refused_naming_it(sources, tmp_path, fmt, name, kind):
    d = shutil.copytree(sources[fmt][0], tmp_path / fmt)
    rng = np.random.default_rng([FILE_CASES.index((fmt, name, kind)), 29])
    what = f"{fmt}: {_break_file(d / name, kind, rng)}"
    if kind in BROKEN:
        require = "refused"
    else:  # a cut JSON file may end where a valid document does; a cut template compiles
        require = "runs" if name.endswith(".jinja") else "identical"
    error = judge(d, fmt, what, sources[fmt], require=require, verify=False, tokenizer=True)
    if kind in BROKEN:
        assert name in error, f"{what}: the error does not name the file: {error}"


@pytest.mark.parametrize(
    "fmt, seed", TOKENIZER_CASES, ids=[f"{f}-{s:03d}" for f, s in TOKENIZER_CASES]
)
def test_tokenizer_edits_are_ours_or_a_tokenizer_that_loads(sources, tmp_path, fmt, seed):
    d = shutil.copytree(sources[fmt][0], tmp_path / fmt)
    rng = np.random.default_rng([seed, int(fmt == "bundle"), 2929])
    f = d / pick(rng, list(TOKENIZER_JSON))
    what = f"{fmt} seed {seed}: {json_edit(f, rng, delete=bool(rng.integers(2)))}"
    judge(d, fmt, what, sources[fmt], require="runs", verify=False, tokenizer=True)


@pytest.mark.parametrize(
    "field, kind, value", CONFIG_CASES, ids=[f"{f}-{k}" for f, k, _ in CONFIG_CASES]
)
def test_every_dsv4_config_field_is_validated(sources, tmp_path, field, kind, value):
    d = shutil.copytree(sources["bundle"][0], tmp_path / "bundle")
    strip_checksums(d, "bundle")
    config = json.loads((d / "config.json").read_text())
    if kind == "missing":
        del config[field]
    else:
        config[field] = value
    (d / "config.json").write_text(json.dumps(config))
    what = f"bundle config.json: {field} {kind}: {value!r}"
    has_default = next(f for f in dsv4_config.FIELDS if f.name == field).default is not MISSING
    required = kind != "missing" or not has_default
    require = "refused" if required else "runs"
    error = judge(
        d, "bundle", what, sources["bundle"], require=require, verify=False, tokenizer=False
    )
    # model_type is what makes the directory a bundle: another one is refused as no model of
    # ours (the bitnest reader's "no manifest"), not as a bundle field.
    if error is not None and required and field != "model_type":
        assert "config.json" in error and field in error, f"{what}: {error}"


def test_the_fuzz_has_at_least_500_cases_over_both_formats():
    total = len(CASES) + len(FILE_CASES) + len(TOKENIZER_CASES) + len(CONFIG_CASES)
    total += len(test_fuzz_formats.CASES)
    assert total >= 500
    assert {f.name for f in dsv4_config.FIELDS} == {field for field, _, _ in CONFIG_CASES}
