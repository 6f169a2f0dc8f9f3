"""Synthetic DeepSeek-V4 bundles at real per-layer dimensions, written without holding them.

`write(path, layers=N)` writes a jang-layout bundle with DeepSeek-V4-Flash's dimensions (hidden
4096, 256 experts of intermediate 2048, 64 heads of 512, 64 indexer heads, hc_mult 4, vocab
129280) but only N layers: layers `first_layer …` of the Flash schedule, with that schedule's
compress ratios and its q3.4 routed bit plan (2/4-bit MXTQ), affine 8-bit group 32 elsewhere.
Weights are random: MXTQ codes are uniform random words with row norms near 1 (no encoder runs),
affine codes uniform with scales that give each row a variance of 1/in_features. The bundle is
for measuring memory and speed, not text.

Tensors are generated and written one at a time (expert stacks a few experts at a time) straight
into safetensors shards of at most `max_shard_bytes`, so writing a 6 GB bundle holds tens of MB.
`tiny=True` gives the same layout at the dimensions of TINY_CONFIG (the one toy DeepSeek-V4
config, which the demo bundle and the tests use too). No checksum block: the weights are
noise, and hashing gigabytes at every load would only slow the measurements down.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import mxtq
from .dsv4_bundle import INDEX_FILE, plan_key, schedule, stored_expert_name
from .dsv4_bundle_write import _F32_PASSTHROUGH

# DeepSeek-V4-Flash as its MLX q3.4 bundle's config.json states it (seed:
# dsv4f-mlx-tq-q3.4.config.json); only the per-model fields that shape tensors or the math.
FLASH_CONFIG: dict = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "num_hash_layers": 3,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_parameters": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "rope_type": "yarn",
        "rope_theta": 10000.0,
    },
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": [1, 128803],
    "mxtq_seed": 42,
}

# The one toy DeepSeek-V4 config (the demo bundle, the DSV4 tests, `tiny=True`): every feature
# of the family at toy size: hash layers 0-2, ratios 0/4/128, index_topk smaller
# than the compressed pool after 24 tokens, 16 indexer heads (few heads make exact score ties).
TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 96,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 32,
    "o_lora_rank": 32,
    "o_groups": 2,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_shared_experts": 1,
    "num_hash_layers": 3,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "swiglu_limit": 10.0,
    "sliding_window": 8,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "compress_ratios": [0, 0, 4, 128, 4, 0],
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}

# `tiny=True`: Flash's layer window at TINY_CONFIG's dimensions. Every other field of
# TINY_CONFIG equals Flash's, so these keys are all that differ.
TINY_OVERRIDES: dict = {
    k: TINY_CONFIG[k]
    for k in (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "head_dim",
        "qk_rope_head_dim",
        "q_lora_rank",
        "o_lora_rank",
        "o_groups",
        "moe_intermediate_size",
        "n_routed_experts",
        "num_experts_per_tok",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "eos_token_id",
    )
}


def flash_bits(layer: int, proj: str) -> int:
    """The q3.4 bundle's routed bit plan (its 129 `assignment` entries, as a rule): layers 0-2
    and 23-42 all 4-bit; layers 3-21 gate/up 2-bit, down 4-bit; layer 22 up 2-bit only."""
    if layer < 3 or layer >= 23 or proj == "down_proj":
        return 4
    return 2 if layer < 22 or proj == "up_proj" else 4


def synthetic_config(layers: int, first_layer: int = 3, tiny: bool = False) -> dict:
    """Flash's config cut to `layers` layers starting at Flash layer `first_layer` (ratios,
    hash layers and bit plan follow that window), optionally at toy dimensions."""
    n_flash = FLASH_CONFIG["num_hidden_layers"]
    if not (layers >= 1 and 0 <= first_layer and first_layer + layers <= n_flash):
        raise ValueError(
            f"layers {first_layer}..{first_layer + layers - 1} not in 0..{n_flash - 1}"
        )
    config = json.loads(json.dumps(FLASH_CONFIG))
    if tiny:
        config.update(TINY_OVERRIDES)
    config["num_hidden_layers"] = layers
    config["compress_ratios"] = FLASH_CONFIG["compress_ratios"][first_layer : first_layer + layers]
    config["num_hash_layers"] = min(layers, max(0, FLASH_CONFIG["num_hash_layers"] - first_layer))
    plan = {
        f"layer_{i}.{p}": flash_bits(first_layer + i, p)
        for i in range(layers)
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    config["quantization"] = {"bits": 8, "group_size": 32, "mode": "affine"}
    config["weight_format"] = "mxtq"
    config["routed_expert_bit_plan"] = {
        "codec": "mxtq",
        "bits_used": sorted(set(plan.values())),
        "assignment": plan,
    }
    config["synthetic"] = {"flash_layers": [first_layer, first_layer + layers - 1]}
    return config


# ---------------------------------------------------------------- tensor plans

_DTYPES = {
    np.dtype(np.uint32): "U32",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int32): "I32",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
}
_CHUNK_BYTES = 32 << 20  # what one generation step holds


@dataclass(frozen=True)
class _Planned:
    """A tensor to write: its key, dtype, shape, and a generator of its data in row chunks."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _row_chunks(shape: tuple[int, ...], itemsize: int, make: Callable[[tuple], np.ndarray]):
    """Split `shape` along axis 0 into pieces of about _CHUNK_BYTES; make(piece_shape) fills one."""
    row = int(np.prod(shape[1:], dtype=np.int64)) * itemsize
    step = max(1, _CHUNK_BYTES // max(row, 1))

    def gen() -> Iterator[np.ndarray]:
        for start in range(0, shape[0], step):
            yield make((min(step, shape[0] - start), *shape[1:]))

    return gen


def _plans(config: dict, seed: int) -> list[_Planned]:
    """Every stored tensor of the bundle, in jang's order (stacked experts first)."""
    rng = np.random.default_rng(seed)
    plan = config["routed_expert_bit_plan"]["assignment"]
    n_experts, top_k = config["n_routed_experts"], config["num_experts_per_tok"]
    out: list[_Planned] = []

    def add(key: str, dtype, shape: tuple, make: Callable[[tuple], np.ndarray]) -> None:
        dtype = np.dtype(dtype)
        out.append(_Planned(key, dtype, tuple(shape), _row_chunks(shape, dtype.itemsize, make)))

    def words(shape: tuple) -> np.ndarray:
        return rng.integers(0, 1 << 32, shape, dtype=np.uint32)

    def normal(std: float, mean: float = 0.0, dtype=np.float32):
        return lambda s: (mean + rng.standard_normal(s) * std).astype(dtype)

    for name, slot in schedule(config).items():
        if slot.kind == "experts":
            e, out_f, in_f = slot.shape
            bits = plan[plan_key(name)]
            base = stored_expert_name(name)
            add(
                f"{base}.tq_packed",
                np.uint32,
                (e, out_f, in_f // mxtq.values_per_word(bits)),
                words,
            )
            # Uniform codes over a Lloyd-Max codebook give unit-sized rows: norms near 1.
            add(f"{base}.tq_norms", np.float16, (e, out_f), normal(0.05, 1.0, np.float16))
            add(f"{base}.tq_bits", np.uint8, (1,), lambda s, b=bits: np.full(s, b, np.uint8))
        elif slot.kind in ("linear", "embedding"):
            _plan_affine(add, words, rng, name, slot)
        elif slot.kind == "int":  # tid2eid: top_k distinct experts per token id
            add(
                name,
                np.int32,
                slot.shape,
                lambda s: np.argpartition(rng.random((s[0], n_experts)), top_k - 1, axis=1)[
                    :, :top_k
                ].astype(np.int32),
            )
        else:
            dtype = np.float32 if _F32_PASSTHROUGH.search(name) else np.float16
            add(name, dtype, slot.shape, _float_init(name, slot.shape[-1], normal, dtype))
    out.sort(key=lambda p: ".switch_mlp." not in p.key)  # stable: experts first, as jang
    return out


def _plan_affine(add: Callable, words: Callable, rng, name: str, slot) -> None:
    """An 8-bit affine Linear or embedding's weight, scales and biases (`_plans`' `add`)."""
    out_f, in_f = slot.shape
    std = 1.0 if slot.kind == "embedding" else in_f**-0.5
    # Codes uniform on 0..255: w = scale·q + bias is uniform on ±√3·std, variance std².
    step = 2 * np.sqrt(3) * std / 255

    def scales(s):
        return (step * rng.uniform(0.9, 1.1, s)).astype(np.float16)

    add(f"{name}.weight", np.uint32, (out_f, in_f // 4), words)
    add(f"{name}.scales", np.float16, (out_f, in_f // 32), scales)
    add(
        f"{name}.biases",
        np.float16,
        (out_f, in_f // 32),
        lambda s: np.full(s, -127.5 * step, np.float16),
    )


def _float_init(name: str, width: int, normal, dtype):
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight" and "norm" in name:
        return normal(0.1, 1.0, dtype)
    if "hc_" in name:
        if name.endswith("_fn"):
            return normal(0.5 / np.sqrt(width), 0.0, dtype)
        return normal(0.5, 0.0, dtype) if name.endswith("_base") else normal(0.2, 1.0, dtype)
    if leaf == "ape":
        return normal(0.5, 0.0, dtype)
    if leaf == "attn_sink":
        return normal(1.0, 0.0, dtype)
    if name.endswith("gate.weight"):
        return normal(1 / np.sqrt(width), 0.0, dtype)
    return normal(0.1, 0.0, dtype)  # router bias


# ---------------------------------------------------------------- streaming safetensors


def _write_shard(f: Path, plans: list[_Planned]) -> None:
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for p in plans:
        header[p.key] = {
            "dtype": _DTYPES[p.dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writers do
    with open(f, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for p in plans:
            written = 0
            for chunk in p.chunks():
                fh.write(np.ascontiguousarray(chunk, dtype=p.dtype).tobytes())
                written += chunk.nbytes
            assert written == p.nbytes, p.key


def write(
    path: str | Path,
    layers: int = 2,
    *,
    first_layer: int = 3,
    tiny: bool = False,
    seed: int = 0,
    max_shard_bytes: int = 1 << 30,
) -> Path:
    """Write the synthetic bundle (see the module docstring) and return its path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = synthetic_config(layers, first_layer, tiny)
    plans = _plans(config, seed)
    shards: list[list[_Planned]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(path / fname, shard)
        weight_map.update({p.key: fname for p in shard})
    index = {"metadata": {"total_size": sum(p.nbytes for p in plans)}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


__all__ = [
    "FLASH_CONFIG",
    "TINY_CONFIG",
    "TINY_OVERRIDES",
    "flash_bits",
    "synthetic_config",
    "write",
]
