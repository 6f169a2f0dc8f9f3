"""Every test model builder: seeded float weights, tiny packages, tiny transformers models,
and helpers to break packages.

The packages are real `write_package` output (hidden 256, head_dim 128), small enough to build
in well under a second, so every test can work on its own copy. torch and transformers are
imported only by the builders that need them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from bitnest_mlx.convert import write_package
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
    out: Path,
    arch: str = "llama",
    *,
    tokenizer: bool = False,
    group_size: int | None = None,
    **dims,
) -> tuple[Path, dict[str, np.ndarray], dict]:
    """Write a package to `out`; returns (path, the float weights, the HF config).

    With `tokenizer`, the demo's byte-level tokenizer is written too (its vocab is 257), so the
    package also loads through `bitnest_mlx.load`. `group_size`: the weight group (None: the
    writer's choice, 128 for these dims).
    """
    from bitnest_mlx.runtime.demo import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        dims["vocab"] = write_tokenizer(out)
    weights, config = float_weights(arch, **dims)
    write_package(
        out,
        weights,
        config,
        name=f"tiny-{arch}",
        source_model="tests.factory",
        group_size=group_size,
    )
    return out, weights, config


def copy_package(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def load_tensors(pkg: Path, file: str = "model.safetensors") -> dict[str, mx.array]:
    return dict(mx.load(str(pkg / file)))


def save_tensors(pkg: Path, tensors: dict[str, mx.array], file: str = "model.safetensors") -> None:
    mx.save_safetensors(str(pkg / file), tensors, metadata={"format": "mlx"})


def reseal(pkg: Path) -> None:
    """Recompute the package's checksums after a deliberate edit (when it has them), so that the
    edited package is judged by the rule the edit breaks, or loads as the variant it makes; the
    checksums themselves are tested in test_fuzz_formats.py."""
    try:
        if bitnest.CHECKSUMS_KEY in read_json(pkg, bitnest.find_manifest(pkg).name):
            bitnest.seal(pkg)
    except (bitnest.PackageError, ValueError):
        pass  # an edit that breaks the manifest itself: nothing to re-seal


def edit_tensors(pkg: Path, edit: Callable[[dict[str, mx.array]], None]) -> None:
    """Rewrite model.safetensors after `edit` mutates the name -> array dict in place."""
    tensors = load_tensors(pkg)
    edit(tensors)
    save_tensors(pkg, tensors)
    reseal(pkg)


def read_json(pkg: Path, file: str) -> dict:
    return json.loads((pkg / file).read_text(encoding="utf-8"))


def edit_json(pkg: Path, file: str, edit: Callable[[dict], None]) -> None:
    """Rewrite a JSON file of the package after `edit` mutates it in place."""
    data = read_json(pkg, file)
    edit(data)
    (pkg / file).write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    reseal(pkg)


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


# ---------------------------------------------------------------------------------------------
# Tiny transformers models (torch), for conversion and perplexity tests

VOCAB = 300


def tiny_dims(layers: int = 2) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )


def tiny_hf(arch: str, seed: int = 0):
    """A tiny random transformers model with non-trivial norm weights."""
    import torch
    import transformers

    torch.manual_seed(seed)
    common = tiny_dims()
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.tensor(rng.uniform(0.5, 1.5, p.shape), dtype=torch.float32))
            elif name.endswith("bias"):
                p.copy_(torch.tensor(rng.normal(0, 0.1, p.shape), dtype=torch.float32))
    return model.eval()


def state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def config_dict(model) -> dict:
    c = model.config.to_dict()
    c["head_dim"] = 128
    if c.get("rope_scaling") is None and c.get("rope_parameters"):
        params = c["rope_parameters"]
        c["rope_theta"] = params.get("rope_theta", c.get("rope_theta", 10000.0))
        c["rope_scaling"] = params if params.get("rope_type") not in (None, "default") else None
    return c


# ---------------------------------------------------------------------------------------------
# A random package for speculative-decoding tests (uniform norms, optional lm_head outliers)


def tiny_package(
    out: Path,
    seed: int,
    vocab: int = VOCAB,
    layers: int = 1,
    outlier: float = 1.0,
    group_size: int | None = None,
):
    """A random hidden-256 Llama package, loaded. `outlier` scales two lm_head columns: a larger
    group maximum coarsens the W4 plane much more than W8, pulling the draft away from the
    target. `group_size`: the weight group (None: the writer's choice, 128)."""
    rng = np.random.default_rng(seed)
    d, inter = 256, 512
    config = dict(
        model_type="llama",
        hidden_size=d,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    )
    head = rng.normal(0, d**-0.5, (vocab, d))
    head[:, [0, 128]] *= outlier
    w = {
        "model.embed_tokens.weight": rng.normal(0, 1, (vocab, d)),
        "lm_head.weight": head,
        "model.norm.weight": np.ones(d),
    }
    shapes = {
        "self_attn.q_proj": (256, d),
        "self_attn.k_proj": (128, d),
        "self_attn.v_proj": (128, d),
        "self_attn.o_proj": (d, 256),
        "mlp.gate_proj": (inter, d),
        "mlp.up_proj": (inter, d),
        "mlp.down_proj": (d, inter),
    }
    for i in range(layers):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.normal(0, 0.06, shape)
        w[f"model.layers.{i}.input_layernorm.weight"] = np.ones(d)
        w[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(d)
    out.mkdir(parents=True, exist_ok=True)
    from bitnest_mlx.runtime.demo import write_tokenizer

    write_tokenizer(out)  # `load` wants a tokenizer; these tests work on token ids
    weights = {k: v.astype(np.float32) for k, v in w.items()}
    write_package(out, weights, config, group_size=group_size)
    import bitnest_mlx

    model, _ = bitnest_mlx.load(out)
    return model


def differing_pair(out: Path, temp: float):
    """A vocab-8 package whose draft and target distributions differ (total variation > 0.1)
    after token 3: (model, y = [3], sampler at `temp`, target p [8], draft q [8] probabilities)."""
    import mlx.core as mx

    from bitnest_mlx.runtime.sampling import make_sampler

    model = tiny_package(out, seed=3, vocab=8, outlier=8.0)
    y = mx.array([3], dtype=mx.uint32)
    sampler = make_sampler(temp)
    p = np.exp(np.array(sampler.logprobs(model(y[None], mode="target")[0, -1])))
    q = np.exp(np.array(sampler.logprobs(model(y[None], mode="draft")[0, -1])))
    assert 0.5 * np.abs(p - q).sum() > 0.1  # the draft really differs
    return model, y, sampler, p, q


# ---------------------------------------------------------------------------------------------
# Parity cases against transformers: one Llama with R4 K = 12, one Qwen2 with K = 1


HIDDEN, LAYERS = 256, 2

# Small original context so that, at positions 0..7, most RoPE pairs fall in llama3's scaled
# (wavelength > 32) or interpolated (8..32) bands: an ignored scaling changes the logits.
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@dataclass
class Case:
    arch: str
    intermediate: int
    r4_k: int  # the K the writer must pick for this intermediate size


CASES = {
    "llama-K12": Case("llama", 384, 12),  # 384 = 12 * 32: ships aux.had_K.12
    "qwen2-K1": Case("qwen2", 512, 1),  # power of two: plain Walsh-Hadamard, no aux tensor
}


def hf_config(case: Case, tied: bool):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=case.intermediate,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    if case.arch == "llama":
        return LlamaConfig(
            **common, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
        )
    return Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False)


def effective_hf_model(case: Case, path: Path, draft: bool, stored_norms: bool = False):
    """A transformers model holding exactly what the package computes with A8/KV off: every
    Linear = dequantized planes, embedding = the bf16 one, down_proj = W' H (undoes the
    writer's R4 fusion W' = W Hᵀ: the runtime computes W'(H a)), norms = ones (gammas folded)
    or, with `stored_norms`, the package's norm weights (smoothing vectors)."""
    import torch
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from bitnest_mlx.formats.hadamard import sylvester

    t = bitnest.read(path).tensors
    n = case.intermediate
    if case.r4_k > 1:
        had_k = np.array(t[f"aux.had_K.{case.r4_k}"], dtype=np.float64)
        h = np.kron(had_k, sylvester(n // case.r4_k)) / np.sqrt(n)
    else:
        h = sylvester(n) / np.sqrt(n)
    model = (LlamaForCausalLM if case.arch == "llama" else Qwen2ForCausalLM)(
        hf_config(case, tied=False)
    )
    state = {}
    for name, p in model.state_dict().items():
        stem = name.removesuffix(".weight")
        if "norm" in name:
            w = np.array(t[name]) if stored_norms else np.ones(p.shape)
        elif name == "model.embed_tokens.weight":
            w = np.array(t[name].astype(mx.float32))
        elif name.endswith(".bias"):
            w = np.array(t[name])
        else:
            w = bitnest.dequantize_planes(
                np.array(t[f"{stem}.hi"]),
                np.array(t[f"{stem}.lo"]),
                np.array(t[f"{stem}.scales"]),
                draft=draft,
            )
            if stem.endswith("down_proj"):
                w = w @ h
        state[name] = torch.tensor(np.asarray(w, dtype=np.float32))
    model.load_state_dict(state, strict=True)
    return model.eval()


def writer_config(case: Case) -> dict:
    """The dims the writer needs, spelled out with top-level rope_theta / rope_scaling as HF
    config.json files have them (the transformers 5 `to_dict()` form is tested separately)."""
    cfg = hf_config(case, tied=True)
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta")
    return {
        "model_type": case.arch,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": case.intermediate,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": rope if rope.get("rope_type") != "default" else None,
        "max_position_embeddings": 256,
    }


def random_source_weights(case: Case, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 weights with HF names. Scales chosen so logits are O(1) and attention is
    peaked (q/k larger), so the 1e-4 tolerance is small against every effect being tested."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    rng = np.random.default_rng(seed)
    model = (LlamaForCausalLM if case.arch == "llama" else Qwen2ForCausalLM)(
        hf_config(case, tied=case.arch == "llama")
    )
    std = {"q_proj": 0.08, "k_proj": 0.08, "embed_tokens": 0.1, "lm_head": 0.1}
    out = {}
    for name, p in model.state_dict().items():
        short = name.split(".")[-2]
        if "norm" in name:  # non-trivial gammas: folding them into the Linears must be exact
            w = rng.uniform(0.5, 1.5, p.shape)
        elif name.endswith(".bias"):
            w = rng.normal(0, 0.5, p.shape)
        else:
            w = rng.normal(0, std.get(short, 0.06), p.shape)
        out[name] = w.astype(np.float32)
    if case.arch == "llama":  # tied, like Llama 3.2: the writer must untie from the embedding
        out.pop("lm_head.weight", None)
    return out


# ---------------------------------------------------------------------------------------------
# DeepSeek-V4: the float model of the tiny config, and its weights under transformers' names

# Our names (official checkpoint names) -> transformers' module names.
_HF_RENAMES = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.", "model.layers."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".self_attn.compressor.indexer."),
    (r"\.attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.attn_sink$", ".sinks"),
    (r"\.ape$", ".position_bias"),
    (r"(compressor|indexer)\.norm\.", r"\1.kv_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"shared_experts\.w1\.", "shared_experts.gate_proj."),
    (r"shared_experts\.w2\.", "shared_experts.down_proj."),
    (r"shared_experts\.w3\.", "shared_experts.up_proj."),
]


def dsv4_hf_state_dict(weights: dict[str, np.ndarray]):
    """Our DSV4 weights under transformers' DeepseekV4ForCausalLM names (torch tensors)."""
    import torch

    from bitnest_mlx.runtime.demo import TINY_CONFIG

    sd = {}
    for key, value in weights.items():
        if ".switch_mlp." in key:
            continue
        name = key
        for pattern, repl in _HF_RENAMES:
            name = re.sub(pattern, repl, name)
        tensor = torch.from_numpy(np.ascontiguousarray(value))
        sd[name] = tensor.long() if value.dtype == np.int32 else tensor
    for i in range(TINY_CONFIG["num_hidden_layers"]):
        p = f"layers.{i}.ffn.switch_mlp."
        gate_up = np.concatenate(
            [weights[p + "gate_proj.weight"], weights[p + "up_proj.weight"]], 1
        )
        sd[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.from_numpy(gate_up)
        sd[f"model.layers.{i}.mlp.experts.down_proj"] = torch.from_numpy(
            weights[p + "down_proj.weight"]
        )
    return sd


def dsv4_model(weights: dict[str, np.ndarray], **overrides):
    """The float DSV4 model of TINY_CONFIG (+ overrides) with `weights` loaded."""
    from bitnest_mlx.models.deepseek_v4 import Model, ModelArgs

    from bitnest_mlx.runtime.demo import TINY_CONFIG

    model = Model(ModelArgs.from_dict({**TINY_CONFIG, **overrides}))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return model


def break_package(pkg: Path, how: str) -> tuple[str, str]:
    """Break package `pkg` (from `make_package`) in one way; (the path the error must name, a
    phrase it must contain)."""
    if how == "truncated shard":
        broken = pkg / sorted(set(shard(pkg).values()))[-1]
        broken.write_bytes(broken.read_bytes()[:-1000])
        return str(broken), "truncated"
    if how == "header one byte short":  # mx.load would read every tensor shifted by a byte
        broken = pkg / sorted(set(shard(pkg).values()))[-1]
        data = bytearray(broken.read_bytes())
        data[:8] = (int.from_bytes(data[:8], "little") - 1).to_bytes(8, "little")
        broken.write_bytes(bytes(data))
        return str(broken), "safetensors"
    if how == "broken tokenizer_config.json":  # parsed by transformers: our line first
        (pkg / "tokenizer_config.json").write_text('{"tokenizer_class": ')
        return str(pkg / "tokenizer_config.json"), "unreadable JSON"
    if how == "no manifest":  # config.json still says model_type bitnest
        (pkg / "bitnest.json").unlink()
        return str(pkg), "no manifest"
    if how == "no config.json":
        (pkg / "config.json").unlink()
        return str(pkg / "config.json"), "missing"
    assert how == "no tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (pkg / f).unlink()
    return str(pkg), "no tokenizer files"
