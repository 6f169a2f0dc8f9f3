"""Nested KV cache: two 4-bit planes per (token, kv head); KV4 for the draft, KV8 for the target."""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from .. import kernels
from ..formats.bitnest.numerics import nested
from .kv_attention import pure_attention


def nest_quantize(x: mx.array, group: int) -> tuple[mx.array, mx.array, mx.array]:
    """x [..., D] -> (hi, lo) uint32 [..., D/8] and scales float32 [..., D/group].

    s = max|x|/7 (1 if 0), q4 = clip(round(x/s), -8, 7), qr = clip(round((x - q4 s)/(s/16)), -8, 7),
    stored as u = q + 8; fp32 math, round half to even. Launched as max|x| (two kernels) and two
    compiled elementwise kernels, one a plane (the scale comes out of the hi plane's). Each reads
    a group's even and odd columns side by side and writes its plane's bytes, column 2j in the
    low nibble of byte j and 2j + 1 in the high one: MLX's 4-bit word, read as uint32.
    """
    xg = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    amax = mx.abs(xg).max(axis=-1, keepdims=True)
    even, odd = xg[..., 0::2], xg[..., 1::2]
    hi, s = _hi_bytes(even, odd, amax)
    words = (*x.shape[:-1], x.shape[-1] // 2)
    lo = _lo_bytes(even, odd, amax).reshape(words).view(mx.uint32)
    return hi.reshape(words).view(mx.uint32), lo, s[..., 0]


# Why the code is written as it is: MLX fuses a compiled function into one kernel only along
# chains under 11 ops deep from its last output, through intermediates no other output reads, and
# a shapeless compile splits at the broadcast of the group's scale. So each plane is its own
# (per-shape) compile with one output chain, and bytes are formed in float32 (u_even + 16 u_odd,
# exact integers) and cast once. Two clamps are dropped because they never bind on finite input:
# |x| <= 7 s (s = max|x|/7 rounded) gives |q4| <= 7, and |x - q4 s| <= s/2 (plus rounding, far
# below s/32) gives qr >= -8; qr <= 7 can bind (a residual of s/2 rounds to 8) and is kept.
def _scale(amax: mx.array, shape: tuple[int, ...]) -> mx.array:
    s = amax.astype(mx.float32) / 7.0
    # Half-precision amax is 0 exactly when amax/7 is (its smallest step, /7, is a normal
    # float32): testing amax saves a level of the chain.
    zero = (amax if amax.dtype != mx.float32 else s) == 0
    return mx.broadcast_to(mx.where(zero, 1.0, s), shape)


@mx.compile
def _hi_bytes(even: mx.array, odd: mx.array, amax: mx.array) -> tuple[mx.array, mx.array]:
    s = _scale(amax, even.shape)
    q4e, q4o = (mx.round(c.astype(mx.float32) / s) for c in (even, odd))
    return ((q4e + 136) + 16 * q4o).astype(mx.uint8), s


@mx.compile
def _lo_bytes(even: mx.array, odd: mx.array, amax: mx.array) -> mx.array:
    s = _scale(amax, even.shape)

    def qr(c: mx.array) -> mx.array:
        c = c.astype(mx.float32)
        return mx.minimum(mx.round((c - mx.round(c / s) * s) / (s / 16)), 7)

    return ((qr(even) + 136) + 16 * qr(odd)).astype(mx.uint8)


def nest_dequantize(
    hi: mx.array,
    lo: mx.array,
    scales: mx.array,
    group: int,
    draft: bool,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """KV4 = q4·s (draft) or KV8 = (16 q4 + qr)·s/16 (target), computed in float32 and
    returned in `dtype`. The planes share one bias array; KV8's sum and cast are one kernel."""
    kw = dict(group_size=group, bits=4)
    biases = -8 * scales
    x = mx.dequantize(hi, scales, biases, **kw)
    if draft:
        return x.astype(dtype)
    return _nested_in(dtype)(x, mx.dequantize(lo, scales, biases, **kw))


@cache
def _nested_in(dtype: mx.Dtype):
    """KV8 from its planes' float32 values, cast to `dtype`: one compiled kernel."""
    return mx.compile(lambda hi, lo: nested(hi, lo).astype(dtype), shapeless=True)


class NestedKVCache(_BaseCache):
    """Per layer: K (after RoPE) and V quantized at write time; reads dequantize one plane or both.

    Attention (`attend`) always reads the quantized values, the tokens just written included.
    Every write lands at `offset`, so a verify pass after `trim` overwrites what a draft round
    wrote. With `quantized=False` (parity/debug mode) K and V are stored as they are.
    """

    step = 256

    def __init__(self, group_size: int = 128, quantized: bool = True):
        self.group_size = group_size
        self.quantized = quantized
        self.offset = 0
        self.keys: tuple[mx.array, ...] | None = None
        self.values: tuple[mx.array, ...] | None = None

    def _encode_both(
        self, keys: mx.array, values: mx.array
    ) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """K and V quantized as one array, side by side along D (the group divides D, so no
        group spans both): one reduction and one kernel a plane for the two, the same bits."""
        d = keys.shape[-1]
        hi, lo, s = nest_quantize(mx.concatenate([keys, values], axis=-1), self.group_size)
        w, g = d // 8, d // self.group_size
        return (hi[..., :w], lo[..., :w], s[..., :g]), (hi[..., w:], lo[..., w:], s[..., g:])

    def encode_kv(
        self, keys: mx.array, values: mx.array, use_kernels: bool = False
    ) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        """K and V as stored: both by one write kernel where it serves (`use_kernels`, a Mac,
        its self-test passed), else each by `nest_quantize`; the same bits either way."""
        if not self.quantized:
            return (keys,), (values,)
        if (
            use_kernels
            and kernels.nested_kv_write_supported(keys, values, self.group_size)
            and kernels.use("nested_kv_write", write_self_test)
        ):
            kernels.record("nested_kv_write", "kernel")
            return kernels.nested_kv_write(keys, values, self.group_size)
        kernels.record("nested_kv_write", "pure")
        return self._encode_both(keys, values)

    def _decode(self, parts: tuple[mx.array, ...], draft: bool, dtype: mx.Dtype) -> mx.array:
        if not self.quantized:
            return parts[0]
        return nest_dequantize(*parts, self.group_size, draft, dtype)

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
        """Store k, v [B, Hkv, L, D] at `offset`, then attention of q [B, Hq, L, D] over every
        stored position read as KV4 (draft) or KV8 (target): [B, Hq, L, D].

        `k_offset` [B, Hkv, offset + L, D] is added to the keys as read (a per-channel offset
        kept out of the quantized values, e.g. Qwen2's rotated k bias). The Metal kernel reads
        the planes in place but has no offset term, so an offset takes the pure path, which
        dequantizes them (docs/kernels.md).
        """
        if (
            k_offset is None
            and use_kernels
            and self.quantized
            and kernels.use("nested_kv", kernel_self_test)
            and kernels.nested_kv_supported(q, mask, q.shape[-1], self.group_size)
        ):
            kernels.record("nested_kv", "kernel")
            self._store(k, v, use_kernels=True, kv4_only=draft)
            return kernels.nested_kv_attention(
                q,
                self.keys,
                self.values,
                draft=draft,
                scale=scale,
                group=self.group_size,
                n_kv=self.offset,
            )
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

    def update_and_fetch(
        self, keys: mx.array, values: mx.array, draft: bool = False, use_kernels: bool = False
    ) -> tuple[mx.array, mx.array]:
        self._store(keys, values, use_kernels, kv4_only=draft)
        k = tuple(a[:, :, : self.offset] for a in self.keys)
        v = tuple(a[:, :, : self.offset] for a in self.values)
        return self._decode(k, draft, keys.dtype), self._decode(v, draft, values.dtype)

    def _store(
        self, keys: mx.array, values: mx.array, use_kernels: bool = False, kv4_only: bool = False
    ) -> None:
        """Store K and V at `offset` and advance it; `keys`/`values` hold (hi, lo, scales),
        capacity-sized, the first `offset` positions valid.

        A step that reads KV4 (`kv4_only`: a draft) leaves the lo planes of its positions as
        they were: nothing reads them before the round's verify pass writes those positions
        again, all planes (the draft reads hi and scales only)."""
        prev, n = self.offset, keys.shape[2]
        new_k, new_v = self.encode_kv(keys, values, use_kernels)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            grow = (self.step + n - 1) // self.step * self.step

            def extend(old, new):
                fresh = mx.zeros((*new.shape[:2], grow, *new.shape[3:]), dtype=new.dtype)
                return fresh if old is None else mx.concatenate([old[:, :, :prev], fresh], axis=2)

            self.keys = tuple(extend(o, x) for o, x in zip(self.keys or (None,) * 3, new_k))
            self.values = tuple(extend(o, x) for o, x in zip(self.values or (None,) * 3, new_v))
        self.offset += n
        for store, new in ((self.keys, new_k), (self.values, new_v)):
            for part, (a, x) in enumerate(zip(store, new)):
                if kv4_only and self.quantized and part == 1:  # (hi, lo, scales)
                    continue
                a[:, :, prev : self.offset] = x

    @property
    def state(self):
        if self.keys is None:
            return []
        return [a[:, :, : self.offset] for a in (*self.keys, *self.values)]

    @state.setter
    def state(self, v):
        half = len(v) // 2
        self.keys, self.values = tuple(v[:half]), tuple(v[half:])
        self.offset = v[0].shape[2]
        # Derived, so the arrays alone restore the cache (mlx-lm's prompt-cache files keep no
        # meta state): planes + scales when quantized, else plain K and V.
        self.quantized = half == 3
        if self.quantized:
            self.group_size = self.keys[0].shape[-1] * 8 // self.keys[2].shape[-1]

    @property
    def meta_state(self):
        return tuple(map(str, (self.group_size, int(self.quantized))))

    @meta_state.setter
    def meta_state(self, v):
        self.group_size, self.quantized = int(v[0]), bool(int(v[1]))

    @classmethod
    def merge(cls, caches: list[NestedKVCache]) -> Any:
        """mlx-lm's batching protocol: BatchGenerator merges one cache per sequence (and its
        server batches only models whose caches have `merge`)."""
        from .batch_nested_kv import BatchNestedKVCache  # it builds on this module

        return BatchNestedKVCache.merge(caches)

    def is_trimmable(self) -> bool:
        return True

    def skip(self, n: int) -> None:
        """Advance past `n` positions that a draft call of a layer it skips does not compute:
        nothing is written; the round's verify pass, after the trim that undoes this like any
        write, writes them."""
        self.offset += n

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def size(self) -> int:
        return self.offset

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))


def attention_self_test(
    runner: kernels.Runner | None = None,
    *,
    draft: bool = False,
    rows: int = 4,
    splits: int | None = None,
    big: bool = False,
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) attention of `rows` queries over the nested cache, both passes (key
    splits, then their log-sum-exp merge): head_dim 128, GQA 2, 300 cached keys in KV groups of
    32 (4096 keys, 8 KV heads, groups of 64 when big, the timed shape)."""
    n_kv, heads, group = (4096, 8, 64) if big else (300, 2, 32)
    k1, k2, k3 = mx.random.split(mx.random.key(2), 3)
    q = mx.random.normal((1, 2 * heads, rows, 128), key=k1)
    kp = nest_quantize(mx.random.normal((1, heads, n_kv, 128), key=k2) * 2, group)
    vp = nest_quantize(mx.random.normal((1, heads, n_kv, 128), key=k3), group)
    scale = 128**-0.5
    got = kernels.nested_kv_attention(
        q, kp, vp, draft=draft, scale=scale, group=group, splits=splits, runner=runner
    )
    k, v = (mx.repeat(nest_dequantize(*p, group, draft), 2, axis=1) for p in (kp, vp))
    mask = "causal" if rows > 1 else None
    return got, mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def kernel_self_test(runner: kernels.Runner | None = None) -> tuple[mx.array, mx.array]:
    """(kernel, pure) attention as decode and verification really call it: the draft (KV4) at
    L = 1 with the launch's own split count, the target (KV8) at L = 4 over 4 splits, the last
    one ragged."""
    pairs = [
        attention_self_test(runner, draft=True, rows=1),
        attention_self_test(runner, draft=False, rows=4, splits=4),
    ]
    got, want = zip(*pairs)
    return mx.concatenate(got, axis=2), mx.concatenate(want, axis=2)


def write_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) KV8 of K and V as the write kernel and `nest_quantize` store them: a
    decode token and a 3-token verify write, head_dim 128 at group 64 and 64 at group 32, an
    all-zero row among them (its scale is 1); `big`: a 512-token prefill of 8 kv heads."""
    cases = (((1, 8, 512, 128), 64),) if big else (((1, 8, 1, 128), 64), ((1, 2, 3, 64), 32))
    got, want = [], []
    for shape, group in cases:
        k1, k2 = mx.random.split(mx.random.key(group), 2)
        k = mx.random.normal(shape, key=k1) * 3
        v = mx.random.normal(shape, key=k2).at[..., 0, :].multiply(0.0)
        stored = kernels.nested_kv_write(k, v, group, runner)
        for planes, x in zip(stored, (k, v)):
            got.append(nest_dequantize(*planes, group, draft=False).reshape(-1))
            want.append(nest_dequantize(*nest_quantize(x, group), group, draft=False).reshape(-1))
    return mx.concatenate(got), mx.concatenate(want)
