"""What the two fuzz tests share (test_fuzz_formats.py: corruptions of data and values;
test_fuzz_files.py: framing, every JSON and tokenizer file, DSV4 config fields): the two valid
inputs, file helpers, and the one judge of a case.

A case copies one valid input, breaks the copy in one seeded way and loads it in this process
(a case costs milliseconds, so 500 of them fit the CI budget). The load must end, within
TIME_LIMIT_S of CPU time, in our one-line error (`loader.LOAD_ERRORS`) or in a load the
requirement accepts: `identical` (the same logits, and the same tokens for a probe text when a
tokenizer is loaded) or `runs` (logits of the right shape: the edit may give another valid
model, which nothing can tell from the original without checksums). A hang that burns no CPU is
caught by faulthandler, which dumps every stack and ends the run after HANG_S of wall time.
"""

from __future__ import annotations

import faulthandler
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
from factory import make_package

from bitnest_mlx.formats import bitnest, dsv4_bundle, dsv4_bundle_write
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.runtime.demo import write_demo_bundle, write_tokenizer
from bitnest_mlx.runtime.loader import LOAD_ERRORS, load, load_model

TIME_LIMIT_S = 10.0  # CPU seconds per case
HANG_S = 120  # wall seconds per case before the run is ended as hung
PACKAGE_TOKENS = mx.array([[5, 9, 77, 3, 200, 11, 0, 259]])
BUNDLE_TOKENS = mx.array(np.random.default_rng(7).integers(2, 256, 24))[None]
PROBE = "The river, 42 times."
CHECKSUM_KEYS = {"package": bitnest.CHECKSUMS_KEY, "bundle": dsv4_bundle.CHECKSUMS_KEY}
DOC_FILES = {"package": "bitnest.json", "bundle": "config.json"}
ODD_VALUES = (None, True, False, 0, -1, 1, 3, 2**40, 0.5, -2.5, 1e30, "x", "", "a\nb", [], {}, [1])


def package_logits(model) -> np.ndarray:
    return np.stack(
        [np.array(model(PACKAGE_TOKENS, options=RunOptions(mode=m))) for m in ("draft", "target")]
    )


def bundle_logits(model) -> np.ndarray:
    return np.array(model(BUNDLE_TOKENS))


LOGITS: dict[str, Callable] = {"package": package_logits, "bundle": bundle_logits}


def _add_tokenizer_files(d: Path, eos: str) -> None:
    """The JSON and template files a tokenizer may come with, beyond tokenizer(_config).json."""
    files = {
        "generation_config.json": json.dumps({"do_sample": False, "max_length": 64}),
        "special_tokens_map.json": json.dumps({"eos_token": eos}),
        "chat_template.jinja": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
        "{% endfor %}",
    }
    for name, text in files.items():
        if not (d / name).is_file():
            (d / name).write_text(text)


def build_sources(root: Path) -> dict[str, tuple[Path, np.ndarray, list[int]]]:
    """A 1-layer Qwen2 package (biases, k-bias KV offset, R4 with K = 12) and the 6-layer demo
    bundle (hash layers, ratios 0/4/128, 2/4-bit MXTQ, two shards and an index), each with every
    tokenizer file and its checksums (every file's bytes recorded), and each with its reference
    logits and the tokens of PROBE."""
    package, _, _ = make_package(root / "package", "qwen2", n_layers=1, intermediate=384, vocab=260)
    write_tokenizer(package)  # the byte-level tokenizer: 257 ids, within the model's 260
    _add_tokenizer_files(package, "<|endoftext|>")
    bitnest.seal(package)
    bundle = write_demo_bundle(root / "bundle")
    config = json.loads((bundle / "config.json").read_text())
    (bundle / "jang_config.json").write_text(json.dumps({"mxtq_seed": config["mxtq_seed"]}))
    _add_tokenizer_files(bundle, "<｜end▁of▁sentence｜>")
    dsv4_bundle_write.seal(bundle)
    out = {}
    for name, path in (("package", package), ("bundle", bundle)):
        model, tokenizer = load(path)
        out[name] = (path, LOGITS[name](model), tokenizer.encode(PROBE))
    return out


# ---------------------------------------------------------------- file helpers


def header(f: Path) -> tuple[int, dict]:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8 : 8 + n])


def write_header(f: Path, doc: dict | str) -> None:
    """Replace the header of a safetensors file (a dict, or raw JSON text), keeping its data
    bytes; padded with spaces to a multiple of 8 as writers do."""
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = (doc if isinstance(doc, str) else json.dumps(doc, separators=(",", ":"))).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])


def tensor_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def json_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.json"))


def pick(rng: np.random.Generator, seq: list):
    return seq[int(rng.integers(len(seq)))]


def key_paths(doc: object, where: tuple = ()) -> list[tuple]:
    """Every key path of a JSON document (lists indexed), outermost first."""
    out = []
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    )
    for k, v in items:
        out.append((*where, k))
        out.extend(key_paths(v, (*where, k)))
    return out


def json_edit(f: Path, rng: np.random.Generator, delete: bool) -> str:
    """Delete, or set to an odd value, one seeded key path of a JSON file."""
    doc = json.loads(f.read_text())
    path = pick(rng, key_paths(doc))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    old = parent[path[-1]]
    where = f"{f.name}:{'.'.join(map(str, path))}"
    if delete:
        del parent[path[-1]]
        f.write_text(json.dumps(doc, indent=2))
        return f"delete {where}"
    pool = list(ODD_VALUES)
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        pool += [old * 2, old + 1, -old, type(old)(0)]
    if isinstance(old, str):
        pool += [old + "x", old.upper()]
    value = pick(rng, pool)
    parent[path[-1]] = value
    f.write_text(json.dumps(doc, indent=2))
    return f"set {where} = {value!r} (was {json.dumps(old)[:40]})"


def strip_checksums(d: Path, fmt: str) -> None:
    """Remove the checksum block, as in a package or jang bundle written without one."""
    f = d / DOC_FILES[fmt]
    doc = json.loads(f.read_text())
    doc.pop(CHECKSUM_KEYS[fmt], None)
    f.write_text(json.dumps(doc, indent=2))


# ---------------------------------------------------------------- the judge


def judge(
    d: Path,
    fmt: str,
    what: str,
    reference: tuple[Path, np.ndarray, list[int]],
    *,
    require: str,
    verify: bool,
    tokenizer: bool,
) -> str | None:
    """Load `d` (the model, and its tokenizer when `tokenizer`) and hold the result to
    `require` ("identical", "runs" or "refused"); returns the error line when refused."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    start = time.process_time()
    error = tokens = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "no config.json": what counts is the result
            if tokenizer:
                model, tok = load(d, verify=verify)
                tokens = None if tok is None else tok.encode(PROBE)
            else:
                model = load_model(d, verify=verify)
            logits = LOGITS[fmt](model)
    except LOAD_ERRORS as e:
        error = str(e)
        assert "\n" not in error, f"{what}: error of more than one line: {error}"
    except Exception as e:
        raise AssertionError(f"{what}: crashed with {type(e).__name__}: {e}") from e
    finally:
        faulthandler.cancel_dump_traceback_later()
    elapsed = time.process_time() - start
    assert elapsed < TIME_LIMIT_S, f"{what}: took {elapsed:.1f} s of CPU time"
    if error is not None:
        return error
    assert require != "refused", f"{what}: loaded, expected a refusal"
    _, ref_logits, ref_tokens = reference
    if require == "runs":
        assert logits.shape == ref_logits.shape, f"{what}: logits {logits.shape}"
        assert tokens is None or all(isinstance(t, int) for t in tokens), f"{what}: {tokens}"
    else:
        assert np.array_equal(logits, ref_logits), f"{what}: loaded a different model"
        assert tokens is None or tokens == ref_tokens, f"{what}: tokenizes differently"
    return None
