"""DeepSeek-V4 per-layer cache: window K=V rows and compressor pools, with exact rollback.

Storage only: the model's attention and compressors decide what goes in; this module decides
what must be kept so that `DSV4Cache.trim(k)` after a rejected speculative step is exact.
"""

from __future__ import annotations

import mlx.core as mx


class CompressorPool:
    """One compressor's state: raw (kv, gate) rows, as the projections gave them, and the
    compressed entries so far (float32, or as the attention reads them: its compressor's).

    Entries are immutable once their block is complete, so rollback keeps floor(p/ratio) of
    them; the raw rows of the pending block (and, at ratio 4, the block before it, whose first
    half feeds the next entry) rebuild it exactly.
    """

    def __init__(self, ratio: int, overlap: bool):
        self.ratio, self.overlap = ratio, overlap
        self.kv = self.gate = self.entries = None
        self.start = 0  # position of raw row 0

    @property
    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[1]

    def keep_from(self, floor: int) -> None:
        start = max(0, (floor // self.ratio - int(self.overlap)) * self.ratio)
        if self.kv is not None and start > self.start:
            cut = start - self.start
            self.kv, self.gate, self.start = self.kv[:, cut:], self.gate[:, cut:], start

    def trim_to(self, offset: int) -> None:
        if self.kv is not None:
            keep = offset - self.start
            self.kv, self.gate = self.kv[:, :keep], self.gate[:, :keep]
        if self.entries is not None:
            self.entries = self.entries[:, : offset // self.ratio]


class DSV4Cache:
    """Per-layer state with exact rollback of up to `max_rollback` tokens.

    Holds the last window - 1 + max_rollback K=V rows, the compressed entries and the raw rows
    a pending compressor block needs. Nothing is a running nonlinear state, so `trim(k)` only
    drops rows and entries. Rolling back past what was kept is an error, never an approximation.
    """

    def __init__(self, window: int, ratio: int, max_rollback: int = 32):
        self.window, self.ratio, self.max_rollback = window, ratio, max_rollback
        self.offset = 0
        self.floor = 0  # the earliest offset `trim` can return to
        self.keys = None  # [B, 1, n, head_dim] window rows from position keys_start
        self.keys_start = 0
        self.pools: dict[str, CompressorPool] = {}
        if ratio:
            self.pools["compressor"] = CompressorPool(ratio, overlap=ratio == 4)
        if ratio == 4:
            self.pools["indexer"] = CompressorPool(ratio, overlap=True)

    def append_keys(self, kv: mx.array) -> mx.array:
        self.keys = kv if self.keys is None else mx.concatenate([self.keys, kv], axis=2)
        return self.keys

    def advance(self, n: int) -> None:
        """Called once the layer has consumed n tokens: move on and drop unneeded history."""
        self.offset += n
        self.floor = max(self.floor, self.offset - self.max_rollback)
        start = max(0, self.floor - self.window + 1)
        if start > self.keys_start:
            self.keys = self.keys[:, :, start - self.keys_start :]
            self.keys_start = start
        for pool in self.pools.values():
            pool.keep_from(self.floor)

    def depend_on(self, x: mx.array) -> None:
        """Evaluating this cache also evaluates x (a pipeline send; layers/pipeline.py)."""
        self.keys = mx.depends(self.keys, x)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if self.offset - n < self.floor:
            raise ValueError(
                f"cannot roll back {n} tokens from offset {self.offset}: history kept down to "
                f"offset {self.floor} (max_rollback={self.max_rollback})"
            )
        self.offset -= n
        if self.keys is not None:
            self.keys = self.keys[:, :, : self.offset - self.keys_start]
        for pool in self.pools.values():
            pool.trim_to(self.offset)
        return n

    @property
    def state(self) -> list[mx.array]:
        arrays = [self.keys] + [a for p in self.pools.values() for a in (p.kv, p.gate, p.entries)]
        return [a for a in arrays if a is not None]

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)


__all__ = ["CompressorPool", "DSV4Cache"]
