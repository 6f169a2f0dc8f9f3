"""Converter inputs (convert/sources.py, rope.py): HF safetensors read one tensor at a time
with HF names and float32 values, configs completed (RoPE included), and memory that stays at
the tensor in use. GGUF files: test_gguf_source.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from factory import float_weights, state, tiny_dims, tiny_hf  # noqa: E402

from bitnest_mlx.convert.rope import rope_params  # noqa: E402
from bitnest_mlx.convert.sources import Source, SourceError, load_hf  # noqa: E402

# Llama 3.2's RoPE scaling (theta 500000, head_dim 128).
LLAMA32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_rope_params_reads_transformers_5_and_older_configs():
    assert rope_params({}) == (10000.0, None)
    assert rope_params({"rope_theta": 1e6, "rope_scaling": None}) == (1e6, None)
    v5 = {"rope_parameters": {"rope_theta": 500000.0, **LLAMA32}}
    assert rope_params(v5) == (500000.0, LLAMA32)
    assert rope_params({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}) == (
        1e6,
        None,
    )
    old = {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert rope_params(old) == (1e4, {"rope_type": "linear", "factor": 2.0})
    # A config transformers 5 wrote from a tiny Llama 3 model, through load_hf's completion.
    config = Source.from_arrays({}, tiny_hf("llama").config.to_dict()).config
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"]["rope_type"] == "llama3"


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hf_checkpoint_tensors_are_its_values_as_float32(tmp_path, dtype):
    model = tiny_hf("llama").to(getattr(torch, dtype))
    model.save_pretrained(tmp_path / "hf")
    want = {k: v.float().numpy() for k, v in model.state_dict().items()}
    with load_hf(tmp_path / "hf") as source:
        assert sorted(source.names()) == sorted(want)
        for k, v in want.items():
            got = source.tensor(k)
            assert got.dtype == np.float32 and source.shape(k) == v.shape
            np.testing.assert_array_equal(got, v, err_msg=k)
        assert source.config["rope_scaling"]["rope_type"] == "llama3"
        assert source.config["head_dim"] == 128 and source.tokenizer_dir == tmp_path / "hf"


def test_hf_tied_embedding_has_no_lm_head(tmp_path):
    model = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**tiny_dims(), "tie_word_embeddings": True})
    )
    model.save_pretrained(tmp_path / "hf")
    source = load_hf(tmp_path / "hf")
    assert "lm_head.weight" not in source.names()
    assert source.config["tie_word_embeddings"] is True


def test_hf_sharded_checkpoint_reads_its_index_and_nothing_beside_it(tmp_path):
    from safetensors.numpy import save_file

    model = tiny_hf("qwen2")
    model.save_pretrained(tmp_path / "hf", max_shard_size="300KB")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    # Another format's weights beside the shards (Mistral repos ship consolidated.safetensors).
    save_file({"layers.0.attention.wq.weight": np.ones((2, 2), np.float32)},
              str(tmp_path / "hf" / "consolidated.safetensors"))  # fmt: skip
    source = load_hf(tmp_path / "hf")
    assert sorted(source.names()) == sorted(state(model))
    np.testing.assert_array_equal(
        source.tensor("model.layers.1.mlp.down_proj.weight"),
        state(model)["model.layers.1.mlp.down_proj.weight"],
    )


def write_safetensors(f: Path, tensors: dict[str, tuple[str, tuple, bytes]]) -> None:
    """A safetensors file from (dtype, shape, raw bytes) per tensor, written by the spec."""
    header, offset = {}, 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(f, "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        for _, _, raw in tensors.values():
            out.write(raw)


def hf_dir(path: Path, tensors: dict, config: dict | None = None) -> Path:
    path.mkdir()
    _, config0 = float_weights("llama", n_layers=1)
    (path / "config.json").write_text(json.dumps({**config0, **(config or {})}))
    write_safetensors(path / "model.safetensors", tensors)
    return path


def test_hf_refuses_other_dtypes_naming_file_and_tensor(tmp_path):
    d = hf_dir(tmp_path / "hf", {"model.norm.weight": ("I8", (4,), bytes(4))})
    with pytest.raises(SourceError, match=r"model\.safetensors: tensor model\.norm\.weight has "):
        load_hf(d)


def test_hf_bfloat16_bits_become_the_float32_they_are_the_top_half_of(tmp_path):
    bits = np.random.default_rng(0).integers(0, 2**16, 64, dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0  # no inf/nan, so equality is plain
    d = hf_dir(tmp_path / "hf", {"w": ("BF16", (8, 8), bits.tobytes())})
    want = (bits.astype(np.uint32) << 16).view(np.float32).reshape(8, 8)
    np.testing.assert_array_equal(load_hf(d).tensor("w"), want)


@pytest.mark.parametrize(
    "saved_as, name",
    [("meta-llama/Llama-3.2-3B", "meta-llama/Llama-3.2-3B"), ("/home/me/llama", "hf"),
     ("./llama", "hf"), ("", "hf"), (None, "hf")],
)  # fmt: skip
def test_hf_name_is_the_hub_id_never_a_local_path(tmp_path, saved_as, name):
    d = hf_dir(tmp_path / "hf", {"w": ("F32", (1,), bytes(4))}, {"_name_or_path": saved_as})
    source = load_hf(d)
    assert source.name == name and "_name_or_path" not in source.config


def test_hf_without_config_or_weights_is_refused_by_name(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(SourceError, match=r"a: no config\.json"):
        load_hf(tmp_path / "a")
    d = hf_dir(tmp_path / "b", {})
    (d / "model.safetensors").unlink()
    with pytest.raises(SourceError, match=r"b: no \*\.safetensors files"):
        load_hf(d)
    (d / "model.safetensors").write_bytes(b"\x01")
    with pytest.raises(SourceError, match=r"model\.safetensors: truncated safetensors file"):
        load_hf(d)


# ---------------------------------------------------------------------------------------------
# Memory: reading every tensor in turn needs about one tensor, not the checkpoint

MEASURE = """
import resource, sys
from pathlib import Path
from bitnest_mlx.convert.sources import load_gguf, load_hf
path = Path(sys.argv[1])
source = load_hf(path) if path.is_dir() else load_gguf(path, path.parent / "tok")
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
start, top, total = rss(), 0, 0
for name in source.names():
    w = source.tensor(name)
    total += w.nbytes
    top = max(top, rss())
    del w
print(top - start, total)
"""


def growth(path: Path) -> tuple[int, int]:
    """(largest RSS growth between reads, float32 bytes of all tensors) in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="RSS read from /proc")
def test_reading_tensor_by_tensor_keeps_memory_at_one_tensor(tmp_path):
    one = 2048 * 2048  # 16 MB as float32
    raw = np.zeros(one, np.uint16).tobytes()
    tensors = {
        f"model.layers.{i}.mlp.up_proj.weight": ("BF16", (2048, 2048), raw) for i in range(12)
    }
    grew, total = growth(hf_dir(tmp_path / "hf", tensors))
    assert total == 12 * 4 * one and grew < 3 * 4 * one, grew
