"""The embedded demo package: built deterministically on first use, no network.

A byte-level BPE tokenizer (256 bytes + <|endoftext|>) and a 2-layer Llama whose embedding is
one-hot and whose lm_head holds byte-bigram log-probabilities of the text below; the decoder
layers are small random weights (R4 with K = 12 included). So the default command prints
English-looking text, and draft (W4) and target (W8) visibly differ. It is a format and runtime
demo, not a language model.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .formats import bitnest

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
    """`cache_dir()/name`, built once by `build(tmp)` and renamed into place, so a crashed or
    concurrent build never leaves a half-written directory that a later run would use."""
    target = cache_dir() / name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_demo(out: Path) -> None:
    weights, config = demo_weights(write_tokenizer(out))
    bitnest.write(out, weights, config, name="bitnest-demo", source_model="bitnest_mlx.demo")


def demo_path() -> Path:
    """The demo package directory, built offline on first use."""
    return cached_build(f"demo-v{VERSION}", _build_demo)
