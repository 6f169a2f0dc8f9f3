"""The compressed branch of DeepSeek-V4 attention: the Compressor and the lightning Indexer.

Kept apart from models/deepseek_v4.py so that file reads as the block-level math. These take
plain sizes rather than `ModelArgs`, so they import nothing from the model module (no cycle).
Parameter names (`wkv`, `wgate`, `ape`, `norm`, `wq_b`, `weights_proj`, `compressor`) are the
official checkpoint names under `layers.L.attn.{compressor,indexer}`.

Every parameter's shape is read from the bundle schedule (formats/dsv4_schedule.py `schedule`,
`Slots` below) by `linear` / `norm` / `tensor`, so the names and shapes a bundle holds are
written once, there, and the model is built from them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from bitnest_mlx.formats.dsv4_schedule import Slot
from bitnest_mlx.layers.dsv4_cache import CompressorPool
from bitnest_mlx.layers.dsv4_ops import PartialRoPE, hadamard_fp4

Slots = dict[str, Slot]  # `schedule(config)`: every tensor's name, kind and shape


def linear(slots: Slots, name: str) -> nn.Linear:
    """A bias-free Linear of slot `name`'s shape [out, in]."""
    out_features, in_features = slots[name].shape
    return nn.Linear(in_features, out_features, bias=False)


def norm(slots: Slots, name: str, eps: float) -> nn.RMSNorm:
    """An RMSNorm whose weight is slot `name.weight`."""
    return nn.RMSNorm(slots[f"{name}.weight"].shape[0], eps=eps)


def tensor(slots: Slots, name: str, fill: float = 0.0) -> mx.array:
    """A plain parameter of slot `name`'s shape (int32 for an "int" slot), filled with `fill`
    until the bundle's values are loaded."""
    slot = slots[name]
    dtype = mx.int32 if slot.kind == "int" else mx.float32
    # A fill array, not a number: mx.full makes a float fill float32 whatever dtype says.
    return mx.full(slot.shape, mx.array(fill, dtype=dtype))


class Compressor(nn.Module):
    """Gated pooling of `ratio` rows into one entry (ratio 4: 8 overlapping rows), per channel."""

    def __init__(self, slots: Slots, prefix: str, ratio: int, eps: float, rope: PartialRoPE):
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(slots, f"{prefix}.wkv")
        self.wgate = linear(slots, f"{prefix}.wgate")
        self.ape = tensor(slots, f"{prefix}.ape")
        self.norm = norm(slots, f"{prefix}.norm", eps)
        self.head_dim = self.norm.weight.shape[0]
        self._rope = rope  # shared with the attention; not a parameter

    def __call__(
        self,
        x: mx.array,
        pool: CompressorPool,
        offset: int,
        finish: Callable[[mx.array], mx.array] | None = None,
    ) -> mx.array:
        """Feed positions offset.. offset+L-1; return all entries so far [B, n, head_dim]:
        float32, or as `finish` makes each new entry once (the attention's keys)."""
        L, r = x.shape[1], self.ratio
        # Raw rows stay in the projections' dtype: widened to float32, with the position bias
        # added, only when their block is pooled (once, not a conversion every step).
        kv, gate = self.wkv(x), self.wgate(x)
        if pool.kv is None:
            pool.kv, pool.gate, pool.start = kv, gate, offset
        else:
            pool.kv = mx.concatenate([pool.kv, kv], axis=1)
            pool.gate = mx.concatenate([pool.gate, gate], axis=1)
        first, last = pool.num_entries, (offset + L) // r
        if last > first:
            new = self._pool_blocks(pool, first, last)
            new = new if finish is None else finish(new)
            pool.entries = new if pool.entries is None else mx.concatenate([pool.entries, new], 1)
        if pool.entries is None:  # none yet: an empty view, not an array to make
            return kv[:, :0, : self.head_dim]
        return pool.entries

    def _pool_blocks(self, pool: CompressorPool, first: int, last: int) -> mx.array:
        r, d = self.ratio, self.head_dim
        B, m = pool.kv.shape[0], last - first
        lo = max(first - int(pool.overlap), 0) * r - pool.start
        kv = pool.kv[:, lo : last * r - pool.start].astype(mx.float32)
        gate = pool.gate[:, lo : last * r - pool.start]
        # Blocks start at multiples of r: row i of a block is at position ≡ i (mod r).
        kv, gate = kv.reshape(B, -1, r, kv.shape[-1]), gate.reshape(B, -1, r, gate.shape[-1])
        gate = gate.astype(mx.float32) + self.ape
        if pool.overlap:
            if first == 0:  # entry 0 has no previous block: zero rows with zero weight
                kv = mx.concatenate([mx.zeros_like(kv[:, :1]), kv], axis=1)
                gate = mx.concatenate([mx.full(gate[:, :1].shape, -mx.inf), gate], axis=1)
            # Entry j pools the first half of block j-1's rows with the second half of block j's.
            kv = mx.concatenate([kv[:, :m, :, :d], kv[:, 1:, :, d:]], axis=2)
            gate = mx.concatenate([gate[:, :m, :, :d], gate[:, 1:, :, d:]], axis=2)
        pooled = (mx.softmax(gate, axis=2, precise=True) * kv).sum(axis=2)
        pooled = self.norm(pooled)
        # Entry j is rotated at its block's first position j·ratio.
        return self._rope(pooled[:, None], offset=first, scale=float(r))[:, 0]


class Indexer(nn.Module):
    """Lightning indexer: picks the top-k compressed entries per query on ratio-4 layers."""

    def __init__(
        self, slots: Slots, prefix: str, n_heads: int, topk: int, eps: float, rope: PartialRoPE
    ):
        super().__init__()
        self.n_heads, self.topk = n_heads, topk
        self.wq_b = linear(slots, f"{prefix}.wq_b")
        self.weights_proj = linear(slots, f"{prefix}.weights_proj")
        self.compressor = Compressor(slots, f"{prefix}.compressor", 4, eps, rope)
        self.head_dim = self.compressor.head_dim
        self._rope = rope

    def __call__(
        self,
        x: mx.array,
        qr: mx.array,
        pool: CompressorPool,
        offset: int,
        visible: np.ndarray,
        qat: bool,
    ) -> np.ndarray | mx.array:
        """visible [L, N] (host) -> the entries each query attends to: `visible` itself when
        there are at most top-k entries, else [B, L, N] on the device."""
        B, L, _ = x.shape
        keys = self.compressor(x, pool, offset)
        if keys.shape[1] <= self.topk:
            return visible  # the top-k of at most k entries is all of them
        q = self.wq_b(qr).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = self._rope(q, offset=offset)
        if qat:
            q, keys = hadamard_fp4(q), hadamard_fp4(keys)
        scale = self.n_heads**-0.5 * self.head_dim**-0.5
        logits = q.astype(mx.float32) @ keys[:, None].swapaxes(-1, -2)  # [B, H, L, N]
        score = _weighted(logits, self.weights_proj(x), scale).sum(axis=1)  # [B, L, N]
        shown = mx.array(visible)
        top = mx.argpartition(_hidden_last(score, shown), self.topk - 1, axis=-1)
        chosen = mx.put_along_axis(
            mx.zeros(score.shape, dtype=mx.bool_), top[..., : self.topk], mx.array(True), axis=-1
        )
        return chosen & shown


@partial(mx.compile, shapeless=True)
def _weighted(logits: mx.array, w: mx.array, scale: float) -> mx.array:
    """relu(q·k) times each head's weight [B, L, H] (the index scoring's elementwise part)."""
    return mx.maximum(logits, 0) * (w.astype(mx.float32) * scale).transpose(0, 2, 1)[..., None]


@partial(mx.compile, shapeless=True)
def _hidden_last(score: mx.array, shown: mx.array) -> mx.array:
    """The arg-partition's key: -score, invisible entries last."""
    return -mx.where(shown, score, -mx.inf)


__all__ = ["Compressor", "Indexer"]
