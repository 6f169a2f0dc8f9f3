"""Float weights (HF names, [out, in], float32 numpy) and configs from HF checkpoints or GGUF."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

ARCHS = ("llama", "qwen2")


class SourceError(ValueError):
    """An input checkpoint the converter cannot read; the message names the file and the problem."""


@dataclass
class Source:
    weights: dict[str, np.ndarray]
    config: dict
    tokenizer_dir: Path | None
    name: str


def _complete(config: dict, where: str) -> dict:
    if config.get("model_type") not in ARCHS:
        raise SourceError(f"{where}: model_type {config.get('model_type')!r}, expected {ARCHS}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config["head_dim"] = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
    )
    return config


def load_hf(path: str | Path) -> Source:
    """A Hugging Face Llama/Qwen2 safetensors checkpoint directory (float16/bfloat16/float32)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    config = _complete(json.loads((path / "config.json").read_text()), str(path / "config.json"))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors files")
    weights = {}
    for f in files:
        try:
            arrays = mx.load(str(f))
        except Exception as e:
            raise SourceError(f"{f}: unreadable safetensors file ({e})") from e
        for k, a in arrays.items():
            if a.dtype not in (mx.float16, mx.bfloat16, mx.float32):
                raise SourceError(f"{f}: tensor {k} has dtype {a.dtype}, expected a float type")
            weights[k] = np.array(a.astype(mx.float32))
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    return Source(weights, config, path, path.name)


# ---------------------------------------------------------------------------------------------
# GGUF

_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Pre-tokenizer split patterns of the BPE vocabularies llama.cpp names in `tokenizer.ggml.pre`.
_PRE_TOKENIZER = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (its converter permutes them for GGML's RoPE)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def load_gguf(path: str | Path, tokenizer_out: Path) -> Source:
    """A GGUF file of arch llama or qwen2, dequantized to float32; writes its tokenizer files."""
    try:
        import gguf
        from gguf.quants import dequantize
    except ImportError as e:
        raise SourceError("reading GGUF needs the `gguf` package: pip install gguf") from e
    path = Path(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise SourceError(f"{path}: unreadable GGUF file ({e})") from e
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise SourceError(f"{path}: GGUF architecture {arch!r}, expected one of {ARCHS}")
    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    weights = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise SourceError(
                f"{path}: tensor rope_freqs.weight (llama3 RoPE factors) is not "
                "supported; convert from the Hugging Face checkpoint instead"
            )
        name = _GGUF_NAMES.get(t.name)
        if name is None:
            parts = t.name.split(".")
            if parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
                raise SourceError(f"{path}: unexpected tensor {t.name}")
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[3]}"
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = (
                n_heads
                if ".q_proj." in name
                else int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
            )
            w = unpermute_qk(w, heads)
        weights[name] = w
    d = int(_field(reader, f"{arch}.embedding_length"))
    config = _complete(
        {
            "model_type": arch,
            "hidden_size": d,
            "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
            "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_heads)),
            "vocab_size": weights["model.embed_tokens.weight"].shape[0],
            "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in weights,
            "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        },
        str(path),
    )
    _write_gguf_tokenizer(reader, path, tokenizer_out)
    return Source(weights, config, tokenizer_out, _field(reader, "general.name", path.stem))


def _write_gguf_tokenizer(reader, path: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json from a GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "llama-bpe")
    if kind != "gpt2" or pre not in _PRE_TOKENIZER:
        raise SourceError(
            f"{path}: tokenizer {kind!r}/{pre!r} is not supported "
            f"(byte-level BPE with pre-tokenizer {sorted(_PRE_TOKENIZER)})"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            ignore_merges=pre == "llama-bpe",
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRE_TOKENIZER[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types) if ty in (3, 4)]  # CONTROL, USER_DEFINED
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = _field(reader, key)
        return None if i is None else tokens[int(i)]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n"
    )
