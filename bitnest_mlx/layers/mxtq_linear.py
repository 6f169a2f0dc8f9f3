"""MXTQ Linear and gathered experts, pure MLX (codec: formats/mxtq.py).

The weights stay in the rotated basis: y_r = n_r · Σ_i (R x)_i · c[code_r,i]. R is orthogonal, so
this equals x · Ŵ_rᵀ without ever de-rotating a weight; the input is rotated once per call instead.
Parameter names follow the bundle keys (`tq_packed`, `tq_norms`, `tq_bits`) so `load_weights`
takes a bundle's tensors as they are. Math is float32; the output takes the input's dtype.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .. import kernels
from ..formats.mxtq import (
    DEFAULT_SEED,
    MXTQWeight,
    check_in_features,
    codebook,
    hadamard_blocks,
    signs,
    unpack_codes,
    values_per_word,
)


def rotate_input(x: mx.array, sign: mx.array) -> mx.array:
    """R x in float32 along the last axis, with MLX's fast transform per power-of-two block."""
    x = x.astype(mx.float32)
    parts, start = [], 0
    for n in hadamard_blocks(x.shape[-1]):
        blk = x[..., start : start + n] * sign[start : start + n]
        parts.append(mx.hadamard_transform(blk, scale=1.0 / math.sqrt(n)))
        start += n
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


class _MXTQBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bits: int, seed: int, lead=()):
        super().__init__()
        check_in_features(in_features, bits)
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        words = in_features // values_per_word(bits)
        self.tq_packed = mx.zeros((*lead, out_features, words), dtype=mx.uint32)
        self.tq_norms = mx.zeros((*lead, out_features), dtype=mx.float16)
        self.tq_bits = mx.array([bits], dtype=mx.int32)
        # Derived, never stored in a bundle: underscore names keep them out of parameters().
        self._codebook = mx.array(codebook(in_features, bits))
        self._signs = mx.array(signs(in_features, seed))
        if 8 % bits == 0:  # whole codes per byte: the byte-table matvec applies
            cpb = 8 // bits
            fields = np.arange(cpb, dtype=np.uint32) * bits
            byte_codes = (np.arange(256, dtype=np.uint32)[:, None] >> fields) & ((1 << bits) - 1)
            self._byte_values = self._codebook[mx.array(byte_codes)]  # [256, cpb]
        self.freeze()

    def rotate(self, x: mx.array) -> mx.array:
        """R x (float32). Modules with the same in_features and seed can share one rotated x."""
        if kernels.hadamard_supported(self.in_features) and kernels.use(
            "hadamard", hadamard_self_test
        ):
            kernels.record("hadamard", "kernel")
            return kernels.hadamard_rotate(x, self._signs)
        return rotate_input(x, self._signs)

    def _rotated_rows(self, packed: mx.array) -> mx.array:
        """[..., out, words] codes -> [..., out, in] float32 centroids (rotated basis)."""
        return self._codebook[unpack_codes(packed, self.bits)]

    def _matvec(self, x_rot: mx.array, packed: mx.array) -> mx.array:
        """x_rot [..., M, in], packed [..., out, words] -> [..., M, out]; batch dims broadcast."""
        if x_rot.shape[-2] == 1 and 8 % self.bits == 0:
            return self._byte_table_matvec(x_rot, packed)
        return x_rot @ self._rotated_rows(packed).swapaxes(-1, -2)

    def _byte_table_matvec(self, x_rot: mx.array, packed: mx.array) -> mx.array:
        """The M = 1 case without expanding codes to floats (4x fewer reads at 2 bits).

        A byte holds 8/bits whole codes, so its share of a dot product, Σ x_i · c[code_i] over
        those codes, is one of 256 values. Tabulate them per byte position from x, then gather
        one table entry per stored byte. (Byte order: MLX hosts are little-endian, so byte j of
        a row holds codes j·cpb ... j·cpb + cpb - 1, matching the LSB-first packing.)
        """
        cpb = 8 // self.bits
        positions = self.in_features // cpb
        chunks = x_rot.reshape(*x_rot.shape[:-1], positions, cpb)
        table = (chunks @ self._byte_values.T).reshape(*x_rot.shape[:-1], -1)
        offsets = mx.arange(positions, dtype=mx.uint32) * 256
        at = packed.view(mx.uint8).astype(mx.uint32) + offsets  # [..., out, positions]
        y = mx.take_along_axis(table, at.reshape(*at.shape[:-2], 1, -1), axis=-1)
        return y.reshape(*y.shape[:-1], self.out_features, positions).sum(-1)


class MXTQLinear(_MXTQBase):
    """y = x · Ŵᵀ for one MXTQ matrix [out, in]; no bias (MXTQ layers have none)."""

    def __init__(self, in_features: int, out_features: int, bits: int, seed: int = DEFAULT_SEED):
        super().__init__(in_features, out_features, bits, seed)

    @classmethod
    def from_weight(cls, w: MXTQWeight, seed: int = DEFAULT_SEED) -> MXTQLinear:
        layer = cls(w.in_features, w.out_features, w.bits, seed)
        layer.tq_packed, layer.tq_norms = mx.array(w.packed), mx.array(w.norms)
        return layer

    def apply_rotated(self, x_rot: mx.array) -> mx.array:
        rows = x_rot.reshape(-1, self.in_features)
        y = self._matvec(rows, self.tq_packed) * self.tq_norms.astype(mx.float32)
        return y.reshape(*x_rot.shape[:-1], self.out_features)

    def __call__(self, x: mx.array) -> mx.array:
        return self.apply_rotated(self.rotate(x)).astype(x.dtype)


class MXTQSwitchLinear(_MXTQBase):
    """Stacked MXTQ experts [E, out, in]; a drop-in for mlx-lm's SwitchLinear in SwitchGLU.

    x [..., 1 or K, M, in] with indices [..., K] gives [..., K, M, out] (mlx-lm's layout; the
    sorted form x [S, M, in], indices [S] works too). Only the routed experts' codes are read.
    Two pure-MLX paths, both equal to the dense decode up to float32 rounding:
    * per slot (decode): gather each slot's codes and multiply (byte tables when M = 1); no host
      sync, so it compiles.
    * grouped (prefill, once expanding every slot would exceed `max_dequant_bytes`): sort slots
      by expert on the host, expand each distinct routed expert once, a few experts at a time,
      and `gather_mm` the slots routed to them.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        num_experts: int,
        bits: int,
        seed: int = DEFAULT_SEED,
        max_dequant_bytes: int = 256 << 20,
    ):
        super().__init__(in_features, out_features, bits, seed, lead=(num_experts,))
        self.num_experts = num_experts
        self.max_dequant_bytes = max_dequant_bytes
        self._store = self._source = None  # set by use_store

    def use_store(self, store, source) -> None:
        """Read routed experts' codes through `store` (layers/expert_store.py: an LRU over the
        bundle's files, `source` says where this stack lives) instead of holding the stack;
        `tq_packed` stops being a parameter. The norms stay resident."""
        self._store, self._source = store, source
        del self.tq_packed

    def _routed(self, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(codes, norms, ids): stacks holding the routed experts and the ids into them.

        Resident: the whole stacks and `indices`. With a store: the distinct routed experts,
        read through it, and `indices` renumbered into them; `codes[ids]` then holds the same
        values as the resident `tq_packed[indices]`, so results are bit-identical."""
        if self._store is None:
            return self.tq_packed, self.tq_norms, indices
        ids = np.array(indices)  # host sync: which experts to read depends on the routing
        experts, local = np.unique(ids, return_inverse=True)
        codes = self._store.fetch(self._source, experts.tolist())
        local = mx.array(local.reshape(ids.shape).astype(np.uint32))
        return codes, self.tq_norms[mx.array(experts.astype(np.uint32))], local

    def _codes_of(self, experts: np.ndarray) -> mx.array:
        """The codes of `experts` (host ids, ascending), stacked."""
        if self._store is None:
            return self.tq_packed[mx.array(experts)]
        return self._store.fetch(self._source, experts.tolist())

    @classmethod
    def from_weight(cls, w: MXTQWeight, seed: int = DEFAULT_SEED, **kwargs) -> MXTQSwitchLinear:
        layer = cls(w.in_features, w.out_features, w.packed.shape[0], w.bits, seed, **kwargs)
        layer.tq_packed, layer.tq_norms = mx.array(w.packed), mx.array(w.norms)
        return layer

    @property
    def _expert_bytes(self) -> int:
        """One expert expanded to float32 centroids."""
        return 4 * self.out_features * self.in_features

    def apply_rotated(
        self, x_rot: mx.array, indices: mx.array, use_kernels: bool = True
    ) -> mx.array:
        """[..., 1|K, M, in] rotated inputs, [..., K] expert ids -> [..., K, M, out] float32.

        `use_kernels=False` forces the pure-MLX path (the kernel's reference)."""
        if (
            use_kernels
            and x_rot.shape[-2] == 1
            and kernels.mxtq_gather_supported(x_rot[..., 0, :], indices, self.bits)
            and kernels.use("mxtq_gather", gather_self_test)
        ):
            kernels.record("mxtq_gather", "kernel")
            codes, norms, ids = self._routed(indices)
            y = kernels.mxtq_gather_matvec(
                x_rot[..., 0, :], ids, codes, norms, self._codebook, self.bits
            )
            return y[..., None, :]
        return self._pure_apply(x_rot, indices)

    def _pure_apply(self, x_rot: mx.array, indices: mx.array) -> mx.array:
        batch = tuple(np.broadcast_shapes(x_rot.shape[:-2], indices.shape))
        if math.prod(batch) * self._expert_bytes <= self.max_dequant_bytes:
            codes, norms, ids = self._routed(indices)
            y = self._matvec(x_rot, codes[ids])
            return y * norms[ids].astype(mx.float32)[..., None, :]
        y = self._grouped(x_rot, mx.broadcast_to(indices, batch), batch)
        return y * self.tq_norms[indices].astype(mx.float32)[..., None, :]

    def _grouped(self, x_rot: mx.array, indices: mx.array, batch: tuple) -> mx.array:
        m = x_rot.shape[-2]
        xs = mx.broadcast_to(x_rot, (*batch, m, self.in_features)).reshape(-1, m, self.in_features)
        ids = np.array(indices).reshape(-1)  # host sync: group sizes are data-dependent
        order = np.argsort(ids, kind="stable")
        experts, starts = np.unique(ids[order], return_index=True)
        ends = np.append(starts[1:], ids.size)
        per_group = max(1, self.max_dequant_bytes // self._expert_bytes)
        parts = []
        for g in range(0, experts.size, per_group):
            group = experts[g : g + per_group]
            slot = order[starts[g] : ends[g + group.size - 1]]
            w = self._rotated_rows(self._codes_of(group))
            local = mx.array(np.searchsorted(group, ids[slot]).astype(np.uint32))
            parts.append(
                mx.gather_mm(
                    xs[mx.array(slot)], w.swapaxes(-1, -2), rhs_indices=local, sorted_indices=True
                )
            )
            # Evaluated group by group: built lazily, every group's float expansion would be
            # alive at once (GBs at real size), not max_dequant_bytes.
            mx.eval(parts[-1])
        y = mx.concatenate(parts)[mx.array(np.argsort(order))]
        return y.reshape(*batch, m, self.out_features)

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        # sorted_indices is accepted for SwitchGLU compatibility; both paths handle any order.
        return self.apply_rotated(self.rotate(x), indices).astype(x.dtype)


def gather_self_test(runner: kernels.Runner | None = None) -> tuple[mx.array, mx.array]:
    """(kernel, pure) routed 2-bit experts at M = 1, shared and repeated expert ids."""
    k1, k2, k3 = mx.random.split(mx.random.key(3), 3)
    sw = MXTQSwitchLinear(128, 10, 3, bits=2)
    sw.tq_packed = mx.random.randint(0, 2**31, (3, 10, 8), key=k1).astype(mx.uint32)
    sw.tq_norms = mx.random.uniform(0.5, 1.5, (3, 10), key=k2).astype(mx.float16)
    x = mx.random.normal((2, 1, 1, 128), key=k3)
    idx = mx.array([[0, 2], [1, 1]], dtype=mx.uint32)
    got = kernels.mxtq_gather_matvec(
        x[:, :, 0, :], idx, sw.tq_packed, sw.tq_norms, sw._codebook, 2, runner
    )
    return got, sw._pure_apply(x, idx)[..., 0, :]


def hadamard_self_test(runner: kernels.Runner | None = None) -> tuple[mx.array, mx.array]:
    """(kernel, pure) signed Hadamard rotation of two rows of 256."""
    k1, k2 = mx.random.split(mx.random.key(4))
    x = mx.random.normal((2, 256), key=k1)
    s = mx.where(mx.random.uniform(shape=(256,), key=k2) < 0.5, -1.0, 1.0)
    return kernels.hadamard_rotate(x, s, runner), rotate_input(x, s)
