"""Float weights (HF names, [out, in], float32 numpy) and configs from HF checkpoints or GGUF
(`gguf_source`).

A checkpoint is memory-mapped and each tensor is converted (or dequantized) only when asked for,
so converting a model needs the memory of the tensors in use, not of the whole checkpoint.
"""

from __future__ import annotations

import json
import mmap
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..formats.bitnest import ARCHS
from ..formats.safetensors_io import check_safetensors, read_json, string_map
from .rope import rope_params

__all__ = ["Source", "SourceError", "load_gguf", "load_hf", "rope_params"]

INSTALL = "pip install 'bitnest-mlx[convert]'"  # the extra that brings gguf and transformers


class SourceError(ValueError):
    """An input checkpoint the converter cannot read; the message names the file and the problem."""


class _Entry(NamedTuple):
    shape: tuple[int, ...]
    read: Callable[[], np.ndarray]


@dataclass
class Source:
    """One checkpoint: its completed HF config and its tensors, each read when asked for.

    `tensor(name)` returns a new float32 array in HF layout ([out, in]); nothing is kept here, so
    memory holds only what the caller still uses. `close()` (or `with source:`) unmaps the files.
    """

    config: dict
    tokenizer_dir: Path | None
    name: str
    # name -> (HF shape, reader of a new float32 array)
    _tensors: dict[str, _Entry] = field(default_factory=dict, repr=False)
    _close: Callable[[], None] = field(default=lambda: None, repr=False)

    @classmethod
    def from_arrays(
        cls,
        weights: Mapping[str, np.ndarray],
        config: dict,
        tokenizer_dir: Path | None = None,
        name: str = "arrays",
    ) -> Source:
        """A source over arrays already in memory (tests, examples), config completed as a
        checkpoint's is."""
        tensors = {
            k: _Entry(np.shape(v), partial(np.array, v, dtype=np.float32))
            for k, v in weights.items()
        }
        return cls(_complete(dict(config), name), tokenizer_dir, name, tensors)

    def names(self) -> list[str]:
        """HF tensor names, in checkpoint order (no lm_head.weight when the embedding is tied)."""
        return list(self._tensors)

    def _entry(self, name: str) -> _Entry:
        entry = self._tensors.get(name)
        if entry is None:
            raise KeyError(f"{self.name}: no tensor {name!r}")
        return entry

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape `tensor(name)` will have, without reading it."""
        return self._entry(name).shape

    def tensor(self, name: str) -> np.ndarray:
        return self._entry(name).read()

    def close(self) -> None:
        self._tensors = {}
        self._close()

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _complete(config: dict, where: str) -> dict:
    """`config` with model_type checked and head_dim, num_key_value_heads, rope_theta and
    rope_scaling (None for default RoPE) filled in."""
    if config.get("model_type") not in ARCHS:
        raise SourceError(f"{where}: model_type {config.get('model_type')!r}, expected {ARCHS}")
    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in dims if not isinstance(config.get(k), int)]
    if missing:
        raise SourceError(f"{where}: config has no integer {', '.join(missing)}")
    config["num_key_value_heads"] = (
        config.get("num_key_value_heads") or config["num_attention_heads"]
    )
    config["head_dim"] = config.get("head_dim") or (
        config["hidden_size"] // config["num_attention_heads"]
    )
    config["rope_theta"], config["rope_scaling"] = rope_params(config)
    return config


_BLOCK_BYTES = 1 << 22  # file bytes converted at a time


class _Mapped:
    """A read-only map of one file, read a tensor at a time: by blocks of rows, each block's
    pages dropped from this process's resident set once converted (the page cache keeps them).
    Neither the file's pages nor a converter's temporaries (several times the float32 result
    when dequantizing) add up beyond a block: a tensor costs its float32 result."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(
        self,
        offset: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
        convert: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """float32 `convert(rows)` of the array of `dtype` and `shape` at `offset`, by rows."""
        raw = np.ndarray(shape, dtype, buffer=self.map, offset=offset)
        row = raw[0].nbytes if raw.ndim > 1 and len(raw) else raw.nbytes
        step = max(1, _BLOCK_BYTES // max(1, row)) if raw.ndim > 1 else max(1, len(raw))
        out = np.empty(0, np.float32)
        for i in range(0, len(raw), step):
            part = convert(raw[i : i + step])
            if i == 0:
                out = np.empty((len(raw), *part.shape[1:]), np.float32)
            out[i : i + step] = part
            self._drop(offset + i * row, offset + min(i + step, len(raw)) * row)
        del raw, part  # close() refuses while an array still exports the map
        return out

    def _drop(self, begin: int, end: int) -> None:
        if hasattr(self.map, "madvise") and end > begin:  # no madvise on Windows
            start = begin - begin % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        self.map.close()


def _close_all(maps: list[_Mapped]) -> Callable[[], None]:
    def close() -> None:
        for m in maps:
            m.close()

    return close


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors

# numpy has no bfloat16: its bits are the top half of a float32, read as uint16.
_SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# A hub id ("org/model"); anything else in _name_or_path is a path on the machine that saved it.
_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def _to_float32(raw: np.ndarray) -> np.ndarray:
    if raw.dtype == np.dtype("<u2"):
        out = raw.astype(np.uint32)
        out <<= 16
        return out.view(np.float32)
    return raw.astype(np.float32)


def _shards(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: its index's shards when it has one, so stray
    files beside them (another format's `consolidated.safetensors`) are not read as weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = string_map(
            read_json(index, SourceError).get("weight_map"), index, "weight_map", SourceError
        )
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"{index}: shards {missing} are missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors files")
    return files


def _hf_tensors(f: Path, mapped: _Mapped) -> dict[str, _Entry]:
    """The tensors of one safetensors file (its header checked by `check_safetensors`)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    tensors = {}
    for k, info in header.items():
        # Old Llama checkpoints store RoPE's inverse frequencies, a buffer derived from config.
        if k == "__metadata__" or k.endswith("rotary_emb.inv_freq"):
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SourceError(
                f"{f}: tensor {k} has dtype {info.get('dtype')}, expected one of F32, F16, BF16"
            )
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if end - begin != dtype.itemsize * int(np.prod(shape)):
            raise SourceError(f"{f}: tensor {k} holds {end - begin} bytes, not its shape {shape}")
        tensors[k] = _Entry(shape, partial(mapped.read, 8 + n + begin, dtype, shape, _to_float32))
    return tensors


def load_hf(path: str | Path) -> Source:
    """A Hugging Face Llama/Qwen2 safetensors checkpoint directory (float16/bfloat16/float32)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    config = _complete(read_json(path / "config.json", SourceError), str(path / "config.json"))
    maps: list[_Mapped] = []
    tensors: dict[str, _Entry] = {}
    try:
        for f in _shards(path):
            check_safetensors(f, SourceError)  # size and header sanity: the header is trusted
            try:
                maps.append(_Mapped(f))
            except (OSError, ValueError) as e:
                raise SourceError(f"{f}: unreadable safetensors file ({e})") from e
            for k, entry in _hf_tensors(f, maps[-1]).items():
                if k in tensors:
                    raise SourceError(f"{f}: tensor {k} is in another shard too")
                tensors[k] = entry
    except BaseException:
        _close_all(maps)()
        raise
    if "lm_head.weight" not in tensors:
        # Tied in all but name: transformers would leave lm_head random, no model is saved so.
        config["tie_word_embeddings"] = True
    elif config.get("tie_word_embeddings"):
        del tensors["lm_head.weight"]  # transformers ignores a stored copy of a tied head
    # The name, never where the checkpoint happened to be saved on someone's machine.
    saved_as = config.pop("_name_or_path", None)
    name = saved_as if isinstance(saved_as, str) and _HUB_ID.fullmatch(saved_as) else None
    return Source(config, path, name or path.resolve().name, tensors, _close_all(maps))


def load_gguf(path: str | Path, tokenizer_out: Path) -> Source:
    """A GGUF file of arch llama or qwen2, each tensor dequantized to float32 when read; writes
    its tokenizer (tokenizer.json, tokenizer_config.json) into `tokenizer_out`."""
    from .gguf_source import load_gguf as load  # imported here: it builds on this module

    return load(path, tokenizer_out)
