"""What every converter input is: a `Source` (a completed HF config and tensors read on
demand) and the memory-mapped file its readers share (sources.py: HF, gguf_source.py: GGUF)."""

from __future__ import annotations

import mmap
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..formats.bitnest import ARCHS
from .rope import rope_params

INSTALL = "pip install 'bitnest-mlx[convert]'"  # the extra that brings gguf and transformers


class SourceError(ValueError):
    """An input checkpoint the converter cannot read; the message names the file and the problem."""


class Entry(NamedTuple):
    """One tensor of a source: its HF shape, and what reads it as a new float32 array."""

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
    _tensors: dict[str, Entry] = field(default_factory=dict, repr=False)
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
            k: Entry(np.shape(v), partial(np.array, v, dtype=np.float32))
            for k, v in weights.items()
        }
        return cls(complete_hf_config(dict(config), name), tokenizer_dir, name, tensors)

    def names(self) -> list[str]:
        """HF tensor names, in checkpoint order (no lm_head.weight when the embedding is tied)."""
        return list(self._tensors)

    def _entry(self, name: str) -> Entry:
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


def complete_hf_config(config: dict, where: str) -> dict:
    """`config` with model_type checked and head_dim, num_key_value_heads, rope_theta and
    rope_scaling (None for default RoPE) filled in."""
    if config.get("model_type") not in ARCHS:
        raise SourceError(f"{where}: model_type {config.get('model_type')!r}, expected {ARCHS}")
    dims = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in dims if not isinstance(config.get(k), numbers.Integral)]
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


class MappedFile:
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


def close_all(maps: list[MappedFile]) -> Callable[[], None]:
    def close() -> None:
        for m in maps:
            m.close()

    return close
