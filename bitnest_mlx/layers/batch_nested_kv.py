"""The nested KV cache of several sequences decoded together: mlx-lm's BatchKVCache protocol
(left padding, per-row offsets, merge / extract / filter / extend, prepare / finalize) over the
same (hi, lo, scales) planes NestedKVCache stores, so BatchGenerator batches a bitnest model.

Rows are left-padded: row b's token at position p sits at index p + left_padding[b]. Padding is
zero planes with zero scales (it reads as 0), and the causal mask with left padding hides it.

The codec (how K/V become planes and back) and the single-sequence class are those of the caches
merged (`NestedKVCache`, whose `merge` builds this): this module does not import that one, so the
two stay one import direction apart.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, dynamic_roll

from .kv_attention import pure_attention

Planes = tuple[mx.array, ...]


class BatchNestedKVCache(BatchKVCache):
    """Per layer, B sequences: K (after RoPE) and V quantized at write time, read as KV4 (draft)
    or KV8 (target). `offset` [B] is each row's next position (negative while it is padding),
    `_idx` the shared write index. Inherits prepare, trim, make_mask, size and empty unchanged:
    they touch only the bookkeeping, which is the same as mlx-lm's."""

    def __init__(self, left_padding: list[int], single: Any):
        """`single`: an empty single-sequence cache (NestedKVCache) with the rows' KV format;
        it encodes and decodes the planes, and `extract` returns its kind."""
        super().__init__(left_padding)
        self.single = single
        self.keys: Planes | None = None
        self.values: Planes | None = None

    # -- storage ----------------------------------------------------------------------------

    def _map(self, fn: Callable[[mx.array], mx.array]) -> None:
        """Apply `fn` to every stored array (each has the batch on axis 0, positions on 2)."""
        self.keys = tuple(fn(a) for a in self.keys)
        self.values = tuple(fn(a) for a in self.values)

    def _store(self, keys: mx.array, values: mx.array, use_kernels: bool = False) -> None:
        prev, n = self._idx, keys.shape[2]
        new_k, new_v = self.single.encode_kv(keys, values, use_kernels)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step

            def extend(old: mx.array | None, new: mx.array) -> mx.array:
                fresh = mx.zeros((*new.shape[:2], grow, *new.shape[3:]), dtype=new.dtype)
                return fresh if old is None else mx.concatenate([old[:, :, :prev], fresh], axis=2)

            self.keys = tuple(extend(o, x) for o, x in zip(self.keys or (None,) * 3, new_k))
            self.values = tuple(extend(o, x) for o, x in zip(self.values or (None,) * 3, new_v))
        self.offset = self.offset + n
        self._idx += n
        for store, new in ((self.keys, new_k), (self.values, new_v)):
            for a, x in zip(store, new):
                a[:, :, prev : self._idx] = x

    def update_and_fetch(
        self, keys: mx.array, values: mx.array, draft: bool = False, use_kernels: bool = False
    ) -> tuple[mx.array, mx.array]:
        self._store(keys, values, use_kernels)
        k = tuple(a[:, :, : self._idx] for a in self.keys)
        v = tuple(a[:, :, : self._idx] for a in self.values)
        decode = self.single._decode
        return decode(k, draft, keys.dtype), decode(v, draft, values.dtype)

    def attend(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        *,
        scale: float,
        mask: Any,
        draft: bool = False,
        k_offset: mx.array | None = None,
        use_kernels: bool = True,
    ) -> mx.array:
        """NestedKVCache.attend for B rows. The read always takes the pure path: the Metal
        kernel reads one unpadded sequence (`n_kv` keys from index 0), and left padding needs
        the mask. The write is per row, so the write kernel serves a batch too."""
        return pure_attention(
            self,
            q,
            k,
            v,
            scale=scale,
            mask=mask,
            draft=draft,
            k_offset=k_offset,
            use_kernels=use_kernels,
        )

    # -- mlx-lm's batching protocol ---------------------------------------------------------

    def finalize(self) -> None:
        """After a right-padded prefill: roll each row's padding to its left."""
        if self._right_padding is not None:
            shift = self._right_padding[:, None]
            self._map(lambda a: dynamic_roll(a, shift, axis=2))
            self.offset = self.offset - self._right_padding
            self.left_padding = self.left_padding + self._right_padding
            self._right_padding = None

    def filter(self, batch_indices: list[int] | mx.array) -> None:
        """Keep the given rows, then drop the padding columns every kept row has."""
        if self.keys is not None:
            self._map(lambda a: a[batch_indices])
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self._map(lambda a: a[:, :, shift:])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: BatchNestedKVCache) -> None:
        """Append `other`'s rows, both right-aligned at the larger write index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = self if self.keys is not None else other
        parts = [c._aligned(idx, size, like) for c in (self, other)]
        n = len(like.keys)
        self.keys = tuple(mx.concatenate([p[0][i] for p in parts]) for i in range(n))
        self.values = tuple(mx.concatenate([p[1][i] for p in parts]) for i in range(n))
        self.left_padding = mx.concatenate([p[2] for p in parts])
        self.offset = mx.concatenate([self.offset, other.offset])
        self._idx = idx

    def _aligned(self, idx: int, size: int, like: BatchNestedKVCache) -> tuple:
        """(keys, values, left_padding) padded so this cache's write index lands at `idx` and
        its arrays hold `size` positions; an empty cache becomes zero rows shaped like `like`."""
        rows = self.offset.shape[0]

        def no_positions(a: mx.array) -> mx.array:
            return mx.zeros((rows, a.shape[1], 0, *a.shape[3:]), a.dtype)

        keys = self.keys if self.keys is not None else tuple(map(no_positions, like.keys))
        values = self.values if self.values is not None else tuple(map(no_positions, like.values))
        left = idx - self._idx
        right = size - keys[0].shape[2] - left

        def pad(a: mx.array) -> mx.array:
            if right < 0:
                a = a[:, :, :right]
            widths = [(0, 0), (0, 0), (left, max(right, 0))] + [(0, 0)] * (a.ndim - 3)
            return mx.pad(a, widths) if left or right > 0 else a

        return tuple(map(pad, keys)), tuple(map(pad, values)), self.left_padding + left

    def extract(self, idx: int) -> Any:
        """Row `idx` as a single-sequence cache (its padding dropped)."""
        cache = type(self.single)(self.single.group_size, quantized=self.single.quantized)
        start = self.left_padding.tolist()[idx]
        if self.keys is not None:
            row = [mx.contiguous(a[idx : idx + 1, :, start : self._idx]) for a in self.keys]
            row += [mx.contiguous(a[idx : idx + 1, :, start : self._idx]) for a in self.values]
            cache.state = row
        return cache

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchNestedKVCache:
        """One batch cache from single-sequence caches, each left-padded to the longest."""
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        first = caches[0]
        single = type(first)(first.group_size, quantized=first.quantized)
        batch = cls([longest - n for n in lengths], single)
        if longest == 0:
            return batch
        full = next(c for c in caches if c.keys is not None)

        def planes(pick: Callable[[Any], Planes]) -> Planes:
            out = []
            for i, like in enumerate(pick(full)):
                a = mx.zeros((len(caches), like.shape[1], longest, *like.shape[3:]), like.dtype)
                for row, (c, n) in enumerate(zip(caches, lengths)):
                    if n:
                        a[row : row + 1, :, longest - n :] = pick(c)[i][:, :, :n]
                out.append(a)
            return tuple(out)

        batch.keys = planes(lambda c: c.keys)
        batch.values = planes(lambda c: c.values)
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))
