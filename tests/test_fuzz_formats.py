"""Seeded corruption of the data and values of a valid bitnest package and a valid DeepSeek-V4
bundle (tests/fuzz_support.py: the inputs and the judge; test_fuzz_files.py: framing, JSON and
tokenizer files, DSV4 config fields).

Each case copies one of the two valid inputs, breaks the copy in one seeded way and loads it the
way `bitnest_mlx.load(path, verify=True)` does (`loader.load_model(path, verify=True)`: every
rule, then every file's bytes against the recorded checksums, then the model). The load must
end, within 10 s of CPU time, in one of two ways:

* an error of our own type (`loader.LOAD_ERRORS`: PackageError / BundleError) whose message is one
  line, or
* a model whose logits on a fixed token batch are exactly those of the uncorrupted model (the
  corruption did not touch what the model reads).

Anything else (another exception, a hang, different logits) fails the case; its id names the
format, the seed and the corruption family, and the message says what was done. Both inputs are
written with the optional checksums of formats/checksums.py, which is what makes "unchanged or
refused" decidable for bit flips in tensor data and for edits of JSON values that have defaults.

The `unchecked-*` families strip the checksums first and then edit a JSON value, as in a package
or a jang bundle written without them: such an edit may give another valid model (nothing can
tell it from the original), so there the requirement is only ours-or-runs: our one-line error, or
a model whose forward runs and gives logits of the right shape, never a crash inside mlx-lm or
the model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from fuzz_support import (
    CHECKSUM_KEYS,
    LOGITS,
    ODD_VALUES,
    build_sources,
    json_edit,
    judge,
    package_logits,
    pick,
    strip_checksums,
)
from fuzz_support import header as _header
from fuzz_support import json_files as _json_files
from fuzz_support import tensor_files as _tensor_files
from fuzz_support import write_header as _write_header

from bitnest_mlx.formats import bitnest, dsv4_bundle
from bitnest_mlx.runtime.loader import load_model

FAMILIES = (
    "truncate",
    "flip-header",
    "flip-data",
    "flip-json",
    "dtype-lie",
    "shape-lie",
    "drop-tensor",
    "extra-tensor",
    "json-delete",
    "json-set",
    "drop-file",
    "extra-file",
)
UNCHECKED = ("unchecked-json-delete", "unchecked-json-set")
ALL_FAMILIES = FAMILIES + UNCHECKED
# Per format: 12 checked families × 16 or 10 seeds, plus the unchecked ones.
CASES = [("package", f, s) for f in FAMILIES for s in range(16)]
CASES += [("package", f, s) for f in UNCHECKED for s in range(12)]
CASES += [("bundle", f, s) for f in FAMILIES for s in range(10)]
CASES += [("bundle", f, s) for f in UNCHECKED for s in range(12)]

SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U32", "U16", "U8")


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, tuple[Path, np.ndarray, list[int]]]:
    return build_sources(tmp_path_factory.mktemp("fuzz-sources"))


# ---------------------------------------------------------------- file helpers


def _flip(f: Path, rng: np.random.Generator, lo: int, hi: int) -> str:
    data = bytearray(f.read_bytes())
    at, bit = int(rng.integers(lo, hi)), int(rng.integers(8))
    data[at] ^= 1 << bit
    f.write_bytes(bytes(data))
    return f"flip bit {bit} of byte {at} of {f.name}"


def _index(d: Path) -> tuple[Path, dict] | None:
    f = d / dsv4_bundle.INDEX_FILE
    return (f, json.loads(f.read_text())) if f.is_file() else None


# ---------------------------------------------------------------- corruptions


def truncate(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d) + _json_files(d))
    size = f.stat().st_size
    cut = int(rng.integers(0, size))
    f.write_bytes(f.read_bytes()[:cut])
    return f"truncate {f.name} at {cut} of {size} bytes"


def flip_header(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d))
    n, _ = _header(f)
    return _flip(f, rng, 0, 8 + n)


def flip_data(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d))
    n, _ = _header(f)
    return _flip(f, rng, 8 + n, f.stat().st_size)


def flip_json(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _json_files(d))
    return _flip(f, rng, 0, f.stat().st_size)


def dtype_lie(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d))
    _, header = _header(f)
    name = pick(rng, sorted(k for k in header if k != "__metadata__"))
    old = header[name]["dtype"]
    header[name]["dtype"] = pick(rng, [t for t in SAFETENSORS_DTYPES if t != old])
    _write_header(f, header)
    return f"{f.name}: {name} dtype {old} -> {header[name]['dtype']} (data kept)"


def shape_lie(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d))
    _, header = _header(f)
    name = pick(rng, sorted(k for k in header if k != "__metadata__"))
    old = list(header[name]["shape"])
    how = int(rng.integers(5))
    if how == 0 and len(old) >= 2:  # the same element count in another shape
        shape = old[::-1]
    elif how == 1 and len(old) >= 2 and old[0] % 2 == 0:
        shape = [old[0] // 2, *old[1:-1], old[-1] * 2]
    elif how in (0, 1, 2):
        shape = [1, *old]
    elif how == 3 and old:  # one more row or column than the data holds
        i = int(rng.integers(len(old)))
        shape = [x + (j == i) for j, x in enumerate(old)]
    else:
        shape = old[1:]
    header[name]["shape"] = shape
    _write_header(f, header)
    return f"{f.name}: {name} shape {old} -> {shape} (data kept)"


def _rewrite(f: Path, edit: Callable[[dict[str, mx.array]], None]) -> None:
    tensors = dict(mx.load(str(f)))
    edit(tensors)
    mx.save_safetensors(str(f), tensors, metadata={"format": "mlx"})


def drop_tensor(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d))
    name = pick(rng, sorted(mx.load(str(f))))
    _rewrite(f, lambda t: t.pop(name))
    index, also = _index(d), bool(rng.integers(2))
    if index and also:
        index[1]["weight_map"].pop(name, None)
        index[0].write_text(json.dumps(index[1]))
    return f"drop {name} from {f.name}" + (" and the index" if index and also else "")


def extra_tensor(d: Path, rng: np.random.Generator) -> str:
    files = _tensor_files(d)
    f = pick(rng, files)
    stored = dict(mx.load(str(f)))
    existing = pick(rng, sorted(stored))
    base = existing.rsplit(".", 1)[0]
    name = pick(
        rng,
        [
            f"{base}.extra",
            existing + "_copy",
            "lm_head.bias",
            "model.layers.0.input_layernorm.weight",
            "model.norm.weight",
            "mtp.0.norm.weight",
            "layers.0.attn.compressor.ape",
            "layers.3.ffn.gate.tid2eid",
            f"{base}.g_idx",
        ],
    )
    # Sometimes the same key in a second file (stored twice), else a copy of an existing tensor.
    twice = len(files) > 1 and bool(rng.integers(2))
    target = pick(rng, [g for g in files if g != f]) if twice else f
    value = stored[existing] if twice else mx.ones_like(stored[existing])
    key = existing if twice else name
    _rewrite(target, lambda t: t.__setitem__(key, value))
    index = _index(d)
    if index and bool(rng.integers(2)):
        index[1]["weight_map"][key] = target.name
        index[0].write_text(json.dumps(index[1]))
    return f"add {key} {list(value.shape)} {value.dtype} to {target.name}"


def json_delete(d: Path, rng: np.random.Generator) -> str:
    return json_edit(pick(rng, _json_files(d)), rng, delete=True)


def json_set(d: Path, rng: np.random.Generator) -> str:
    return json_edit(pick(rng, _json_files(d)), rng, delete=False)


def drop_file(d: Path, rng: np.random.Generator) -> str:
    f = pick(rng, _tensor_files(d) + _json_files(d))
    f.unlink()
    return f"delete {f.name}"


def extra_file(d: Path, rng: np.random.Generator) -> str:
    manifest = d / "bitnest.json"
    choices = [
        ("model-00009-of-00009.safetensors", lambda: _tensor_files(d)[0].read_bytes()),
        ("extra.safetensors", lambda: rng.bytes(int(rng.integers(0, 64)))),
        ("jang_config.json", lambda: json.dumps({"mxtq_seed": pick(rng, ODD_VALUES)}).encode()),
        ("model.safetensors.index.json", lambda: json.dumps({"weight_map": {}}).encode()),
        ("model.safetensors", lambda: _tensor_files(d)[-1].read_bytes()),
    ]
    if manifest.is_file():
        choices.append(("manifest.json", manifest.read_bytes))
    name, content = pick(rng, choices)
    (d / name).write_bytes(content())
    return f"add or replace {name}"


CORRUPT: dict[str, Callable[[Path, np.random.Generator], str]] = {
    "truncate": truncate,
    "flip-header": flip_header,
    "flip-data": flip_data,
    "flip-json": flip_json,
    "dtype-lie": dtype_lie,
    "shape-lie": shape_lie,
    "drop-tensor": drop_tensor,
    "extra-tensor": extra_tensor,
    "json-delete": json_delete,
    "json-set": json_set,
    "drop-file": drop_file,
    "extra-file": extra_file,
    "unchecked-json-delete": json_delete,
    "unchecked-json-set": json_set,
}


# ---------------------------------------------------------------- the test


@pytest.mark.parametrize(
    "fmt, family, seed", CASES, ids=[f"{fmt}-{fam}-{seed:03d}" for fmt, fam, seed in CASES]
)
def test_corrupted_input_is_refused_in_one_line_or_loads_unchanged(
    sources, tmp_path, fmt, family, seed
):
    d = shutil.copytree(sources[fmt][0], tmp_path / fmt)
    rng = np.random.default_rng([ALL_FAMILIES.index(family), seed, int(fmt == "bundle")])
    if family in UNCHECKED:
        strip_checksums(d, fmt)
    what = f"{fmt} {family} seed {seed}: {CORRUPT[family](d, rng)}"
    require = "runs" if family in UNCHECKED else "identical"
    judge(d, fmt, what, sources[fmt], require=require, verify=True, tokenizer=False)


def test_the_fuzz_covers_every_family_in_both_formats():
    for fmt in ("package", "bundle"):
        assert {fam for f, fam, _ in CASES if f == fmt} == set(CORRUPT)


# ---------------------------------------------------------------- what the fuzz found, pinned


def _unchecked_copy(sources, fmt: str, tmp_path: Path) -> Path:
    d = shutil.copytree(sources[fmt][0], tmp_path / fmt)
    strip_checksums(d, fmt)
    return d


def _set(d: Path, file: str, path: tuple, value) -> None:
    doc = json.loads((d / file).read_text())
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    (d / file).write_text(json.dumps(doc))


_DELETE = object()


@pytest.mark.parametrize(
    "path, value",
    [
        (("sliding_window",), 2**40),  # int32 overflow in the attention mask
        (("sliding_window",), 8.5),
        (("qk_rope_head_dim",), _DELETE),  # ModelArgs' TypeError
        (("num_hidden_layers",), None),  # compared with len(compress_ratios)
        (("compress_ratios",), [0, 0, 4, 128, None, 0]),
        (("rope_parameters",), "yarn"),  # inside mlx-lm's YaRN table
        (("rope_parameters", "factor"), "16"),
        (("rope_parameters", "beta_fast"), -1),
        (("rope_theta",), 1),  # YaRN divides by log(theta)
        (("hc_sinkhorn_iters",), 2**40),  # unrolled into the graph: a hang
        (("quantization", "bits"), "8"),
        (("mxtq_seed",), "x"),
        (("routed_expert_bit_plan", "assignment", "layer_3.gate_proj"), "2"),
    ],
    ids=lambda v: ".".join(map(str, v)) if isinstance(v, tuple) else repr(v)[:12],
)
def test_bundle_config_values_are_refused_by_validation_not_only_by_checksums(
    sources, tmp_path, path, value
):
    d = _unchecked_copy(sources, "bundle", tmp_path)
    _set(d, "config.json", path, value)
    with pytest.raises(dsv4_bundle.BundleError) as e:
        load_model(d)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg and path[0] in msg


def test_package_config_with_null_head_dim_derives_it_like_a_missing_one(sources, tmp_path):
    d = _unchecked_copy(sources, "package", tmp_path)
    _set(d, "config.json", ("head_dim",), None)
    assert np.array_equal(package_logits(load_model(d)), sources["package"][1])


@pytest.mark.parametrize("value", [None, 3, [1, 2]], ids=["null", "3", "list"])
def test_package_o_proj_activation_group_is_validated(sources, tmp_path, value):
    d = _unchecked_copy(sources, "package", tmp_path)
    o_proj = "model.layers.0.self_attn.o_proj"
    path = ("activation", "per_layer_group") + ((o_proj,) if value == 3 else ())
    _set(d, "bitnest.json", path, value)
    with pytest.raises(bitnest.PackageError, match="per_layer_group"):
        load_model(d)


def test_a_flipped_data_bit_loads_as_it_is_without_verify_and_is_refused_with_it(sources, tmp_path):
    d = shutil.copytree(sources["package"][0], tmp_path / "package")
    f = d / "model.safetensors"
    n, header = _header(f)
    name = "model.embed_tokens.weight"
    data = bytearray(f.read_bytes())
    data[8 + n + header[name]["data_offsets"][0]] ^= 1  # a bfloat16 mantissa bit: still valid
    f.write_bytes(bytes(data))
    bitnest.read(d)  # a plain read hashes no data: it cannot tell, and stays lazy
    with pytest.raises(bitnest.PackageError) as e:
        bitnest.read(d, verify=True)
    msg = str(e.value)
    recorded = json.loads((d / "bitnest.json").read_text())["checksums"]["files"][f.name]
    assert str(f) in msg and name in msg and recorded in msg and "\n" not in msg


def test_without_checksums_both_formats_load_and_seal_records_a_deliberate_edit(sources, tmp_path):
    from bitnest_mlx.formats import dsv4_bundle_write

    for fmt, seal in (("package", bitnest.seal), ("bundle", dsv4_bundle_write.seal)):
        d = _unchecked_copy(sources, fmt, tmp_path)
        assert np.array_equal(LOGITS[fmt](load_model(d)), sources[fmt][1])
        seal(d)
        file = "bitnest.json" if fmt == "package" else "config.json"
        assert CHECKSUM_KEYS[fmt] in json.loads((d / file).read_text())
        assert np.array_equal(LOGITS[fmt](load_model(d)), sources[fmt][1])
