"""Tiny bitnest packages from seeded random float weights, and helpers to break them in tests.

The packages are real `bitnest.write` output (hidden 256, head_dim 128), small enough to build
in well under a second, so every test can work on its own copy.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from bitnest_mlx.formats import bitnest

# Llama 3 style rope scaling, so a written manifest's rope block has every key the seed has.
LLAMA3_ROPE = {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}


def float_weights(
    arch: str = "llama",
    *,
    n_layers: int = 2,
    hidden: int = 256,
    intermediate: int = 512,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 128,
    vocab: int = 257,
    seed: int = 0,
    llama3_rope: bool = True,
) -> tuple[dict[str, np.ndarray], dict]:
    """HF-named float32 weights and an HF config for a tiny Llama or Qwen2.

    Norm gammas are random (not 1) so that folding them into the Linears is observable; Qwen2
    gets q/k/v biases; lm_head is untied Gaussian (RTN statistics are known for it). Llama gets
    Llama 3 rope scaling unless `llama3_rope` is False.
    """
    rng = np.random.default_rng(seed)
    config = {
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5 if arch == "llama" else 1e-6,
        "rope_theta": 500000.0 if arch == "llama" else 1000000.0,
        "rope_scaling": dict(LLAMA3_ROPE) if arch == "llama" and llama3_rope else None,
        "max_position_embeddings": 2048,
    }
    q, kv = heads * head_dim, kv_heads * head_dim
    w = {
        "model.embed_tokens.weight": rng.normal(0, 1, (vocab, hidden)),
        "lm_head.weight": rng.normal(0, 0.02, (vocab, hidden)),
        "model.norm.weight": rng.uniform(0.5, 1.5, hidden),
    }
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (q, hidden)),
            ("self_attn.k_proj", (kv, hidden)),
            ("self_attn.v_proj", (kv, hidden)),
            ("self_attn.o_proj", (hidden, q)),
            ("mlp.gate_proj", (intermediate, hidden)),
            ("mlp.up_proj", (intermediate, hidden)),
            ("mlp.down_proj", (hidden, intermediate)),
        ):
            w[f"{p}{name}.weight"] = rng.normal(0, 0.02, shape)
        if arch == "qwen2":
            for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                w[f"{p}self_attn.{name}.bias"] = rng.normal(0, 0.1, n)
        w[p + "input_layernorm.weight"] = rng.uniform(0.5, 1.5, hidden)
        w[p + "post_attention_layernorm.weight"] = rng.uniform(0.5, 1.5, hidden)
    return {k: v.astype(np.float32) for k, v in w.items()}, config


def make_package(
    out: Path, arch: str = "llama", *, tokenizer: bool = False, **dims
) -> tuple[Path, dict[str, np.ndarray], dict]:
    """Write a package to `out`; returns (path, the float weights, the HF config).

    With `tokenizer`, the demo's byte-level tokenizer is written too (its vocab is 257), so the
    package also loads through `bitnest_mlx.load`.
    """
    from bitnest_mlx.demo import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        dims["vocab"] = write_tokenizer(out)
    weights, config = float_weights(arch, **dims)
    bitnest.write(out, weights, config, name=f"tiny-{arch}", source_model="tests.package_factory")
    return out, weights, config


def copy_package(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def load_tensors(pkg: Path, file: str = "model.safetensors") -> dict[str, mx.array]:
    return dict(mx.load(str(pkg / file)))


def save_tensors(pkg: Path, tensors: dict[str, mx.array], file: str = "model.safetensors") -> None:
    mx.save_safetensors(str(pkg / file), tensors, metadata={"format": "mlx"})


def edit_tensors(pkg: Path, edit: Callable[[dict[str, mx.array]], None]) -> None:
    """Rewrite model.safetensors after `edit` mutates the name -> array dict in place."""
    tensors = load_tensors(pkg)
    edit(tensors)
    save_tensors(pkg, tensors)


def read_json(pkg: Path, file: str) -> dict:
    return json.loads((pkg / file).read_text(encoding="utf-8"))


def edit_json(pkg: Path, file: str, edit: Callable[[dict], None]) -> None:
    """Rewrite a JSON file of the package after `edit` mutates it in place."""
    data = read_json(pkg, file)
    edit(data)
    (pkg / file).write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def shard(pkg: Path, n_shards: int = 2) -> dict[str, str]:
    """Split model.safetensors into HF-style shards plus model.safetensors.index.json."""
    tensors = load_tensors(pkg)
    names = sorted(tensors)
    weight_map = {}
    for s in range(n_shards):
        file = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = names[s::n_shards]
        save_tensors(pkg, {n: tensors[n] for n in part}, file)
        weight_map.update(dict.fromkeys(part, file))
    (pkg / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (pkg / bitnest.INDEX_NAME).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return weight_map
