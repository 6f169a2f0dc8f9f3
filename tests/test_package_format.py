"""bitnest-package-v1 reader and writer (spec: docs/bitnest-package.md §1, §2).

Every validation rule gets a package that breaks exactly that rule, and the PackageError must name
the file, the tensor (where there is one) and what was expected. The packages are written by
`write_package` from seeded random float weights (tests/factory.py), once per session, and
each test breaks its own copy.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from factory import (
    copy_package,
    edit_json,
    edit_tensors,
    float_weights,
    load_tensors,
    make_package,
    read_json,
    shard,
)

from bitnest_mlx.convert import write_package
from bitnest_mlx.formats import bitnest
from bitnest_mlx.formats.bitnest import PackageError
from bitnest_mlx.formats.hadamard import hadamard_k, r4_transform

REPO = Path(__file__).resolve().parents[1]
SEED_MANIFEST = REPO.parent / "shared" / "seeds" / "llama3.2_3b.bitnest-manifest.json"
LAYER_LINEARS = bitnest.LAYER_LINEARS
# The manifest objects keyed by this model's Linear names (compared entry-wise, not by key).
PER_LAYER_KEYS = {("layers",), ("activation", "per_layer_group"), ("online_hadamard", "layers")}


class PerLayer(frozenset):
    """Skeleton of a per-layer object: the keys of each entry (empty: entries are scalars)."""


# Key tree of the seed manifest (checked against the file below when it is available, so the
# writer tests do not depend on a file outside the repository).
SEED_SKELETON = {
    "format": None,
    "model": None,
    "arch": None,
    "source_model": None,
    "rotation": None,
    "group_size": None,
    "pack": None,
    "weight_planes": dict.fromkeys(("hi", "lo", "byte_layout", "draft", "target", "int8_code")),
    "activation": {"scheme": None, "per_layer_group": PerLayer()},
    "online_hadamard": {"note": None, "layers": PerLayer({"K", "fp32"})},
    "norms": dict.fromkeys(("fused", "decoder_norms_identity", "note")),
    "kv": dict.fromkeys(("nesting", "per_channel_offset", "r3")),
    "rope": {
        "theta": None,
        "scaling": dict.fromkeys(
            (
                "factor",
                "high_freq_factor",
                "low_freq_factor",
                "original_max_position_embeddings",
                "rope_type",
            )
        ),
        "max_position_embeddings": None,
    },
    "layers": PerLayer({"shape", "groups", "has_bias"}),
    "embed_note": None,
    "reference": dict.fromkeys(("loader", "gpu_runner")),
    "lm_head_note": None,
}
# The seed's A8 group per Linear of a layer: o_proj per head (128), the rest per token (-1).
SEED_GROUPS = {lin: 128 if lin.endswith("o_proj") else -1 for lin in LAYER_LINEARS}


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict:
    """Two source packages: a 2-layer Llama (R4 K = 1, tokenizer) and a 1-layer Qwen2 (K = 12)."""
    root = tmp_path_factory.mktemp("packages")
    return {
        "llama": make_package(root / "llama", "llama", tokenizer=True),
        "qwen2": make_package(root / "qwen2", "qwen2", n_layers=1, intermediate=384, vocab=260),
    }


@pytest.fixture
def llama(built, tmp_path) -> Path:
    return copy_package(built["llama"][0], tmp_path / "llama")


@pytest.fixture
def qwen2(built, tmp_path) -> Path:
    return copy_package(built["qwen2"][0], tmp_path / "qwen2")


def refused(pkg: Path, *fragments: str) -> str:
    """Read must raise PackageError whose message contains every fragment; returns the message."""
    with pytest.raises(PackageError) as e:
        bitnest.read(pkg)
    msg = str(e.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def linear_shapes(config: dict) -> dict[str, list[int]]:
    """[N, K] of every Linear of an HF config, computed here independently of the package code."""
    d, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    per_layer = [[q, d], [kv, d], [kv, d], [d, q], [inter, d], [inter, d], [d, inter]]
    shapes = {
        f"model.layers.{i}.{lin}": s
        for i in range(config["num_hidden_layers"])
        for lin, s in zip(LAYER_LINEARS, per_layer)
    }
    shapes["lm_head"] = [config["vocab_size"], d]
    return shapes


# ---------------------------------------------------------------------------------------------
# Written packages are accepted


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_package_round_trips_through_read(built, arch):
    pkg, _, config = built[arch]
    package = bitnest.read(pkg)
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        assert package.config[key] == config[key]
    assert package.config["arch"] == arch
    assert package.num_layers == config["num_hidden_layers"]
    assert set(package.tensors) == set(load_tensors(pkg))


def test_in_layer_norms_of_ones_are_accepted(llama):
    # A fused package may still ship its (identity) in-layer norms.
    def add(t):
        for i in range(2):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                t[f"model.layers.{i}.{norm}.weight"] = mx.ones((256,), dtype=mx.bfloat16)

    edit_tensors(llama, add)
    assert "model.layers.1.input_layernorm.weight" in bitnest.read(llama).tensors


def test_hi_zero_with_lo_at_least_8_is_accepted(llama):
    # The boundary of the int8 rule: q4 = -8, qr = 0 gives q8 = -128, which is a valid code.
    def edit(t):
        name = "model.layers.0.self_attn.q_proj"
        hi, lo = np.array(t[f"{name}.hi"]), np.array(t[f"{name}.lo"])
        hi[0, 0], lo[0, 0] = 0x00, 0x88
        t[f"{name}.hi"], t[f"{name}.lo"] = mx.array(hi), mx.array(lo)

    edit_tensors(llama, edit)
    bitnest.read(llama)


# ---------------------------------------------------------------------------------------------
# Manifest files


def test_wrong_format_string_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m.update(format="bitnest-package-v0"))
    refused(llama, "bitnest.json", "'bitnest-package-v0'", "expected 'bitnest-package-v1'")


def test_directory_without_manifest_is_refused(llama):
    (llama / "bitnest.json").unlink()
    refused(llama, str(llama), "no manifest", "expected bitnest.json")
    assert not bitnest.is_package(llama)


def test_a_file_is_not_a_package(llama):
    refused(llama / "config.json", "config.json", "not a directory")


def test_two_manifests_are_refused(llama):
    shutil.copy(llama / "bitnest.json", llama / "manifest.json")
    refused(llama, str(llama), "two manifests", "bitnest.json", "manifest.json", "exactly one")


def test_manifest_json_with_the_format_string_is_accepted(llama):
    (llama / "bitnest.json").rename(llama / "manifest.json")
    assert bitnest.find_manifest(llama).name == "manifest.json"
    assert bitnest.read(llama).manifest["format"] == "bitnest-package-v1"


def test_manifest_json_without_the_format_string_is_not_a_manifest(llama):
    (llama / "bitnest.json").rename(llama / "manifest.json")
    edit_json(llama, "manifest.json", lambda m: m.pop("format"))
    refused(llama, "no manifest", "manifest.json", "lacks that format string")
    assert not bitnest.is_package(llama)


def test_unknown_arch_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m.update(arch="mistral"))
    refused(llama, "bitnest.json", "unknown arch 'mistral'", "'llama', 'qwen2'")


def test_k_not_a_multiple_of_128_is_refused(llama):
    def edit(m):
        m["layers"]["model.layers.0.self_attn.o_proj"]["shape"] = [256, 200]

    edit_json(llama, "bitnest.json", edit)
    refused(llama, "bitnest.json", "model.layers.0.self_attn.o_proj", "K = 200", "multiple of 128")


def test_groups_not_k_over_128_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m["layers"]["lm_head"].update(groups=3))
    refused(llama, "bitnest.json", "lm_head", "groups = 3", "expected K/128 = 2")


def test_missing_layer_entry_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m["layers"].pop("model.layers.1.mlp.up_proj"))
    refused(llama, "bitnest.json", "model.layers.1.mlp.up_proj", "expected shape [512, 256]")


# ---------------------------------------------------------------------------------------------
# Manifest and config.json


@pytest.mark.parametrize(
    "key, bad, good",
    [
        ("hidden_size", 384, 256),
        ("num_hidden_layers", 3, 2),
        ("intermediate_size", 1024, 512),
        ("num_attention_heads", 4, 2),
        ("num_key_value_heads", 2, 1),
        ("vocab_size", 300, 257),
    ],
)
def test_config_dims_that_disagree_with_the_manifest_are_refused(llama, key, bad, good):
    edit_json(llama, "config.json", lambda c: c.update({key: bad}))
    refused(llama, "config.json", f"{key} = {bad}", f"bitnest.json imply {good}")


def test_a_layer_shape_that_disagrees_with_the_config_is_refused(llama):
    # Layer 0 agrees with config.json; layer 1's q_proj claims twice the heads.
    def edit(m):
        m["layers"]["model.layers.1.self_attn.q_proj"].update(shape=[512, 256], groups=2)

    edit_json(llama, "bitnest.json", edit)
    refused(
        llama, "bitnest.json", "model.layers.1.self_attn.q_proj", "config.json implies [256, 256]"
    )


@pytest.mark.parametrize("key", ["quantization", "quantization_config"])
def test_config_with_a_quantization_key_is_refused(llama, key):
    edit_json(llama, "config.json", lambda c: c.update({key: {"group_size": 64, "bits": 4}}))
    refused(llama, "config.json", f"{key!r}", "expected none")


def test_config_with_another_model_type_is_refused(llama):
    edit_json(llama, "config.json", lambda c: c.update(model_type="llama"))
    refused(llama, "config.json", "model_type is 'llama'", 'expected "bitnest"')


@pytest.mark.parametrize("arch, eps", [("llama", 1e-5), ("qwen2", 1e-6)])
def test_without_config_dims_are_derived_from_the_manifest_with_a_warning(
    built, tmp_path, arch, eps
):
    pkg = copy_package(built[arch][0], tmp_path / arch)
    (pkg / "config.json").unlink()
    bitnest.seal(pkg)  # a deliberate variant (a package written without config.json)
    with pytest.warns(UserWarning, match="no config.json"):
        package = bitnest.read(pkg)
    source = built[arch][2]
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert package.config[key] == source[key], key
    assert package.config["rms_norm_eps"] == eps
    assert package.config["rope_scaling"] == source["rope_scaling"]


def test_without_config_the_package_loads_and_runs_like_with_it(tmp_path):
    import bitnest_mlx

    # No rope scaling: load() cannot read a package whose config.json has Llama 3 rope scaling
    # yet (transformers' tokenizer path; strict xfail in test_model_parity.py).
    with_config, _, _ = make_package(
        tmp_path / "pkg", tokenizer=True, n_layers=1, llama3_rope=False
    )
    without = copy_package(with_config, tmp_path / "no-config")
    (without / "config.json").unlink()
    bitnest.seal(without)
    tokens = mx.array([[72, 101, 108, 108, 111]])
    model, _ = bitnest_mlx.load(with_config, dtype=mx.float32)
    expected = model(tokens)
    with pytest.warns(UserWarning, match="no config.json"):
        model, _ = bitnest_mlx.load(without, dtype=mx.float32)
    got = model(tokens)
    assert got.shape == (1, 5, 257)
    assert mx.array_equal(got, expected).item()


# ---------------------------------------------------------------------------------------------
# Tensors of the listed Linears


def _delete(name):
    return lambda t: t.pop(name)


def _retype(name, dtype):
    return lambda t: t.update({name: t[name].astype(dtype)})


def _reshape(name, shape):
    return lambda t: t.update({name: mx.zeros(shape, dtype=t[name].dtype)})


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (
            _delete("model.layers.1.self_attn.k_proj.hi"),
            ["missing tensor model.layers.1.self_attn.k_proj.hi", "uint8 [128, 128]"],
        ),
        (
            _delete("model.layers.0.mlp.down_proj.lo"),
            ["missing tensor model.layers.0.mlp.down_proj.lo", "uint8 [256, 256]"],
        ),
        (_delete("lm_head.scales"), ["missing tensor lm_head.scales", "float16 [257, 2]"]),
        (
            _retype("model.layers.0.self_attn.q_proj.hi", mx.int8),
            ["model.layers.0.self_attn.q_proj.hi", "dtype int8", "expected uint8 [256, 128]"],
        ),
        (
            _retype("model.layers.1.mlp.gate_proj.scales", mx.float32),
            ["model.layers.1.mlp.gate_proj.scales", "dtype float32", "expected float16 [512, 2]"],
        ),
        (
            _retype("model.embed_tokens.weight", mx.float16),
            ["model.embed_tokens.weight", "dtype float16", "expected bfloat16 [257, 256]"],
        ),
        (
            _reshape("model.layers.0.self_attn.o_proj.lo", (256, 256)),
            ["model.layers.0.self_attn.o_proj.lo", "shape [256, 256]", "uint8 [256, 128]"],
        ),
        (
            _reshape("lm_head.scales", (2, 257)),
            ["lm_head.scales", "shape [2, 257]", "expected float16 [257, 2]"],
        ),
    ],
    ids=[
        "missing-hi",
        "missing-lo",
        "missing-scales",
        "hi-int8",
        "scales-fp32",
        "embed-fp16",
        "lo-unpacked",
        "scales-transposed",
    ],
)
def test_linear_planes_with_wrong_presence_dtype_or_shape_are_refused(llama, edit, fragments):
    edit_tensors(llama, edit)
    refused(llama, "model.safetensors", *fragments)


@pytest.mark.parametrize("column", [10, 11], ids=["low-nibble", "high-nibble"])
def test_int8_code_below_minus_128_is_refused(llama, column):
    # Column 2j sits in the low nibble of byte j, column 2j+1 in the high nibble: both are checked.
    name = "model.layers.0.self_attn.q_proj"
    shift = 4 * (column % 2)

    def edit(t):
        hi, lo = np.array(t[f"{name}.hi"]), np.array(t[f"{name}.lo"])
        byte = column // 2
        hi[3, byte] &= ~np.uint8(0xF << shift)  # u_hi = 0 (q4 = -8)
        lo[3, byte] = (lo[3, byte] & ~np.uint8(0xF << shift)) | np.uint8(3 << shift)  # qr = -5
        t[f"{name}.hi"], t[f"{name}.lo"] = mx.array(hi), mx.array(lo)

    edit_tensors(llama, edit)
    refused(
        llama,
        "model.safetensors",
        f"{name}.lo",
        "below -128",
        f"row 3, column {column}",
        "u_lo >= 8",
    )


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.g_idx", "lm_head.perm"])
def test_act_order_tensors_are_refused(llama, name):
    edit_tensors(llama, lambda t: t.update({name: mx.arange(256, dtype=mx.int32) // 128}))
    refused(llama, "model.safetensors", name, "act-order", "128 contiguous columns")


def test_act_order_is_the_reported_cause_even_when_other_rules_break(llama):
    # A GPTQ act-order export rarely has our planes either; the error must name the real cause.
    def edit(t):
        t["model.layers.0.self_attn.q_proj.g_idx"] = mx.arange(256, dtype=mx.int32) // 128
        del t["model.layers.0.self_attn.q_proj.hi"]

    edit_tensors(llama, edit)
    refused(llama, "model.layers.0.self_attn.q_proj.g_idx", "act-order")


def test_unexpected_extra_tensor_is_refused(llama):
    name = "model.layers.0.mlp.gate_proj.qzeros"
    edit_tensors(llama, lambda t: t.update({name: mx.zeros((512, 2), dtype=mx.uint8)}))
    refused(llama, "model.safetensors", name, "unexpected tensor")


def test_declared_bias_that_is_missing_is_refused(qwen2):
    edit_tensors(qwen2, _delete("model.layers.0.self_attn.k_proj.bias"))
    refused(
        qwen2,
        "model.safetensors",
        "missing tensor model.layers.0.self_attn.k_proj.bias",
        "float32 [128]",
        "has_bias: true",
    )


def test_bias_stored_in_the_other_float_dtype_is_refused_not_cast(qwen2):
    # Either dtype is valid, but all biases share the first one's: a lone float16 bias among
    # float32 ones is a tensor rewritten in another dtype, whose values the model would not get.
    edit_tensors(qwen2, _retype("model.layers.0.self_attn.k_proj.bias", mx.float16))
    refused(
        qwen2,
        "model.layers.0.self_attn.k_proj.bias",
        "dtype float16 but expected float32 [128]",
        "model.layers.0.self_attn.q_proj.bias is float32",
    )


def test_bias_of_the_wrong_shape_is_refused(qwen2):
    edit_tensors(qwen2, _reshape("model.layers.0.self_attn.q_proj.bias", (128,)))
    refused(
        qwen2,
        "model.safetensors",
        "model.layers.0.self_attn.q_proj.bias",
        "shape [128]",
        "float16 or float32 [256]",
    )


def test_bias_not_declared_in_the_manifest_is_refused(qwen2):
    edit_json(
        qwen2,
        "bitnest.json",
        lambda m: m["layers"]["model.layers.0.self_attn.v_proj"].update(has_bias=False),
    )
    refused(
        qwen2,
        "model.safetensors",
        "model.layers.0.self_attn.v_proj.bias",
        "has_bias: false",
    )


# ---------------------------------------------------------------------------------------------
# Norms


def test_in_layer_norm_not_one_is_refused_as_unfused(llama):
    name = "model.layers.1.post_attention_layernorm.weight"
    edit_tensors(llama, lambda t: t.update({name: mx.full((256,), 1.5, dtype=mx.bfloat16)}))
    refused(llama, "model.safetensors", name, "not ~1", "unfused")


def test_final_norm_not_one_only_warns(llama):
    name = "model.norm.weight"
    edit_tensors(llama, lambda t: t.update({name: mx.full((256,), 2.0)}))
    with pytest.warns(UserWarning, match=r"model\.norm\.weight is not ~1"):
        bitnest.read(llama)


# ---------------------------------------------------------------------------------------------
# R4 Hadamard matrix (Qwen2 package: intermediate 384 = 12 · 32)


def _edit_had(fn):
    def edit(t):
        h = np.array(t["aux.had_K.12"])
        fn(h)
        t["aux.had_K.12"] = mx.array(h)

    return edit


def test_had_k_with_an_entry_not_plus_minus_one_is_refused(qwen2):
    edit_tensors(qwen2, _edit_had(lambda h: h.__setitem__((2, 5), 0.5 * h[2, 5])))
    refused(qwen2, "model.safetensors", "aux.had_K.12", "+1 or -1")


def test_had_k_that_is_not_hadamard_is_refused(qwen2):
    # Still all +-1, but one flipped sign breaks H·Hᵀ = K·I.
    edit_tensors(qwen2, _edit_had(lambda h: h.__setitem__((2, 5), -h[2, 5])))
    refused(qwen2, "model.safetensors", "aux.had_K.12", "H·Hᵀ = 12·I")


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (_delete("aux.had_K.12"), ["missing tensor aux.had_K.12", "float32 [12, 12]", "K = 12"]),
        (_retype("aux.had_K.12", mx.float16), ["aux.had_K.12", "expected float32 [12, 12]"]),
    ],
    ids=["missing", "fp16"],
)
def test_had_k_missing_or_mistyped_is_refused(qwen2, edit, fragments):
    edit_tensors(qwen2, edit)
    refused(qwen2, "model.safetensors", *fragments)


def test_online_hadamard_k_that_does_not_split_the_intermediate_size_is_refused(qwen2):
    layer = "model.layers.0.mlp.down_proj"
    edit_json(qwen2, "bitnest.json", lambda m: m["online_hadamard"]["layers"][layer].update(K=20))
    refused(qwen2, "bitnest.json", layer, "K = 20", "384 = K·2^k")


# ---------------------------------------------------------------------------------------------
# safetensors files


@pytest.mark.parametrize(
    "cut, fragments",
    [
        (lambda size: size // 2, ["truncated", "tensors need"]),
        (lambda size: 4, ["truncated", "8-byte header length"]),
        (lambda size: 20, ["truncated", "header says"]),
    ],
    ids=["half", "no-header-length", "inside-header"],
)
def test_truncated_safetensors_is_refused(llama, cut, fragments):
    f = llama / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: cut(len(data))])
    refused(llama, "model.safetensors", *fragments)


def test_safetensors_with_a_garbage_header_is_refused(llama):
    f = llama / "model.safetensors"
    header = b"not json at all"
    f.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    refused(llama, "model.safetensors", "unreadable safetensors header", "JSON")


def test_sharded_safetensors_with_an_index_loads(llama, built):
    weight_map = shard(llama)
    package = bitnest.read(llama)
    base = load_tensors(built["llama"][0])
    assert set(package.tensors) == set(base) == set(weight_map)
    for name in ("lm_head.hi", "model.layers.1.mlp.down_proj.scales", "model.embed_tokens.weight"):
        assert mx.array_equal(package.tensors[name], base[name]).item(), name
    # Both shards really hold tensors (otherwise this would not test sharding).
    assert len(set(weight_map.values())) == 2


def test_index_pointing_at_a_missing_shard_is_refused(llama):
    shard(llama)
    (llama / "model-00002-of-00002.safetensors").unlink()
    refused(
        llama,
        "model.safetensors.index.json",
        "model-00002-of-00002.safetensors",
        "does not exist",
    )


def test_index_that_misplaces_a_tensor_is_refused(llama):
    weight_map = shard(llama)
    name = next(n for n, f in weight_map.items() if f.startswith("model-00001"))
    edit_json(
        llama,
        "model.safetensors.index.json",
        lambda i: i["weight_map"].update({name: "model-00002-of-00002.safetensors"}),
    )
    refused(
        llama,
        "model.safetensors.index.json",
        name,
        "model-00002-of-00002.safetensors",
        "it is in model-00001-of-00002.safetensors",
    )


def test_missing_tensor_in_a_sharded_package_names_the_index(llama):
    shard(llama)
    f = llama / "model-00001-of-00002.safetensors"
    tensors = dict(mx.load(str(f)))
    name = sorted(tensors)[0]
    del tensors[name]
    mx.save_safetensors(str(f), tensors)
    edit_json(llama, "model.safetensors.index.json", lambda i: i["weight_map"].pop(name))
    refused(llama, "model.safetensors.index.json", f"missing tensor {name}", "expected")


def test_shards_without_an_index_are_refused(llama):
    shard(llama)
    (llama / "model.safetensors.index.json").unlink()
    refused(llama, str(llama), "sharded safetensors without model.safetensors.index.json")


def test_single_file_and_index_together_are_refused(llama, built):
    shard(llama)
    shutil.copy(built["llama"][0] / "model.safetensors", llama / "model.safetensors")
    refused(llama, "both model.safetensors and model.safetensors.index.json")


# ---------------------------------------------------------------------------------------------
# Writer


def skeleton(manifest: dict, where: tuple = ()) -> dict:
    """The key tree of a manifest, per-layer objects reduced to the keys of their entries."""
    out = {}
    for key, value in manifest.items():
        path = (*where, key)
        if path in PER_LAYER_KEYS:
            entries = list(value.values())
            keys = [frozenset(e) if isinstance(e, dict) else frozenset() for e in entries]
            # The keys every entry has: one entry lacking a key drops it from the skeleton.
            out[key] = PerLayer(frozenset.intersection(*keys) if keys else ())
        elif isinstance(value, dict):
            out[key] = skeleton(value, path)
        else:
            out[key] = None
    return out


def missing_keys(want: dict, have: dict, where: str = "") -> list[str]:
    """Keys of skeleton `want` absent from skeleton `have` (recursively)."""
    missing = []
    for key, sub in want.items():
        path = f"{where}.{key}".lstrip(".")
        if key not in have:
            missing.append(path)
        elif isinstance(sub, PerLayer):
            if not isinstance(have[key], PerLayer):
                missing.append(f"{path} (not a per-layer object)")
            elif sub - have[key]:
                missing.append(f"{path}: some entry lacks {sorted(sub - have[key])}")
        elif isinstance(sub, dict):
            if not isinstance(have[key], dict):
                missing.append(f"{path} (not an object)")
            else:
                missing += missing_keys(sub, have[key], path)
    return missing


def test_seed_skeleton_matches_the_seed_manifest():
    if not SEED_MANIFEST.is_file():
        pytest.skip(f"{SEED_MANIFEST} not available")
    seed = json.loads(SEED_MANIFEST.read_text(encoding="utf-8"))
    assert skeleton(seed) == SEED_SKELETON
    groups = seed["activation"]["per_layer_group"]
    assert {lin: groups[f"model.layers.0.{lin}"] for lin in LAYER_LINEARS} == SEED_GROUPS
    assert "lm_head" in seed["layers"] and "lm_head" not in groups


def test_written_manifest_has_every_key_of_the_seed_manifest(built):
    pkg, _, config = built["llama"]
    ours = read_json(pkg, "bitnest.json")
    assert missing_keys(SEED_SKELETON, skeleton(ours)) == []
    # ... with this model's values, not the seed's.
    assert ours["format"] == "bitnest-package-v1"
    assert (ours["model"], ours["arch"]) == ("tiny-llama", "llama")
    assert ours["source_model"] == "tests.factory"
    assert (ours["group_size"], ours["pack"]) == (128, "unsigned+8")
    assert ours["rope"] == {
        "theta": config["rope_theta"],
        "scaling": config["rope_scaling"],
        "max_position_embeddings": config["max_position_embeddings"],
    }
    assert ours["norms"]["fused"] is True and ours["norms"]["decoder_norms_identity"] is True


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_layers_cover_every_linear_and_lm_head(built, arch):
    pkg, _, config = built[arch]
    biased = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} if arch == "qwen2" else ()
    expected = {
        name: {
            "shape": shape,
            "groups": shape[1] // 128,
            "has_bias": name.split(".", 3)[-1] in biased,
        }
        for name, shape in linear_shapes(config).items()
    }
    assert read_json(pkg, "bitnest.json")["layers"] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_activation_groups_cover_every_linear_but_lm_head_like_the_seed(built, arch):
    pkg, _, config = built[arch]
    groups = read_json(pkg, "bitnest.json")["activation"]["per_layer_group"]
    assert set(groups) == set(linear_shapes(config)) - {"lm_head"}
    for name, group in groups.items():
        # Same per-Linear pattern as the seed: o_proj grouped per head, the rest per token.
        assert group == SEED_GROUPS[name.split(".", 3)[-1]], name


@pytest.mark.parametrize("arch, k", [("llama", 1), ("qwen2", 12)])
def test_online_hadamard_lists_every_down_proj_with_the_models_k(built, arch, k):
    pkg, _, config = built[arch]
    layers = read_json(pkg, "bitnest.json")["online_hadamard"]["layers"]
    n = config["num_hidden_layers"]
    assert layers == {f"model.layers.{i}.mlp.down_proj": {"K": k, "fp32": False} for i in range(n)}
    tensors = load_tensors(pkg)
    had = [name for name in tensors if name.startswith("aux.had_K.")]
    if k == 1:
        assert had == []
    else:
        assert had == [f"aux.had_K.{k}"]
        assert np.array_equal(np.array(tensors[had[0]]), hadamard_k(k))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_config_is_bitnest_with_the_models_dims_and_no_quantization(built, arch):
    pkg, _, config = built[arch]
    written = read_json(pkg, "config.json")
    assert written["model_type"] == "bitnest" and written["arch"] == arch
    assert not {"quantization", "quantization_config"} & set(written)
    assert written["tie_word_embeddings"] is False
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
    ):
        assert written[key] == config[key], key


def _planes(tensors, name, draft):
    return bitnest.dequantize_planes(
        np.array(tensors[f"{name}.hi"]),
        np.array(tensors[f"{name}.lo"]),
        np.array(tensors[f"{name}.scales"]),
        draft=draft,
    )


def _scale_per_column(tensors, name):
    return np.repeat(np.array(tensors[f"{name}.scales"], dtype=np.float64), 128, axis=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_planes_hold_the_norm_folded_weights(built, arch):
    pkg, w, config = built[arch]
    t = bitnest.read(pkg).tensors
    p = "model.layers.0."
    folded = {
        "self_attn.q_proj": w[p + "self_attn.q_proj.weight"] * w[p + "input_layernorm.weight"],
        "mlp.up_proj": w[p + "mlp.up_proj.weight"] * w[p + "post_attention_layernorm.weight"],
        "self_attn.o_proj": w[p + "self_attn.o_proj.weight"],
    }
    for lin, want in folded.items():
        s = _scale_per_column(t, p + lin)
        # RTN: W8 within half its step s/16; W4, the W8 code's hi nibble, within s/2 + s/32.
        assert np.all(np.abs(_planes(t, p + lin, draft=True) - want) <= s * 17 / 32 * (1 + 1e-3))
        assert np.all(np.abs(_planes(t, p + lin, draft=False) - want) <= s / 32 * (1 + 1e-2))
    head = w["lm_head.weight"] * w["model.norm.weight"]
    s = _scale_per_column(t, "lm_head")
    assert np.all(np.abs(_planes(t, "lm_head", draft=False) - head) <= s / 32 * (1 + 1e-2))
    embed = np.array(t["model.embed_tokens.weight"].astype(mx.float32))
    assert np.array_equal(
        embed,
        np.array(mx.array(w["model.embed_tokens.weight"]).astype(mx.bfloat16).astype(mx.float32)),
    )
    if arch == "qwen2":
        assert np.allclose(np.array(t[p + "self_attn.k_proj.bias"]), w[p + "self_attn.k_proj.bias"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_down_proj_undoes_the_online_hadamard(built, arch):
    # The runtime feeds down_proj R4(a); the stored W' must give W' R4(a) = W a (up to W8 RTN).
    pkg, w, config = built[arch]
    t = bitnest.read(pkg).tensors
    had = np.array(t["aux.had_K.12"], dtype=np.float64) if arch == "qwen2" else None
    name = "model.layers.0.mlp.down_proj"
    a = np.random.default_rng(1).normal(size=(4, config["intermediate_size"]))
    want = a @ w[f"{name}.weight"].T.astype(np.float64)
    got = r4_transform(a, had) @ _planes(t, name, draft=False).T
    assert np.abs(got - want).max() <= 0.02 * np.abs(want).max()
    # Without the transform the stored weight is a different matrix: the check above has teeth.
    assert np.abs(a @ _planes(t, name, draft=False).T - want).max() > 0.5 * np.abs(want).max()


def test_lm_head_note_carries_plausible_rtn_diagnostics(built):
    pkg, w, _ = built["llama"]
    note = read_json(pkg, "bitnest.json")["lm_head_note"]
    sat = float(re.search(r"residual saturation ([0-9.]+)%", note).group(1))
    w8_err = float(re.search(r"W8 max relative error ([0-9.e+-]+),", note).group(1))
    w4_err = float(re.search(r"W4 relative Frobenius error ([0-9.]+)", note).group(1))
    # The hi code is the W8 code's hi nibble, so no residual clips (the seed's round(w/s)-first
    # rule clips 3.1 %: residuals in [7.5, 8] steps).
    assert sat == 0
    # The note's numbers are the stored lm_head's own: recompute them from the planes.
    t = load_tensors(pkg)
    head = (w["lm_head.weight"] * w["model.norm.weight"]).astype(np.float64)
    w4, w8 = _planes(t, "lm_head", draft=True), _planes(t, "lm_head", draft=False)
    assert w4_err == pytest.approx(np.linalg.norm(w4 - head) / np.linalg.norm(head), abs=1e-3)
    assert w8_err == pytest.approx(np.abs(w8 - head).max() / np.abs(head).max(), rel=1e-2)
    assert 0.09 < w4_err < 0.14  # seed: 0.117 on its lm_head
    assert 0 < w8_err <= 1 / 232  # half a W8 step, s/32 with s <= amax/7.4375


def test_write_refuses_a_missing_weight_before_writing(tmp_path):
    weights, config = float_weights()
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(PackageError, match=r"missing float weight model\.layers\.1\.mlp\.up_proj"):
        write_package(tmp_path / "out", weights, config)
    assert not (tmp_path / "out").exists()


def test_write_refuses_k_not_a_multiple_of_128(tmp_path):
    weights, config = float_weights(intermediate=200)
    with pytest.raises(PackageError, match=r"model\.layers\.0\.mlp\.down_proj\.weight.*128"):
        write_package(tmp_path / "out", weights, config)


def test_write_refuses_a_weight_whose_shape_disagrees_with_the_config(tmp_path):
    weights, config = float_weights()
    config["vocab_size"] = 300
    with pytest.raises(PackageError, match=r"lm_head\.weight has shape \[257, 256\].*\[300, 256\]"):
        write_package(tmp_path / "out", weights, config)


def test_write_quantize_callback_gets_every_stored_weight_in_forward_order(tmp_path):
    weights, config = float_weights("qwen2", n_layers=2, intermediate=384)
    calls = []

    def quantize(name, w):
        calls.append((name, np.array(w, dtype=np.float64)))
        # All-zero hi codes: the written planes must visibly be this callback's.
        return bitnest.planes_from_codes(w, np.zeros(w.shape), None)

    notes = {"method": "test", "per_linear": {"lm_head": {"saturation": 0.5}}}
    pkg = write_package(tmp_path / "out", weights, config, quantize=quantize, notes=notes)
    assert [n for n, _ in calls] == list(linear_shapes(config))
    got = dict(calls)
    p = "model.layers.1."
    want_q = weights[p + "self_attn.q_proj.weight"] * weights[p + "input_layernorm.weight"]
    assert np.allclose(got[p + "self_attn.q_proj"], want_q, rtol=1e-6)
    want_down = r4_transform(weights[p + "mlp.down_proj.weight"], hadamard_k(12))
    assert np.allclose(got[p + "mlp.down_proj"], want_down, atol=1e-7)
    package = bitnest.read(pkg)
    assert np.all(np.array(package.tensors[p + "self_attn.q_proj.hi"]) == 0x88)  # u = 0 + 8
    assert package.manifest["conversion"] == notes


def test_planes_from_codes_without_codes_is_rtn():
    w = np.random.default_rng(3).normal(0, 0.02, (64, 256)).astype(np.float32)
    rtn, planes = bitnest.quantize_planes(w), bitnest.planes_from_codes(w)
    for field in ("hi", "lo", "scales"):
        assert np.array_equal(getattr(rtn, field), getattr(planes, field)), field


def test_planes_from_codes_keeps_lo_the_residual_of_the_original_weight():
    rng = np.random.default_rng(4)
    w = rng.normal(0, 0.02, (64, 256)).astype(np.float32)
    rtn = bitnest.quantize_planes(w)
    q4 = bitnest.unpack_nibbles(rtn.hi).astype(np.int64) - 8
    # GPTQ-like codes: off the nearest code by one step in places, and -8 for a whole row.
    codes = np.clip(q4 + rng.integers(-1, 2, q4.shape), -8, 7)
    codes[5] = -8
    planes = bitnest.planes_from_codes(w, codes, rtn.scales)
    assert np.array_equal(bitnest.unpack_nibbles(planes.hi).astype(np.int64) - 8, codes)
    qr = bitnest.unpack_nibbles(planes.lo).astype(np.int64) - 8
    assert np.all(16 * codes + qr >= -128)  # where q4 = -8 the residual stays >= 0
    s = np.repeat(rtn.scales.astype(np.float64), 128, axis=-1)
    w8 = bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=False)
    ok = np.abs(qr) < 7  # unsaturated residuals land within half a residual step
    assert np.all(np.abs(w8 - w)[ok] <= s[ok] / 32 * (1 + 1e-3))
    assert planes.saturation > rtn.saturation  # off-nearest codes saturate more residuals


def test_write_reads_rope_from_a_transformers5_config_dict(tmp_path):
    weights, config = float_weights(n_layers=1)
    scaling = config.pop("rope_scaling")
    config["rope_parameters"] = {**scaling, "rope_theta": config.pop("rope_theta")}
    package = bitnest.read(write_package(tmp_path / "out", weights, config))
    assert package.manifest["rope"]["theta"] == 500000.0
    assert package.manifest["rope"]["scaling"] == scaling
    assert (package.config["rope_theta"], package.config["rope_scaling"]) == (500000.0, scaling)


# ---------------------------------------------------------------------------------------------
# Integer maps and the docs


def test_nibble_packing_puts_even_columns_in_the_low_nibble():
    u = np.array([[1, 2, 15, 0, 7, 8]], dtype=np.uint8)
    packed = bitnest.pack_nibbles(u)
    assert packed.tolist() == [[0x21, 0x0F, 0x87]]
    assert np.array_equal(bitnest.unpack_nibbles(packed), u)


def test_docs_example_runs(tmp_path, monkeypatch):
    doc = (REPO / "docs" / "bitnest-package.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks, "docs/bitnest-package.md has no python example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/bitnest-package.md", "exec"), {"__name__": "__doc_example__"})


def test_kv_group_that_mlx_cannot_quantize_with_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m["kv"].update(group=48))
    refused(llama, "bitnest.json", "kv.group = 48", "(32, 64, 128)")


def test_writer_records_r3_and_kv_group_and_the_model_uses_them(tmp_path):
    import bitnest_mlx

    weights, config = float_weights(n_layers=1)
    pkg = write_package(tmp_path / "out", weights, config, r3=True, kv_group=32)
    kv = bitnest.read(pkg).manifest["kv"]
    assert kv["r3"] is True and kv["group"] == 32
    model, _ = bitnest_mlx.load(pkg)
    assert model.args.r3 and model.args.kv_group == 32
    assert model.make_cache()[0].group_size == 32


# ---------------------------------------------------------------------------------------------
# Weight group sizes (§2.1: group_size 32, 64 or 128)


@pytest.fixture(scope="session")
def grouped(tmp_path_factory) -> dict:
    """A 1-layer Llama package at each smaller weight group (the other packages here are 128)."""
    root = tmp_path_factory.mktemp("grouped")
    return {g: make_package(root / f"g{g}", n_layers=1, group_size=g) for g in (64, 32)}


@pytest.mark.parametrize("group", [64, 32])
def test_written_package_at_a_smaller_group_size_round_trips(grouped, group):
    pkg, w, config = grouped[group]
    package = bitnest.read(pkg)
    assert package.manifest["group_size"] == group and package.spec.group_size == group
    for name, entry in package.manifest["layers"].items():
        n, k = entry["shape"]
        assert entry["groups"] == k // group, name
        assert package.tensors[f"{name}.scales"].shape == (n, k // group), name
    # The planes hold the norm-folded weight to RTN accuracy on the finer group's scales.
    t, lin = package.tensors, "model.layers.0.self_attn.q_proj"
    want = w[lin + ".weight"] * w["model.layers.0.input_layernorm.weight"]
    s = np.repeat(np.array(t[f"{lin}.scales"], dtype=np.float64), group, axis=-1)
    assert np.all(np.abs(_planes(t, lin, draft=False) - want) <= s / 32 * (1 + 1e-2))
    assert f"{group} columns" in package.manifest["weight_planes"]["draft"]


@pytest.mark.parametrize("value", [48, 256, "128", 128.0, None])
def test_group_size_other_than_32_64_128_is_refused(llama, value):
    edit_json(llama, "bitnest.json", lambda m: m.update(group_size=value))
    refused(llama, "bitnest.json", f"group_size = {value!r}", "expected one of (32, 64, 128)")


def test_groups_entry_that_disagrees_with_group_size_is_refused(llama):
    edit_json(llama, "bitnest.json", lambda m: m.update(group_size=64))
    refused(llama, "bitnest.json", "model.layers.0.self_attn.q_proj", "groups = 2", "K/64 = 4")


def test_scales_that_disagree_with_group_size_are_refused(llama):
    def edit(m):
        m["group_size"] = 64
        for entry in m["layers"].values():
            entry["groups"] = entry["shape"][1] // 64

    edit_json(llama, "bitnest.json", edit)
    refused(
        llama,
        "model.safetensors",
        "tensor model.layers.0.self_attn.q_proj.scales",
        "shape [256, 2] but expected float16 [256, 4]",
        "group_size 64",
    )


def test_k_not_a_multiple_of_the_group_size_is_refused(grouped, tmp_path):
    pkg = copy_package(grouped[64][0], tmp_path / "g64")
    edit_json(pkg, "bitnest.json", lambda m: m["layers"]["lm_head"].update(shape=[257, 96]))
    refused(pkg, "bitnest.json", "lm_head", "K = 96", "multiple of 64")


def test_choose_group_size_prefers_128_and_names_the_k_it_cannot_split():
    assert bitnest.choose_group_size([256, 384]) == 128
    assert bitnest.choose_group_size([256, 192]) == 64
    assert bitnest.choose_group_size([256, 96]) == 32
    assert bitnest.choose_group_size([256, 384], requested=32) == 32
    with pytest.raises(ValueError, match="K = 80"):
        bitnest.choose_group_size([256, 80])
    with pytest.raises(ValueError, match="K = 96"):
        bitnest.choose_group_size([256, 96], requested=64)
    with pytest.raises(ValueError, match=r"group_size 48.*\(32, 64, 128\)"):
        bitnest.choose_group_size([256], requested=48)


def test_planes_from_codes_reads_the_group_from_the_scales():
    w = np.random.default_rng(5).normal(0, 0.02, (8, 256)).astype(np.float32)
    rtn = bitnest.quantize_planes(w, 32)
    assert rtn.scales.shape == (8, 8)
    assert np.array_equal(rtn.scales, bitnest.weight_scales(w, 32))
    codes = bitnest.unpack_nibbles(rtn.hi).astype(np.int64) - 8
    again = bitnest.planes_from_codes(w, codes, rtn.scales)  # group 32, from the scales' shape
    assert np.array_equal(again.lo, rtn.lo)
    with pytest.raises(ValueError, match=r"expected \[8, 4\]"):
        bitnest.planes_from_codes(w, codes, rtn.scales, group_size=64)
    with pytest.raises(ValueError, match="group_size 48"):
        bitnest.quantize_planes(w, 48)


def _planes_for(config: dict, groups: dict[str, int]) -> dict[str, bitnest.Planes]:
    rng = np.random.default_rng(6)
    return {
        lin: bitnest.quantize_planes(rng.normal(0, 0.02, shape).astype(np.float32), groups[lin])
        for lin, shape in bitnest.linear_shapes(config).items()
    }


def test_writer_infers_the_group_and_refuses_planes_that_disagree(tmp_path):
    _, config = float_weights(n_layers=1)
    lins = bitnest.linear_shapes(config)
    kw = dict(biases={}, embed=np.zeros((257, 256), np.float32), had_k=None)
    pkg = bitnest.writer.write(
        tmp_path / "g32", config, _planes_for(config, dict.fromkeys(lins, 32)), **kw
    )
    assert bitnest.read(pkg).spec.group_size == 32
    mixed = _planes_for(config, {**dict.fromkeys(lins, 128), "lm_head": 64})
    with pytest.raises(PackageError, match="expected one group size for every Linear"):
        bitnest.writer.write(tmp_path / "mixed", config, mixed, **kw)
    with pytest.raises(PackageError, match="group_size 48"):
        bitnest.writer.write(tmp_path / "g48", config, mixed, group_size=48, **kw)
    assert not (tmp_path / "g48").exists()
