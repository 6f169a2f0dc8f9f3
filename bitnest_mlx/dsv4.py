"""DeepSeek-V4 bundles: load a model (+ tokenizer), random weights and the tiny demo bundle.

`load_bundle(path)` reads a bundle with formats/dsv4_bundle.py (strict), builds
models/deepseek_v4.py, swaps in MLX affine layers and MXTQ experts where the bundle stores them,
and loads every tensor (strict). `demo_bundle()` writes a small deterministic bundle with every
feature on (hash layers, ratios 0/4/128, an active indexer, mixed 2/4-bit experts).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from .formats import dsv4_bundle
from .formats.dsv4_bundle import BundleError, Slot
from .layers.mxtq_linear import MXTQSwitchLinear
from .models.deepseek_v4 import Model, ModelArgs

# Every feature of the family at toy size: hash layers 0-2, ratios 0/4/128, index_topk smaller
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

# Mixed widths for the demo: hash layers at 4 bits, the rest mostly 2 (like the q3.4 seed).
DEMO_BITS = {
    f"layer_{i}.{p}": 4 if i < 3 or p == "down_proj" else 2
    for i in range(6)
    for p in ("gate_proj", "up_proj", "down_proj")
}


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic float32 weights for every slot of the config (model parameter names).

    Scales keep activations O(1) through the layers; expert gains are chosen so that the SwiGLU
    clamp (±swiglu_limit) fires on a few percent of elements, which the parity tests need.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, slot in dsv4_bundle.schedule(config).items():
        out[name if slot.kind in ("float", "int") else f"{name}.weight"] = _init(
            rng, name, slot, config
        )
    return out


def _init(rng: np.random.Generator, name: str, slot: Slot, config: dict) -> np.ndarray:
    shape = slot.shape
    normal = lambda std: (rng.standard_normal(shape) * std).astype(np.float32)  # noqa: E731
    if slot.kind == "int":  # tid2eid: k distinct experts per token id
        n = config["n_routed_experts"]
        return np.stack([rng.permutation(n)[: shape[1]] for _ in range(shape[0])]).astype(np.int32)
    if slot.kind == "embedding":
        return normal(1.0)
    if slot.kind == "experts":
        gain = 1.0 if name.endswith("down_proj") else 6.0
        return normal(gain / np.sqrt(shape[-1]))
    if slot.kind == "linear":
        return normal(1.0 / np.sqrt(shape[-1]))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight" and "norm" in name:
        return (1.0 + normal(0.1)).astype(np.float32)
    if "hc_" in name:
        if name.endswith("_fn"):
            return normal(0.5 / np.sqrt(shape[-1]))
        return normal(0.5) if name.endswith("_base") else (1.0 + normal(0.2)).astype(np.float32)
    if leaf == "ape":
        return normal(0.5)
    if leaf == "attn_sink":
        return normal(1.0)
    if name.endswith("gate.weight"):
        return normal(1.0 / np.sqrt(shape[-1]))
    return normal(0.1)  # router bias


# ---------------------------------------------------------------- loading


def args_from_config(config: dict) -> ModelArgs:
    return ModelArgs.from_dict(config)


def build_model(bundle: dsv4_bundle.Bundle, dtype: mx.Dtype = mx.float32) -> Model:
    """The model with affine / MXTQ layers where the bundle stores them, weights loaded."""
    model = Model(args_from_config(bundle.config))
    model.set_dtype(dtype)
    for bits, group in set(bundle.affine.values()):
        names = {n for n, bg in bundle.affine.items() if bg == (bits, group)}
        nn.quantize(
            model,
            group_size=group,
            bits=bits,
            class_predicate=lambda path, m, names=names: (
                path in names and isinstance(m, (nn.Linear, nn.Embedding))
            ),
        )
    slots = dsv4_bundle.schedule(bundle.config)
    for name, fmt in bundle.formats.items():
        if isinstance(fmt, int):  # MXTQ experts of `fmt` bits
            layer, proj = int(name.split(".")[1]), name.rsplit(".", 1)[1]
            e, out_f, in_f = slots[name].shape
            switch = model.layers[layer].ffn.switch_mlp
            setattr(switch, proj, MXTQSwitchLinear(in_f, out_f, e, fmt, seed=bundle.seed))
    params = dict(tree_flatten(model.parameters()))
    weights = []
    for key, a in bundle.tensors.items():
        target = params.get(key)
        if target is None:
            raise BundleError(f"{key}: no such model parameter")
        weights.append((key, a.astype(target.dtype) if a.dtype != target.dtype else a))
    model.load_weights(weights, strict=True)
    model.eval()
    return model


def load_bundle(path: str | Path, dtype: mx.Dtype | None = None) -> tuple[Model, object]:
    """(model, tokenizer) for a DeepSeek-V4 bundle; tokenizer is None when the bundle has none."""
    bundle = dsv4_bundle.read(path)
    model = build_model(bundle, dtype or mx.float32)
    mx.eval(model.parameters())
    return model, _tokenizer(Path(path), bundle.config)


def _tokenizer(path: Path, config: dict):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else None
    return load_tokenizer(path, eos_token_ids=eos)


# ---------------------------------------------------------------- demo bundle


def write_demo_bundle(path: str | Path, seed: int = 0) -> Path:
    """The tiny demo: TINY_CONFIG, random weights, affine 8-bit + mixed 2/4-bit MXTQ, 2 shards,
    and a character-level tokenizer with a DeepSeek-style chat template."""
    config = dict(TINY_CONFIG)
    path = dsv4_bundle.write(path, config, random_weights(config, seed), expert_bits=DEMO_BITS)
    write_demo_tokenizer(path, config["vocab_size"])
    return path


# DeepSeek's special tokens; the real bundles ship their own tokenizer and template.
_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_demo_tokenizer(path: str | Path, vocab_size: int) -> None:
    """One token per printable ASCII character (+ newline) after BOS 0, EOS 1, User, Assistant
    and <unk>; the remaining ids up to vocab_size are reserved placeholders."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*_SPECIALS, "<unk>", "\n", *map(chr, range(32, 127))]
    tokens += [f"<｜reserved_{i}｜>" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=_SPECIALS[0],
        eos_token=_SPECIALS[1],
        unk_token="<unk>",
        additional_special_tokens=_SPECIALS[2:],
        chat_template=_CHAT_TEMPLATE,
    ).save_pretrained(str(path))


def demo_bundle_path() -> Path:
    """The tiny DSV4 demo bundle in the bitnest_mlx cache dir, built offline on first use."""
    from .demo import cached_build

    return cached_build("dsv4-tiny-demo", write_demo_bundle)
