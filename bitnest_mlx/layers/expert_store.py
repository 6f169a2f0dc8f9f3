"""Routed experts kept on disk, with the most recently used ones in a byte-bounded LRU.

An MXTQ expert stack `[E, out, words]` is stored contiguously, expert after expert, in a
safetensors file (pre-stacked), or one tensor per expert (per-expert layout); either way one
expert's codes are one byte range. `ExpertStore.fetch` reads the ranges of the experts a batch
routes to with plain file reads (not a memory map: mapped pages would count as resident memory
for as long as the map lives) into MLX arrays, keeps them in an LRU keyed by (tensor, expert)
and evicts the least recently used ones once the cached bytes exceed the budget.

Only the codes (`tq_packed`) go through the store: the row norms are 1/500 of an expert's bytes
at 2 bits and stay resident with the other small tensors. The values fetched are the stored
bytes, so logits with and without a budget are bit-identical (layers/mxtq_linear.py computes on
them exactly as on the resident stack).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.dsv4_bundle import INDEX_FILE, BundleError, stored_expert_name
from ..formats.safetensors_io import read_header, read_json

_NUMPY = {"U32": np.uint32, "F16": np.float16, "U8": np.uint8}


@dataclass(frozen=True)
class ExpertSource:
    """Where one expert stack's codes live: per expert (file, byte offset), and one expert's
    shape and dtype."""

    name: str
    ranges: tuple[tuple[Path, int], ...]
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def expert_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def tensor_ranges(path: str | Path) -> dict[str, tuple[Path, int, str, list[int]]]:
    """{stored key: (file, absolute data offset, safetensors dtype, shape)} of a bundle's files
    (those its index names, else every *.safetensors). Assumes a bundle that `dsv4_bundle.read`
    accepted: headers are read, not validated."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        names = sorted(set(read_json(index, BundleError)["weight_map"].values()))
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        for key, span in read_header(f, BundleError).items():
            out[key] = (f, span.begin, span.dtype, list(span.shape))
    return out


def expert_source(
    ranges: dict[str, tuple[Path, int, str, list[int]]], name: str, n_experts: int
) -> ExpertSource:
    """The codes of routed-expert slot `name` (`layers.L.ffn.switch_mlp.<proj>`), pre-stacked
    or per expert."""
    stacked = ranges.get(f"{stored_expert_name(name)}.tq_packed")
    if stacked is not None:
        f, start, dtype, shape = stacked
        one = tuple(shape[1:])
        step = int(np.prod(one)) * np.dtype(_NUMPY[dtype]).itemsize
        at = tuple((f, start + e * step) for e in range(n_experts))
    else:
        parts = [ranges[f"{stored_expert_name(name, e)}.tq_packed"] for e in range(n_experts)]
        dtype, one = parts[0][2], tuple(parts[0][3])
        at = tuple((f, start) for f, start, _, _ in parts)
    return ExpertSource(name, at, one, np.dtype(_NUMPY[dtype]))


class ExpertStore:
    """A byte-bounded LRU of expert codes read from disk, shared by every expert layer.

    Counters: `hits` and `misses` per expert asked for, `bytes_read` from disk.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"expert memory budget {budget_bytes} bytes is negative")
        self.budget_bytes = int(budget_bytes)
        self._cache: OrderedDict[tuple[str, int], mx.array] = OrderedDict()
        self._files: dict[Path, int] = {}
        self.cached_bytes = 0
        self.hits = self.misses = self.bytes_read = 0

    def fetch(self, source: ExpertSource, experts: list[int]) -> mx.array:
        """The codes of `experts` of one stack, stacked [len(experts), *shape].

        Experts of this call are marked most recent before any eviction, so a budget smaller
        than one call's experts still serves the call (the caller holds them) and then keeps
        the most recent ones that fit."""
        parts = []
        for e in experts:
            key = (source.name, int(e))
            a = self._cache.get(key)
            if a is None:
                self.misses += 1
                a = self._read(source, int(e))
                self._cache[key] = a
                self.cached_bytes += a.nbytes
            else:
                self.hits += 1
                self._cache.move_to_end(key)
            parts.append(a)
        while self.cached_bytes > self.budget_bytes and self._cache:
            _, old = self._cache.popitem(last=False)
            self.cached_bytes -= old.nbytes
        return parts[0][None] if len(parts) == 1 else mx.stack(parts)

    def _read(self, source: ExpertSource, e: int) -> mx.array:
        f, offset = source.ranges[e]
        fd = self._files.get(f)
        if fd is None:
            fd = self._files[f] = os.open(f, os.O_RDONLY)
        buf = np.empty(source.shape, dtype=source.dtype)
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{f}: short read at byte {offset + done} (expert {e})")
            done += got
        self.bytes_read += done
        a = mx.array(buf)
        mx.eval(a)  # copy now, so the NumPy buffer is freed here
        return a

    def stats(self) -> dict:
        asked = self.hits + self.misses
        return {
            "budget_bytes": self.budget_bytes,
            "cached_bytes": self.cached_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / asked if asked else 0.0,
            "bytes_read": self.bytes_read,
        }

    def reset_stats(self) -> None:
        self.hits = self.misses = self.bytes_read = 0

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()

    def __del__(self):
        self.close()


__all__ = ["ExpertSource", "ExpertStore", "expert_source", "tensor_ranges"]
