"""MXTQ Linear and gathered experts, pure MLX (codec: formats/mxtq.py).

The weights stay in the rotated basis: y_r = n_r · Σ_i (R x)_i · c[code_r,i]. R is orthogonal, so
this equals x · Ŵ_rᵀ without ever de-rotating a weight; the input is rotated once per call instead.
Parameter names follow the bundle keys (`tq_packed`, `tq_norms`, `tq_bits`) so `load_weights`
takes a bundle's tensors as they are. Math is float32; the output takes the input's dtype.
"""

from __future__ import annotations

import math
from functools import cache, partial

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
from .dsv4_ops import swiglu_clamped


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
        self._seed = seed
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

    @property
    def codebook(self) -> mx.array:
        """The Lloyd-Max centroids this layer's codes index (float32)."""
        return self._codebook

    def rotate(self, x: mx.array, use_kernels: bool = True) -> mx.array:
        """R x (float32). Modules with the same in_features and seed can share one rotated x.
        `use_kernels` is the caller's RunOptions.use_kernels: the layer keeps no switch."""
        if (
            use_kernels
            and kernels.hadamard_supported(self.in_features)
            and kernels.use("hadamard", hadamard_self_test)
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
        at = _table_index(packed.view(mx.uint8), _byte_offsets(positions))  # [..., out, positions]
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

    def _routed(self, indices: mx.array) -> Routed:
        return route([self], indices)[0]

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
        self,
        x_rot: mx.array,
        indices: mx.array,
        use_kernels: bool = True,
        routed: Routed | None = None,
    ) -> mx.array:
        """[..., 1|K, M, in] rotated inputs, [..., K] expert ids -> [..., K, M, out] float32.

        `routed`: this stack's `route` result when the caller already has it (the projections
        of one MoE layer share one). `use_kernels=False` forces the pure-MLX path (the
        kernel's reference)."""
        if (
            use_kernels
            and x_rot.shape[-2] == 1
            and kernels.mxtq_gather_supported(x_rot[..., 0, :], indices, self.bits)
            and kernels.use("mxtq_gather", gather_self_test)
        ):
            kernels.record("mxtq_gather", "kernel")
            codes, norms, ids = routed or self._routed(indices)
            y = kernels.mxtq_gather_matvec(
                x_rot[..., 0, :], ids, codes, norms, self._codebook, self.bits
            )
            return y[..., None, :]
        return self._pure_apply(x_rot, indices, routed)

    def _pure_apply(
        self, x_rot: mx.array, indices: mx.array, routed: Routed | None = None
    ) -> mx.array:
        batch = tuple(np.broadcast_shapes(x_rot.shape[:-2], indices.shape))
        if math.prod(batch) * self._expert_bytes <= self.max_dequant_bytes:
            codes, norms, ids = routed or self._routed(indices)
            return _times_norms(self._matvec(x_rot, codes[ids]), norms[ids])
        y = self._grouped(x_rot, mx.broadcast_to(indices, batch), batch)
        return _times_norms(y, self.tq_norms[indices])

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

    def __call__(
        self,
        x: mx.array,
        indices: mx.array,
        sorted_indices: bool = False,
        *,
        use_kernels: bool = True,
    ) -> mx.array:
        # sorted_indices is accepted for SwitchGLU compatibility; both paths handle any order.
        y = self.apply_rotated(self.rotate(x, use_kernels), indices, use_kernels)
        return y.astype(x.dtype)


Routed = tuple[mx.array, mx.array, mx.array]  # (codes, norms, ids into them) of one stack


@cache
def _byte_offsets(positions: int) -> mx.array:
    """256 · j for byte position j: where position j's table starts (a constant, evaluated once:
    made per call it would be a kernel a call)."""
    offsets = mx.arange(positions, dtype=mx.uint32) * 256
    mx.eval(offsets)
    return offsets


@partial(mx.compile, shapeless=True)
def _table_index(code_bytes: mx.array, offsets: mx.array) -> mx.array:
    return code_bytes.astype(mx.uint32) + offsets


@partial(mx.compile, shapeless=True)
def _times_norms(y: mx.array, norms: mx.array) -> mx.array:
    """y [..., M, out] times its rows' norms [..., out] (stored float16), one kernel."""
    return y * norms[..., None, :].astype(mx.float32)


def route(layers: list[MXTQSwitchLinear], indices: mx.array) -> list[Routed]:
    """Per layer (codes, norms, ids): stacks holding the routed experts and the ids into them.

    Resident stacks: the whole stacks and `indices` (no host sync, so it compiles). With an
    expert store: the distinct routed experts, read through it, and `indices` renumbered into
    them; `codes[ids]` holds the same values as the resident `tq_packed[indices]`, so results
    are bit-identical. The layers share their routing (gate, up and down of one MoE layer), so
    they share the one host sync and the one renumbering."""
    if all(layer._store is None for layer in layers):
        return [(layer.tq_packed, layer.tq_norms, indices) for layer in layers]
    ids = np.array(indices)  # host sync: which experts to read depends on the routing
    experts, local = np.unique(ids, return_inverse=True)
    local = mx.array(local.reshape(ids.shape).astype(np.uint32))
    pick = mx.array(experts.astype(np.uint32))
    return [(layer._codes_of(experts), layer.tq_norms[pick], local) for layer in layers]


def routed_glu(
    gate: MXTQSwitchLinear,
    up: MXTQSwitchLinear,
    down: MXTQSwitchLinear,
    x: mx.array,
    indices: mx.array,
    weights: mx.array,
    limit: float,
    use_kernels: bool = True,
) -> mx.array:
    """down(weights · swiglu_clamped(gate(x), up(x), limit)) per routed slot, the route weight
    applied before down as in DeepSeek-V4: x [..., 1, M, in] float32 shared by a token's slots,
    indices and weights [..., K] -> [..., K, M, out] float32.

    x is rotated once for gate and up (when they share in_features and seed, as DeepSeek-V4's
    do), the activation once for down; with an expert store the three stacks' reads share one
    host sync. At M = 1 on Metal, gate, up, clamp, SiLU, product and route weight are one
    dispatch (`mxtq_gather_swiglu`)."""
    stacks = route([gate, up, down], indices)
    xr = gate.rotate(x, use_kernels)
    if (
        use_kernels
        and x.shape[-2] == 1
        and x.shape[-3] == 1
        and fusable(gate, up)
        and kernels.mxtq_gather_supported(xr[..., 0, :], indices, gate.bits)
        and kernels.use("mxtq_swiglu", swiglu_self_test)
    ):
        kernels.record("mxtq_swiglu", "kernel")
        (gc, gn, ids), (uc, un, _) = stacks[:2]
        h = kernels.mxtq_gather_swiglu(
            xr[..., 0, :], ids, (gc, gn), (uc, un), gate._codebook, gate.bits, limit, weights
        )[..., None, :]
    else:
        kernels.record("mxtq_swiglu", "pure")
        xu = xr if same_rotation(gate, up) else up.rotate(x, use_kernels)
        g = gate.apply_rotated(xr, indices, use_kernels, stacks[0])
        u = up.apply_rotated(xu, indices, use_kernels, stacks[1])
        h = swiglu_clamped(g, u, limit, weights[..., None, None])
    return down.apply_rotated(down.rotate(h, use_kernels), indices, use_kernels, stacks[2])


def same_rotation(a: _MXTQBase, b: _MXTQBase) -> bool:
    """R depends on in_features and the seed only: such layers can share one rotated x."""
    return (a.in_features, a._seed) == (b.in_features, b._seed)


def fusable(gate: MXTQSwitchLinear, up: MXTQSwitchLinear) -> bool:
    """Gate and up can share one rotated x, one codebook and one launch."""
    same = ("out_features", "bits")
    return same_rotation(gate, up) and all(getattr(gate, a) == getattr(up, a) for a in same)


def random_switch(n_in: int, n_out: int, experts: int, bits: int, key) -> MXTQSwitchLinear:
    k1, k2 = mx.random.split(key)
    sw = MXTQSwitchLinear(n_in, n_out, experts, bits=bits)
    sw.tq_packed = mx.random.randint(0, 2**31, sw.tq_packed.shape, key=k1).astype(mx.uint32)
    sw.tq_norms = mx.random.uniform(0.5, 1.5, sw.tq_norms.shape, key=k2).astype(mx.float16)
    return sw


# The self-tests below are the one definition of each MXTQ kernel's check: `kernels.use` runs
# them at first use (small shapes), and bitnest-doctor runs the same code (cli/doctor_kernels.py)
# with `big=True` to time the kernel at a decode-sized shape. Each width draws its own key.
_WIDTHS = (2, 4)  # DeepSeek-V4's routed widths
_SLOTS = ((0, 2, 2), (1, 3, 0))  # 2 tokens x 3 slots over 4 experts: all routed, one repeated


def _expert_shape(big: bool) -> tuple[int, int]:
    """(in_features, rows): 1024 makes a lane walk 2 (2 bits) or 4 (4 bits) words of a row, and
    40 rows are two simdgroups of 16 and a ragged 8; big is a Flash expert's gate (4096 -> 2048)."""
    return (4096, 2048) if big else (1024, 40)


def gather_self_test(
    runner: kernels.Runner | None = None, widths: tuple[int, ...] = _WIDTHS, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) routed experts at M = 1 as a decode step calls them: shared x (gate/up)
    and one x per slot (down), repeated expert ids, at each of `widths`."""
    got, want = [], []
    idx = mx.array(_SLOTS, dtype=mx.uint32)
    n_in, n_out = _expert_shape(big)
    for bits in widths:
        k1, k2 = mx.random.split(mx.random.key(1 + bits))
        sw = random_switch(n_in, n_out, 4, bits, k1)
        for rows in (1, 3):
            x = mx.random.normal((2, rows, 1, n_in), key=k2)
            got.append(
                kernels.mxtq_gather_matvec(
                    x[:, :, 0, :], idx, sw.tq_packed, sw.tq_norms, sw._codebook, bits, runner
                )
            )
            want.append(sw._pure_apply(x, idx)[..., 0, :])
    return mx.concatenate(got, axis=-1), mx.concatenate(want, axis=-1)


def swiglu_self_test(
    runner: kernels.Runner | None = None, widths: tuple[int, ...] = _WIDTHS, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) fused gate + up + clamped SwiGLU + route weight at each of `widths`,
    3 slots per token, a limit that clips some gate and up values."""
    got, want = [], []
    idx = mx.array(_SLOTS, dtype=mx.uint32)
    n_in, n_out = _expert_shape(big)
    for bits in widths:
        k1, k2, k3, k4 = mx.random.split(mx.random.key(5 + bits // 2), 4)
        gate, up = (random_switch(n_in, n_out, 4, bits, k) for k in (k1, k2))
        x = mx.random.normal((2, 1, 1, n_in), key=k3) * 8
        w = mx.random.uniform(0.1, 1.0, idx.shape, key=k4)
        limit = 0.5
        got.append(
            kernels.mxtq_gather_swiglu(
                x[:, :, 0, :],
                idx,
                (gate.tq_packed, gate.tq_norms),
                (up.tq_packed, up.tq_norms),
                gate._codebook,
                bits,
                limit,
                w,
                runner,
            )
        )
        g, u = gate._pure_apply(x, idx), up._pure_apply(x, idx)
        want.append((swiglu_clamped(g, u, limit) * w[..., None, None])[..., 0, :])
    return mx.concatenate(got, axis=-1), mx.concatenate(want, axis=-1)


def hadamard_self_test(
    runner: kernels.Runner | None = None, big: bool = False
) -> tuple[mx.array, mx.array]:
    """(kernel, pure) signed Hadamard rotations at DeepSeek-V4's expert widths: rows of 4096
    (gate/up input) and of 2048 (down input); 2 and 3 rows, or 512 each when big."""
    got, want = [], []
    for rows, d, seed in ((2, 4096, 4), (3, 2048, 8)):
        k1, k2 = mx.random.split(mx.random.key(seed))
        x = mx.random.normal((512 if big else rows, d), key=k1)
        s = mx.where(mx.random.uniform(shape=(d,), key=k2) < 0.5, -1.0, 1.0)
        got.append(kernels.hadamard_rotate(x, s, runner).reshape(-1))
        want.append(rotate_input(x, s).reshape(-1))
    return mx.concatenate(got), mx.concatenate(want)
