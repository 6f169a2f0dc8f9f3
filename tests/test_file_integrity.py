"""Every byte accounted for: the safetensors framing rules (each one, by the one reader of
headers), the JSON and tokenizer files from the faces, and the checksums (`bitnest-verify`,
`load(verify=True)`, a plain load that hashes nothing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from factory import make_package

import bitnest_mlx
from bitnest_mlx.convert.sources import SourceError, load_hf
from bitnest_mlx.formats import bitnest, checksums, dsv4_bundle
from bitnest_mlx.formats.safetensors_io import FormatError, read_header
from bitnest_mlx.runtime.demo import write_demo_bundle


def _file(path: Path, header: dict | str, data: bytes, length: int | None = None) -> Path:
    """A safetensors file with exactly this header text (and header length field) and data."""
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    n = len(text) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + text + data)
    return path


def _two(a: list[int], b: list[int], dtype: str = "F32", shape_b: list[int] | None = None):
    return {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": a},
        "b": {"dtype": dtype, "shape": shape_b or [1], "data_offsets": b},
    }


RULES = [
    ("short-file", None, b"", ["truncated", "8-byte header length"]),
    ("length-past-end", ("{}", 99), b"", ["header says 99 bytes"]),
    ("not-json", "{'a': 1}", b"", ["unreadable safetensors header", "JSON"]),
    ("top-level-list", "[]", b"", ["unreadable safetensors header", "list"]),
    ("repeated-key", '{"a": {}, "a": {}}', b"", ["key 'a' appears twice"]),
    ("metadata-not-strings", {"__metadata__": {"format": 1}}, b"", ["__metadata__"]),
    ("entry-not-object", {"a": [1]}, b"", ["tensor a", "expected an object"]),
    ("unknown-dtype", _two([0, 8], [8, 12], dtype="F17"), bytes(12), ["tensor b", "'F17'"]),
    (
        "bool-shape",
        {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}},
        bytes(1),
        ["tensor a", "shape"],
    ),
    ("offsets-reversed", _two([0, 8], [12, 8]), bytes(12), ["tensor b", "begin <= end"]),
    ("size-not-shape", _two([0, 8], [8, 16]), bytes(16), ["tensor b", "hold 8 bytes, expected 4"]),
    ("gap", _two([0, 8], [9, 13]), bytes(13), ["tensor b", "a gap"]),
    ("overlap", _two([0, 8], [6, 10]), bytes(10), ["tensor b", "an overlap"]),
    ("not-from-zero", _two([1, 9], [9, 13]), bytes(13), ["tensor a", "begin at 1, expected 0"]),
    ("trailing", _two([0, 8], [8, 12]), bytes(13), ["1 trailing bytes"]),
    ("truncated-data", _two([0, 8], [8, 12]), bytes(11), ["truncated", "need"]),
]


@pytest.mark.parametrize("rule, header, data, fragments", RULES, ids=[r[0] for r in RULES])
def test_each_framing_rule_is_one_line_naming_file_and_rule(
    tmp_path, rule, header, data, fragments
):
    f = tmp_path / "x.safetensors"
    if header is None:
        f.write_bytes(b"\x01\x02")
    elif isinstance(header, tuple):
        _file(f, header[0], data, length=header[1])
    else:
        _file(f, header, data)
    with pytest.raises(FormatError) as e:
        read_header(f, FormatError)
    msg = str(e.value)
    assert msg.startswith(f"{f}: ") and "\n" not in msg
    assert all(x in msg for x in fragments), msg


def test_out_of_order_entries_that_tile_the_data_are_accepted(tmp_path):
    f = _file(tmp_path / "x.safetensors", _two([4, 12], [0, 4]), bytes(12))
    spans = read_header(f, FormatError)
    n = f.stat().st_size - 12
    assert (spans["a"].begin, spans["a"].end, spans["b"].begin) == (n + 4, n + 12, n)


def _one_byte_short(f: Path) -> None:
    """The header length lowered by one; the header padded first so that it still parses."""
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    text = data[8 : 8 + n] + b"        "
    f.write_bytes((len(text) - 1).to_bytes(8, "little") + text + data[8 + n :])


def test_a_header_one_byte_short_is_what_mx_load_reads_shifted_and_we_refuse(tmp_path):
    pkg, _, _ = make_package(tmp_path / "pkg", tokenizer=True)
    f = pkg / "model.safetensors"
    before = mx.load(str(f))
    _one_byte_short(f)
    after = mx.load(str(f))  # the bug: accepted, every tensor read one byte early
    name = "model.embed_tokens.weight"
    assert not mx.array_equal(before[name], after[name]).item()
    with pytest.raises(bitnest.PackageError) as e:
        bitnest_mlx.load(pkg)
    assert str(f) in str(e.value) and "trailing" in str(e.value)


def test_the_converter_reads_hf_checkpoints_through_the_same_framing_check(tmp_path):
    from test_sources import hf_dir

    d = hf_dir(tmp_path / "hf", {"w": ("F32", (2,), bytes(8))})
    load_hf(d)
    _one_byte_short(d / "model.safetensors")
    with pytest.raises(SourceError, match=r"model\.safetensors: .*safetensors framing"):
        load_hf(d)


# ---------------------------------------------------------------- JSON files, every face


@pytest.fixture
def package(tmp_path) -> Path:
    return make_package(tmp_path / "pkg", tokenizer=True)[0]


def _one_line(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize(
    "name", ["tokenizer_config.json", "tokenizer.json", "config.json", "bitnest.json"]
)
def test_a_json_file_that_is_not_utf8_is_one_line_naming_it_from_load_and_the_cli(package, name):
    f = package / name
    f.write_bytes(b"\xff" + f.read_bytes())
    with pytest.raises(bitnest.PackageError, match="not UTF-8|expected UTF-8") as e:
        bitnest_mlx.load(package)
    assert str(f) in str(e.value)
    line = _one_line([sys.executable, "-m", "bitnest_mlx.generate", "--model", str(package)])
    assert str(f) in line


def test_a_chat_template_that_does_not_compile_is_named_before_generation(package):
    (package / "chat_template.jinja").write_text("{% if messages %}{{ messages[0] }")
    with pytest.raises(bitnest.PackageError, match="chat template does not compile"):
        bitnest_mlx.load(package)


def test_a_bundle_with_an_unreadable_config_names_config_json(tmp_path):
    bundle = write_demo_bundle(tmp_path / "b")
    (bundle / "config.json").write_text("[1, 2")
    with pytest.raises(bitnest.PackageError, match=r"config\.json: unreadable JSON"):
        bitnest_mlx.load(bundle)


# ---------------------------------------------------------------- checksums


def _verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bitnest_mlx.verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


EMBED = "model.embed_tokens.weight"


def _flip_in_tensor(f: Path, name: str) -> None:
    """The lowest bit of a float tensor's first byte: a mantissa bit, so still a valid value
    (a flip in a plane could break the int8 code rule and be refused by structure alone)."""
    spans = read_header(f, FormatError)
    data = bytearray(f.read_bytes())
    data[spans[name].begin] ^= 0x01
    f.write_bytes(bytes(data))


def test_bitnest_verify_finds_one_flipped_bit_in_a_converted_package(package):
    assert _verify(package).returncode == 0
    f = package / "model.safetensors"
    _flip_in_tensor(f, EMBED)
    out = _verify(package)
    assert out.returncode != 0 and out.stdout == ""
    line = out.stderr.strip()
    assert "\n" not in line and f"{f}: sha256" in line and EMBED in line


def test_bitnest_verify_names_a_changed_tokenizer_file_and_a_bundle_shard(package, tmp_path):
    (package / "tokenizer.json").write_text((package / "tokenizer.json").read_text() + " ")
    assert f"{package / 'tokenizer.json'}: sha256" in _verify(package).stderr
    bundle = write_demo_bundle(tmp_path / "bundle")
    assert _verify(bundle).returncode == 0
    shard = sorted(bundle.glob("*.safetensors"))[1]
    _flip_in_tensor(shard, min(n for n in read_header(shard, FormatError) if "norm" in n))
    out = _verify(bundle)
    assert out.returncode != 0 and f"{shard}: sha256" in out.stderr


def test_a_model_without_checksums_is_valid_but_not_verified(package):
    manifest = json.loads((package / "bitnest.json").read_text())
    del manifest[bitnest.CHECKSUMS_KEY]
    (package / "bitnest.json").write_text(json.dumps(manifest))
    out = _verify(package)
    assert out.returncode == 1 and "records no checksums" in out.stderr


def test_load_verify_refuses_what_a_plain_load_cannot_see(package, monkeypatch):
    _flip_in_tensor(package / "model.safetensors", EMBED)
    with pytest.raises(bitnest.PackageError, match=EMBED):
        bitnest_mlx.load(package, verify=True)

    def no_hashing(*args, **kwargs):
        raise AssertionError("a plain load hashed data")

    monkeypatch.setattr(checksums, "file_hash", no_hashing)
    monkeypatch.setattr(checksums, "tensor_hashes", no_hashing)
    model, _ = bitnest_mlx.load(package)  # structure only: loads the flipped weights
    assert model is not None


def test_the_writers_record_every_file_beside_the_document(package, tmp_path):
    manifest = json.loads((package / "bitnest.json").read_text())
    others = {f.name for f in package.iterdir() if f.name != "bitnest.json"}
    assert set(manifest[bitnest.CHECKSUMS_KEY]["files"]) == others
    bundle = write_demo_bundle(tmp_path / "bundle")
    config = json.loads((bundle / "config.json").read_text())
    others = {f.name for f in bundle.iterdir() if f.name != "config.json"}
    assert set(config[dsv4_bundle.CHECKSUMS_KEY]["files"]) == others


def test_on_verify_an_unrecorded_file_a_reader_may_open_is_refused_and_a_readme_is_not(package):
    (package / "README.md").write_text("a model card, added after writing\n")
    bitnest_mlx.load(package, verify=True)
    shutil.copy(package / "tokenizer_config.json", package / "chat_template.json")
    with pytest.raises(bitnest.PackageError, match=r"chat_template\.json: not recorded"):
        bitnest_mlx.load(package, verify=True)
