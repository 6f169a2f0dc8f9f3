"""The embedded demos, offline.

bitnest package (`demo_path`, `--model demo`): `demo_model/` beside this file, a small Llama
trained from scratch on Debian's license texts and converted with bitnest_mlx.convert by
examples/train_demo.py (deterministic on the CPU backend; docs/generate.md). It ships with the
package (setup.py's package_data).

DeepSeek-V4 bundle (`demo_bundle_path`): TINY_CONFIG (formats/dsv4_synthetic.py, the one toy
config) with every feature of the family on (hash layers, ratios 0/4/128, an active indexer,
mixed 2/4-bit experts) and random weights, which the DSV4 tests share;
built into the cache on first use. `write_tokenizer` is the byte-level
tokenizer tiny packages use (tests, docs). Nothing here imports a model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..formats import dsv4_bundle, dsv4_bundle_write
from ..formats.dsv4_bundle import Slot
from ..formats.dsv4_synthetic import TINY_CONFIG


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


def cache_dir() -> Path:
    root = os.environ.get("BITNEST_MLX_CACHE") or Path.home() / ".cache" / "bitnest_mlx"
    return Path(root)


def cached_build(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir()/name`, built once by `build(tmp)` in a hidden sibling and renamed into place
    (convert.output.atomic_directory), so a crashed or concurrent build never leaves a
    half-written directory that a later run would use."""
    from ..convert.output import OutputError, atomic_directory

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


# Where examples/train_demo.py writes the trained demo; setup.py ships it as package data.
SHIPPED_DEMO = Path(__file__).resolve().parents[1] / "demo_model"  # bitnest_mlx/demo_model


def demo_path() -> Path:
    """The demo package directory (shipped with bitnest_mlx)."""
    if not (SHIPPED_DEMO / "bitnest.json").is_file():
        raise FileNotFoundError(
            f"{SHIPPED_DEMO}: the demo package is missing from this installation "
            "(rebuild it with: python examples/train_demo.py)"
        )
    return SHIPPED_DEMO


DEMO = "demo"  # the name `--model demo` accepts for the demo package


def resolve_model(model: str | Path | None) -> str | Path:
    """`None` or "demo" -> the demo package; anything else (a directory, a Hub id) unchanged.

    "demo" wins over a local folder of that name; write ./demo for the folder."""
    return demo_path() if model is None or str(model) == DEMO else model


# ---------------------------------------------------------------- DeepSeek-V4 demo bundle

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
    return dsv4_bundle_write.seal(path)  # record the tokenizer files' bytes too


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
