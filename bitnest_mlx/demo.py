"""The embedded demos: built deterministically on first use, no network.

bitnest package (`demo_path`, `--model demo`): the package trained by examples/train_demo.py
(a small Llama on Debian's license texts, converted with bitnest_mlx.convert) when it ships in
`demo_model/` beside this file. Until it does, a stand-in is built in the cache: a byte-level
BPE tokenizer (256 bytes + <|endoftext|>) and a 2-layer Llama whose embedding is one-hot and
whose lm_head holds byte-bigram log-probabilities of the text below; the decoder layers are small
random weights (R4 with K = 12 included). The stand-in is a format and runtime demo, not a
language model.

DeepSeek-V4 bundle (`demo_bundle_path`): TINY_CONFIG with every feature of the family on (hash
layers, ratios 0/4/128, an active indexer, mixed 2/4-bit experts) and random weights, which the
DSV4 tests share. Both demos only write formats; nothing here imports a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .formats import dsv4_bundle, dsv4_bundle_write
from .formats.dsv4_bundle import Slot

VERSION = 1
CORPUS = """\
The river runs slowly past the old mill, and in the evening the light falls across the water
like a sheet of copper. People walk along the bank with their dogs, and children throw stones to
see how far they can skip. In the spring the water rises and the meadow floods, and the birds come
back from the south to build their nests in the reeds. There is a small bridge made of stone where
the road crosses the river, and a bench beside it where the older people of the village sit and
talk about the weather, the price of bread and the news from the town. When the sun goes down the
wind turns cold, the lamps are lit in the windows, and the smell of wood smoke drifts over the
houses. Somebody is always baking, somebody is always late, and somebody always says that the
winter will be hard this year. The mill has not turned for many years, but the wheel is still there,
green with moss, and on quiet nights you can hear the water moving under it as if it remembered
the work it used to do. A good story is like that river: it keeps moving, it carries small things
along with it, and it is never quite the same when you come back to it the next day.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_tokenizer(out: Path) -> int:
    """A byte-level tokenizer (id = byte value, 256 = <|endoftext|>); returns the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "model_max_length": 2048,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return 257


def demo_weights(vocab: int, seed: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    d, inter, n_layers = 384, 768, 2
    config = {
        "model_type": "llama",
        "hidden_size": d,
        "intermediate_size": inter,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "eos_token_id": 256,
    }
    data = np.frombuffer(" ".join(CORPUS.split()).encode(), dtype=np.uint8)
    counts = np.full((vocab, vocab), 0.01)
    np.add.at(counts, (data[:-1], data[1:]), 1.0)
    logp = np.maximum(np.log(counts / counts.sum(1, keepdims=True)), -10.0)
    logp[:, np.bincount(data, minlength=vocab) == 0] = -40.0  # bytes the text never uses
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": np.eye(vocab, d)}
    head = np.zeros((vocab, d))
    head[:, :vocab] = logp.T / np.sqrt(d)  # rms_norm(e_t) = sqrt(d) e_t, so logits = logp[t, :]
    w["lm_head.weight"] = head
    w["model.norm.weight"] = np.ones(d)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for name, shape, std in (
            ("self_attn.q_proj", (384, d), 0.02),
            ("self_attn.k_proj", (128, d), 0.02),
            ("self_attn.v_proj", (128, d), 0.02),
            ("self_attn.o_proj", (d, 384), 0.002),
            ("mlp.gate_proj", (inter, d), 0.02),
            ("mlp.up_proj", (inter, d), 0.02),
            ("mlp.down_proj", (d, inter), 0.002),
        ):
            w[f"{p}{name}.weight"] = rng.normal(0, std, shape)
        w[p + "input_layernorm.weight"] = np.ones(d)
        w[p + "post_attention_layernorm.weight"] = np.ones(d)
    return {k: v.astype(np.float32) for k, v in w.items()}, config


def cache_dir() -> Path:
    root = os.environ.get("BITNEST_MLX_CACHE") or Path.home() / ".cache" / "bitnest_mlx"
    return Path(root)


def cached_build(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir()/name`, built once by `build(tmp)` in a hidden sibling and renamed into place
    (convert.output.atomic_directory), so a crashed or concurrent build never leaves a
    half-written directory that a later run would use."""
    from .convert.output import OutputError, atomic_directory

    target = cache_dir() / name
    if target.is_dir():
        return target
    try:
        with atomic_directory(target) as tmp:
            build(tmp)
    except OutputError:  # another process finished the same build first
        if not target.is_dir():
            raise
    return target


def _build_demo(out: Path) -> None:
    weights, config = demo_weights(write_tokenizer(out))
    from .convert.package import write_package

    write_package(out, weights, config, name="bitnest-demo", source_model="bitnest_mlx.demo")


# Where examples/train_demo.py writes the trained demo; setup.py ships it as package data.
SHIPPED_DEMO = Path(__file__).resolve().parent / "demo_model"


def demo_path() -> Path:
    """The demo package directory: the trained one when shipped, else the stand-in (built
    offline on first use)."""
    if (SHIPPED_DEMO / "bitnest.json").is_file():
        return SHIPPED_DEMO
    return cached_build(f"demo-v{VERSION}", _build_demo)


DEMO = "demo"  # the name `--model demo` accepts for the demo package


def resolve_model(model: str | Path | None) -> str | Path:
    """`None` or "demo" -> the demo package; anything else (a directory, a Hub id) unchanged.

    "demo" wins over a local folder of that name; write ./demo for the folder."""
    return demo_path() if model is None or str(model) == DEMO else model


# ---------------------------------------------------------------- DeepSeek-V4 demo bundle

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


def write_demo_bundle(path: str | Path, seed: int = 0) -> Path:
    """The tiny demo: TINY_CONFIG, random weights, affine 8-bit + mixed 2/4-bit MXTQ, 2 shards,
    and a character-level tokenizer with a DeepSeek-style chat template."""
    config = dict(TINY_CONFIG)
    path = dsv4_bundle_write.write(
        path, config, random_weights(config, seed), expert_bits=DEMO_BITS
    )
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
    return cached_build("dsv4-tiny-demo", write_demo_bundle)
