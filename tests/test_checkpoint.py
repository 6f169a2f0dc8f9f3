"""make_checkpoint: a seeded random Llama checkpoint that transformers, mlx-lm's tokenizer loader
and the converter's reader accept, sharded and indexed like a Hugging Face one."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bitnest_mlx.convert.checkpoint import PRESETS, make_checkpoint, tensor_shapes


def shard_headers(path: Path) -> dict[str, dict]:
    """safetensors headers of every shard, by file name."""
    out = {}
    for f in sorted(path.glob("model-*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        out[f.name] = header
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # A small shard limit, so the tiny model spans several shards like the real one.
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny", tiny=True, shard_bytes=2**19, progress=False
    )


def test_tiny_checkpoint_loads_in_transformers_with_llama3_rope(tiny):
    import torch
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(
        tiny, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    config = json.loads((tiny / "config.json").read_text())
    assert config["rope_parameters"] == PRESETS["llama-3.2-3b"]["rope_parameters"]
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert config["tie_word_embeddings"] and config["model_type"] == "llama"
    logits = model(torch.tensor([[config["bos_token_id"], 5, 300, 7]])).logits
    assert torch.isfinite(logits).all()


def test_index_lists_every_tensor_once_in_bf16_shards(tiny):
    headers = shard_headers(tiny)
    assert len(headers) > 1
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    config = json.loads((tiny / "config.json").read_text())
    shapes = tensor_shapes(config)
    stored = [(name, file) for file, h in headers.items() for name in h]
    assert sorted(stored) == sorted(index["weight_map"].items())
    assert sorted(index["weight_map"]) == sorted(shapes)  # each once: dict keys vs the list
    assert len(stored) == len(shapes)
    total = 0
    for h in headers.values():
        for name, t in h.items():
            assert t["dtype"] == "BF16" and tuple(t["shape"]) == shapes[name]
            total += t["data_offsets"][1] - t["data_offsets"][0]
    assert index["metadata"]["total_size"] == total


def weights(path: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    out = {}
    for f in path.glob("model-*.safetensors"):
        out.update({k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(f)).items()})
    return out


def test_weights_are_seeded_and_independent_of_sharding(tiny, tmp_path):
    one = make_checkpoint(tmp_path / "one", tiny=True, progress=False)
    assert len(shard_headers(one)) == 1
    a, b = weights(tiny), weights(one)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    w = a["model.layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std() < 0.025
    norm = a["model.layers.1.input_layernorm.weight"]
    assert 0.5 < np.median(norm) < 2 and norm.max() > 3  # around 1, with outlier channels
    other = make_checkpoint(tmp_path / "seed1", tiny=True, seed=1, progress=False)
    assert not np.array_equal(weights(other)["model.norm.weight"], a["model.norm.weight"])


def test_tokenizer_encodes_english_within_the_vocabulary(tiny):
    from mlx_lm.tokenizer_utils import load

    config = json.loads((tiny / "config.json").read_text())
    tok = load(tiny)
    text = "The converter calibrates every Linear on a few thousand tokens of English."
    ids = tok.encode(text)
    assert ids[0] == config["bos_token_id"] and max(ids) < config["vocab_size"]
    assert tok.decode(ids[1:]) == text
    assert tok.eos_token_id == config["eos_token_id"]


def test_cli_writes_a_checkpoint_and_refuses_an_existing_directory(tmp_path):
    cmd = [sys.executable, "-m", "bitnest_mlx.convert", "make-checkpoint", "--tiny"]
    done = subprocess.run([*cmd, "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "c" / "model.safetensors.index.json").is_file()
    again = subprocess.run([*cmd, "--out", str(tmp_path / "c")], capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr
    assert not list(tmp_path.glob(".*partial"))
