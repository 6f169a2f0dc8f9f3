"""GGUF files of arch llama or qwen2 as a `Source`: metadata read once, each tensor
dequantized from the memory-mapped file when asked for, the tokenizer built by transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..formats.bitnest import ARCHS
from .rope import gguf_rope_scaling
from .source_base import INSTALL, Entry, MappedFile, Source, SourceError, complete_hf_config

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


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of q/k rows (its converter permutes them for GGML's RoPE)."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _GGUFTensor(NamedTuple):
    """Where a tensor's bytes are and how to read them (its ReaderTensor without the reader)."""

    name: str
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # HF order, [out, in]
    offset: int
    raw_dtype: np.dtype  # the raw array GGUFReader gives: uint8 blocks or float values
    raw_shape: tuple[int, ...]


def _gguf_header(path: Path) -> tuple[dict, dict[str, _GGUFTensor]]:
    """(metadata as plain values, tensors by GGUF name). GGUFReader keeps numpy views of every
    vocabulary string (~0.5 GB for 150k tokens); nothing of it leaves here, so it is freed."""
    try:
        import gguf
    except ImportError as e:
        raise SourceError(f"reading GGUF needs the `gguf` package: {INSTALL}") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise SourceError(f"{path}: unreadable GGUF file ({e})") from e
    fields = {k: f.contents() for k, f in reader.fields.items()}
    tensors = {
        t.name: _GGUFTensor(
            t.name,
            t.tensor_type,
            tuple(int(d) for d in reversed(t.shape)),  # GGUF lists dims fastest-moving first
            t.data_offset,
            t.data.dtype,
            t.data.shape,
        )
        for t in reader.tensors
    }
    return fields, tensors


def _dequantize(path: Path, t: _GGUFTensor, raw: np.ndarray) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return dequantize(raw, t.qtype)
    except NotImplementedError as e:
        raise SourceError(f"{path}: tensor {t.name} has type {t.qtype.name} ({e})") from e


def _reader(
    mapped: MappedFile, path: Path, t: _GGUFTensor, heads: int | None
) -> Callable[[], np.ndarray]:
    """Reads `t` as float32 [out, in] (by rows: quantized blocks never straddle one); q/k of
    arch llama un-permuted over `heads`."""

    def read() -> np.ndarray:
        w = mapped.read(t.offset, t.raw_dtype, t.raw_shape, partial(_dequantize, path, t))
        return w if heads is None else unpermute_qk(w, heads)

    return read


def load_gguf(path: str | Path, tokenizer_out: Path) -> Source:
    """A GGUF file of arch llama or qwen2, each tensor dequantized to float32 when read; writes
    its tokenizer (tokenizer.json, tokenizer_config.json) into `tokenizer_out`."""
    path = Path(path)
    fields, tensors = _gguf_header(path)
    arch = fields.get("general.architecture")
    if arch not in ARCHS:
        raise SourceError(f"{path}: GGUF architecture {arch!r}, expected one of {ARCHS}")
    meta = _metadata(path, fields, arch)
    n_heads = meta("attention.head_count")
    n_kv = meta("attention.head_count_kv", n_heads)
    hidden = meta("embedding_length")
    head_dim = meta("attention.key_length", hidden // n_heads)
    if meta("rope.dimension_count", head_dim) != head_dim:
        raise SourceError(f"{path}: partial RoPE ({arch}.rope.dimension_count) is not supported")
    # llama.cpp permutes q/k rows for arch llama only (qwen2 keeps HF's rotate-half layout).
    permuted = {"self_attn.q_proj": n_heads, "self_attn.k_proj": n_kv} if arch == "llama" else {}
    rope_freqs = tensors.pop("rope_freqs.weight", None)
    if "token_embd.weight" not in tensors:
        raise SourceError(f"{path}: no tensor token_embd.weight")
    readers = _readers(path, tensors, permuted)
    mapped = MappedFile(path)
    try:
        rope = None if rope_freqs is None else _reader(mapped, path, rope_freqs, None)
        dims = {"hidden_size": hidden, "num_attention_heads": n_heads}
        dims |= {"num_key_value_heads": n_kv, "head_dim": head_dim}
        config = _gguf_config(path, fields, meta, dims, rope, tensors, readers)
        _write_gguf_tokenizer(path, fields, tokenizer_out)
    except BaseException:
        mapped.close()
        raise
    name = fields.get("general.name") or path.stem
    return Source(
        config,
        tokenizer_out,
        name,
        {k: Entry(t.shape, _reader(mapped, path, t, heads)) for k, (t, heads) in readers.items()},
        mapped.close,
    )


def _metadata(path: Path, fields: dict, arch: str) -> Callable:
    """`meta(key, default=None, kind=int)`: the field `{arch}.{key}` as `kind`, else `default`;
    SourceError when neither is there."""

    def meta(key: str, default=None, kind=int):
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise SourceError(f"{path}: no metadata {arch}.{key}")
        return kind(value)

    return meta


def _readers(path: Path, tensors: dict, permuted: dict) -> dict:
    """{HF name: (GGUF tensor, heads whose q/k rows llama.cpp permuted, or None)}."""
    readers = {}
    for t in tensors.values():
        name, heads = _GGUF_NAMES.get(t.name), None
        if name is None:
            parts = t.name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_LAYER:
                raise SourceError(f"{path}: unexpected tensor {t.name}")
            layer = _GGUF_LAYER[parts[2]]
            name, heads = f"model.layers.{parts[1]}.{layer}.{parts[3]}", permuted.get(layer)
        readers[name] = (t, heads)
    return readers


def _gguf_config(
    path: Path,
    fields: dict,
    meta: Callable,
    dims: dict,
    rope_freqs: Callable | None,
    tensors: dict,
    readers: dict,
) -> dict:
    """The HF config of the GGUF's metadata (`dims`: hidden size, heads, KV heads, head_dim;
    `rope_freqs`: the reader of its rope_freqs tensor, or None)."""
    theta = meta("rope.freq_base", 10000.0, float)
    max_positions = meta("context_length", 4096)
    arch = fields.get("general.architecture")
    try:
        scaling = gguf_rope_scaling(
            lambda key: fields.get(f"{arch}.rope.scaling.{key}"),
            None if rope_freqs is None else rope_freqs(),
            theta,
            dims["head_dim"],
            max_positions,
        )
    except SourceError:
        raise
    except ValueError as e:
        raise SourceError(f"{path}: {e}") from e
    return complete_hf_config(
        {
            "model_type": arch,
            "hidden_size": dims["hidden_size"],
            "num_hidden_layers": meta("block_count"),
            "intermediate_size": meta("feed_forward_length"),
            "num_attention_heads": dims["num_attention_heads"],
            "num_key_value_heads": dims["num_key_value_heads"],
            "head_dim": dims["head_dim"],
            "vocab_size": int(tensors["token_embd.weight"].shape[0]),
            "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5, float),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "max_position_embeddings": max_positions,
            "tie_word_embeddings": "lm_head.weight" not in readers,
            "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        },
        str(path),
    )


_TOKENIZER_SETTINGS = (
    *("bos_token", "eos_token", "unk_token", "pad_token"),
    *("add_bos_token", "add_eos_token", "chat_template"),
)


def _gguf_tokenizer_public(path: Path):
    """(tokenizers.Tokenizer, settings) through `AutoTokenizer.from_pretrained(gguf_file=)`,
    for releases without `transformers.integrations.gguf`: the same conversion, 5x slower on
    a 150k vocabulary because it also builds the model's tokenizer class."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return tok.backend_tokenizer, {k: getattr(tok, k, None) for k in _TOKENIZER_SETTINGS}


def _gguf_tokenizer(path: Path, fields: dict):
    """(tokenizers.Tokenizer, settings) from transformers' GGUF tokenizer converter, given the
    file's metadata: transformers' own reader of it (`get_gguf_tokenizer`) needs torch."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        return _gguf_tokenizer_public(path)
    # What get_gguf_tokenizer does with the same metadata (its key names, its defaults).
    tokenizer, settings = (
        {
            name: fields[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in fields
        }
        for renames in (
            GGUF_TOKENIZER_MAPPING["tokenizer"],
            GGUF_TOKENIZER_MAPPING["tokenizer_config"],
        )
    )
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to SentencePiece
        settings.setdefault("add_bos_token", True)
    for special in ("bos_token", "eos_token", "unk_token", "pad_token"):
        i = tokenizer.get(f"{special}_id")
        settings[special] = None if i is None else tokenizer["tokens"][int(i)]
    return convert_gguf_tokenizer(fields["general.architecture"], tokenizer)[0], settings


def _write_gguf_tokenizer(path: Path, fields: dict, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (chat template, special tokens, add_bos_token) of a
    GGUF, built by transformers so every vocabulary and pre-tokenizer it knows is read the same
    way as `AutoTokenizer.from_pretrained(..., gguf_file=...)` reads it."""
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise SourceError(
            f"{path}: reading a GGUF's tokenizer needs transformers: {INSTALL}"
        ) from e
    try:
        backend, settings = _gguf_tokenizer(path, fields)
    except Exception as e:
        raise SourceError(f"{path}: transformers cannot build its tokenizer ({e})") from e
    backend.post_processor = _bos_eos_template(backend, settings)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **settings}
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n"
    )


def _bos_eos_template(backend, settings: dict):
    """The post-processor adding BOS/EOS as the file's add_bos_token/add_eos_token say, as
    llama.cpp does. transformers 5 acts on those flags only for some tokenizer classes (not for
    a plain tokenizer.json), so the template goes where every loader applies it."""
    from tokenizers import processors

    first, last = (
        [settings[token]] if settings.get(flag) and settings.get(token) else []
        for flag, token in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token"))
    )
    return processors.TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, *(f"{t}:1" for t in first), "$B:1", *(f"{t}:1" for t in last)],
        special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys([*first, *last])],
    )
