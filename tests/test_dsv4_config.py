"""DeepSeek-V4 config.json: DSV4Config is the one list of fields; every field's wrong type, value
out of range and absence is our one-line BundleError naming config.json and the field, from the
bundle reader and from ModelArgs alike. The cases are generated from the list itself, so a new
field is covered without a new test."""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest
from bitnest_mlx.models.deepseek_v4 import ModelArgs

from bitnest_mlx.formats import dsv4_bundle, dsv4_bundle_write
from bitnest_mlx.formats.dsv4_config import FIELDS, TYPES, BundleError, DSV4Config
from bitnest_mlx.runtime.demo import TINY_CONFIG, write_demo_bundle

CONFIG = dict(TINY_CONFIG, model_type="deepseek_v4")
WRONG_TYPE = {  # one value of another JSON type per declared type (bool is not a number here)
    int: ["7", 7.5, True, None],
    float: ["0.5", None, True, float("nan")],
    str: [1, None],
    bool: [0, "false", None],
    list[int]: [4, [0, "4"], None],
    dict | None: ["yarn", [1]],
}


def _bound(value: object, config: dict) -> object:
    return (
        config.get(value, DSV4Config.__dataclass_fields__[value].default)
        if isinstance(value, str)
        else value
    )


def _out_of_range(f: dataclasses.Field, config: dict) -> list[object]:
    """Values of the right type that the field's declared range excludes."""
    m, kind, out = f.metadata, TYPES[f.name], []
    if m["choices"]:
        other = {int: 3, str: "softmax", bool: True}[int if kind == list[int] else kind]
        out.append([other] * config["num_hidden_layers"] if kind == list[int] else other)
    if m["ge"] is not None:
        out.append(_bound(m["ge"], config) - (1 if kind is int else 0.5))
    if m["gt"] is not None:
        out.append(m["gt"])
    if m["le"] is not None:
        out.append(_bound(m["le"], config) + 1)
    if m["even"]:
        out.append(config[f.name] - 1)
    if m["min_len"]:
        out.append(config[f.name][: _bound(m["min_len"], config) - 1])
    if m["check"]:
        out += [{"rope_type": "longrope"}, {"rope_type": "yarn", "factor": 0}]
    return out


CASES = [
    pytest.param(f.name, v, id=f"{f.name}-type-{v!r}"[:60])
    for f in FIELDS
    for v in WRONG_TYPE[TYPES[f.name]]
    if not (v is None and f.default is None)
]
CASES += [
    pytest.param(f.name, v, id=f"{f.name}-range-{v!r}"[:60])
    for f in FIELDS
    for v in _out_of_range(f, CONFIG)
]
REQUIRED = [f.name for f in FIELDS if f.default is dataclasses.MISSING]


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A directory holding only config.json: the reader refuses a bad value before any tensor."""
    return tmp_path_factory.mktemp("config-only")


def _refused(err: BundleError, name: str, found: str) -> None:
    msg = str(err)
    assert "\n" not in msg and "config.json" in msg and f"{name} {found}" in msg, msg
    assert "expected" in msg, msg


def _read_with(path, config: dict) -> None:
    (path / "config.json").write_text(json.dumps(config))
    dsv4_bundle.read(path)


def test_every_case_breaks_only_the_field_named():
    assert {p.values[0] for p in CASES} == {f.name for f in FIELDS}
    assert ModelArgs.from_dict(CONFIG).compress_ratios == CONFIG["compress_ratios"][:6]


@pytest.mark.parametrize("name, value", CASES)
def test_a_wrong_type_or_range_is_refused_naming_the_field(config_only, name, value):
    bad = dict(CONFIG, **{name: value})
    with pytest.raises(BundleError) as e:
        _read_with(config_only, bad)
    _refused(e.value, name, "=")
    with pytest.raises(BundleError) as e:  # mlx-lm's loader path: ModelArgs.from_dict
        ModelArgs.from_dict(bad)
    _refused(e.value, name, "=")
    if name in REQUIRED or value is not None:  # direct construction checks the same rules
        with pytest.raises(BundleError):
            ModelArgs(**{k: bad[k] for k in DSV4Config.__dataclass_fields__ if k in bad})


@pytest.mark.parametrize("name", REQUIRED)
def test_a_missing_required_field_is_refused_naming_it(config_only, name):
    config = {k: v for k, v in CONFIG.items() if k != name}
    with pytest.raises(BundleError) as e:
        _read_with(config_only, config)
    _refused(e.value, name, "missing")
    with pytest.raises(BundleError) as e:
        ModelArgs.from_dict(config)
    _refused(e.value, name, "missing")


def test_a_missing_optional_field_takes_the_declared_default():
    optional = [f for f in FIELDS if f.default is not dataclasses.MISSING]
    args = ModelArgs.from_dict(
        {k: v for k, v in CONFIG.items() if k not in {f.name for f in optional}}
    )
    assert all(getattr(args, f.name) == f.default for f in optional)


@pytest.mark.parametrize(
    "edit, name",
    [
        (dict(o_groups=5), "o_groups"),  # 4 heads x 96 = 384 is not a multiple of 5
        (dict(index_head_dim=8, qk_rope_head_dim=16), "index_head_dim"),  # a ratio-4 layer
    ],
)
def test_relations_between_fields_are_refused_naming_the_field(config_only, edit, name):
    with pytest.raises(BundleError) as e:
        _read_with(config_only, dict(CONFIG, **edit))
    _refused(e.value, name, "=")


def test_model_args_has_exactly_the_declared_fields():
    assert [f.name for f in dataclasses.fields(ModelArgs)] == [f.name for f in FIELDS]


# ---------------------------------------------------------------- float dtypes: refused, not cast


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_bundle(tmp_path_factory.mktemp("demo") / "b")


@pytest.mark.parametrize(
    "key, dtype",
    [
        ("layers.2.hc_ffn_base", mx.float16),  # jang: float32, narrowed
        ("layers.1.attn.q_norm.weight", mx.float32),  # jang: float16, widened
        ("layers.0.attn.wq_a.scales", mx.bfloat16),  # same width, other values
    ],
)
def test_a_float_tensor_stored_in_another_float_dtype_is_refused(demo, tmp_path, key, dtype):
    path = shutil.copytree(demo, tmp_path / "b")
    index = json.loads((path / dsv4_bundle.INDEX_FILE).read_text())["weight_map"]
    f = path / index[key]
    tensors = dict(mx.load(str(f)))
    tensors[key] = tensors[key].astype(dtype)
    mx.save_safetensors(str(f), tensors)
    dsv4_bundle_write.seal(path)  # judged by the dtype rule, not by the checksums
    with pytest.raises(BundleError, match=rf"{key}: dtype {dtype}, expected") as e:
        dsv4_bundle.read(path)
    assert "\n" not in str(e.value)
