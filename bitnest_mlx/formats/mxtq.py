"""MXTQ weight codec (spec: docs/mxtq.md §1-§8), bit-compatible with jang 2.5.50.

A matrix W [out, in] is stored as `tq_packed` (uint32 codes, LSB-first), `tq_norms` (float16,
one per row) and `tq_bits`. Row r decodes to Rᵀ(n_r · c[code_r]), where R is a randomized block
Hadamard rotation and c a Lloyd-Max codebook. Neither R nor c is stored: both are re-derived here
from (in_features, bits, seed). Encode and decode run in float32 with the writer's operation order,
so codes, norms and decoded values are identical to jang's, not merely close.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

DEFAULT_SEED = 42
SUPPORTED_BITS = (2, 3, 4, 8)

# np.trapz was renamed in NumPy 2.0; both compute the same pairwise-summed trapezoid.
_trapezoid = getattr(np, "trapezoid", None) or np.trapz


def values_per_word(bits: int) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"MXTQ bits must be one of {SUPPORTED_BITS}, got {bits}")
    return 32 // bits


def check_in_features(in_features: int, bits: int) -> None:
    """jang never pads a row (it asserts in % vpw == 0), so neither do we."""
    vpw = values_per_word(bits)
    if in_features % vpw:
        raise ValueError(
            f"MXTQ in_features {in_features} is not a multiple of {vpw} "
            f"(codes per uint32 word at {bits} bits); jang never pads rows"
        )


def hadamard_blocks(d: int) -> list[int]:
    """The binary decomposition of d, largest block first: 384 -> [256, 128]. No padding."""
    return [1 << k for k in reversed(range(d.bit_length())) if d >> k & 1]


# ---------------------------------------------------------------- codebook and signs


def _sphere_coordinate_pdf(x: np.ndarray, d: int) -> np.ndarray:
    """Density of one coordinate of a uniform point on S^(d-1), evaluated in log space.

    The normalizing constant is kept although the caller renormalizes: dropping it changes the
    last bits of the float64 centroids.
    """
    if d <= 2:
        return np.full_like(x, 0.5)
    log_norm = math.lgamma(d / 2.0) - 0.5 * math.log(math.pi) - math.lgamma((d - 1) / 2.0)
    return np.exp(log_norm + (d - 3) / 2.0 * np.log(np.maximum(1.0 - x**2, 1e-30)))


@lru_cache(maxsize=64)
def _lloyd_max(d: int, bits: int) -> tuple[float, ...]:
    """Float64 Lloyd-Max centroids on a 10000-point grid, the writer's exact procedure."""
    n = 1 << bits
    grid = np.linspace(-1.0, 1.0, 10000)
    pdf = _sphere_coordinate_pdf(grid, d)
    total = _trapezoid(pdf, grid)
    if total > 0:
        pdf = pdf / total
    support = 3.0 / np.sqrt(max(d, 1))
    c = np.linspace(-support, support, n)
    for _ in range(200):
        edges = np.concatenate([[-1.0], (c[:-1] + c[1:]) / 2.0, [1.0]])
        new = np.empty(n)
        for i in range(n):
            upper = grid <= edges[i + 1] if i == n - 1 else grid < edges[i + 1]
            sel = (grid >= edges[i]) & upper
            if sel.sum() <= 1:  # empty region: keep the centroid where it is
                new[i] = c[i]
                continue
            g, p = grid[sel], pdf[sel]
            new[i] = _trapezoid(g * p, g) / max(_trapezoid(p, g), 1e-10)
        if np.allclose(c, new, atol=1e-10):
            break  # converged: the writer returns the centroids *before* this update
        c = new
    return tuple(sorted(c.tolist()))


def codebook(in_features: int, bits: int) -> np.ndarray:
    """The 2^bits float32 centroids for rows of length in_features, ascending."""
    values_per_word(bits)
    return np.array(_lloyd_max(in_features, bits), dtype=np.float32)


@lru_cache(maxsize=16)
def _signs(d: int, seed: int) -> bytes:
    return np.random.default_rng(seed).choice([-1.0, 1.0], size=d).astype(np.float32).tobytes()


def signs(in_features: int, seed: int = DEFAULT_SEED) -> np.ndarray:
    """±1 float32 rotation diagonal, one stream per seed: signs(2048) == signs(4096)[:2048]."""
    return np.frombuffer(_signs(in_features, seed), dtype=np.float32).copy()


# ---------------------------------------------------------------- rotation (reference order)


def _fwht(x: mx.array) -> mx.array:
    """Unnormalized natural-order Walsh-Hadamard transform along the last axis.

    Stages run h = 1, 2, 4, … like the writer's butterfly, so every float32 rounding matches it.
    """
    d, lead = x.shape[-1], x.shape[:-1]
    h = 1
    while h < d:
        x = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = x[..., 0, :], x[..., 1, :]
        x = mx.stack([a + b, a - b], axis=-2)
        h *= 2
    return x.reshape(*lead, d)


def _blockwise(x: mx.array, fn) -> mx.array:
    parts, start = [], 0
    for size in hadamard_blocks(x.shape[-1]):
        parts.append(fn(x[..., start : start + size], start, size))
        start += size
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def rotate(x: mx.array, sign: mx.array) -> mx.array:
    """R x = blockdiag(H_k / √d_k) · (sign ⊙ x) along the last axis, float32."""
    x = x.astype(mx.float32)
    return _blockwise(x, lambda blk, s, n: _fwht(blk * sign[s : s + n]) * (1.0 / math.sqrt(n)))


def unrotate(y: mx.array, sign: mx.array) -> mx.array:
    """Rᵀ y = sign ⊙ blockdiag(H_k / √d_k) y along the last axis, float32."""
    y = y.astype(mx.float32)
    return _blockwise(y, lambda blk, s, n: _fwht(blk) * (1.0 / math.sqrt(n)) * sign[s : s + n])


# ---------------------------------------------------------------- packing


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """[..., in] codes -> [..., in / vpw] uint32; code k of a word sits at bits k·bits and up."""
    check_in_features(codes.shape[-1], bits)
    vpw = values_per_word(bits)
    grouped = codes.astype(np.uint32).reshape(*codes.shape[:-1], -1, vpw)
    shifts = np.arange(vpw, dtype=np.uint32) * bits
    return np.bitwise_or.reduce(grouped << shifts, axis=-1)


def unpack_codes(packed, bits: int):
    """[..., words] uint32 -> [..., words · vpw] uint32 codes (NumPy or MLX, as given)."""
    vpw = values_per_word(bits)
    xp = mx if isinstance(packed, mx.array) else np
    shifts = xp.arange(vpw, dtype=xp.uint32) * bits
    codes = (packed[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * vpw)


# ---------------------------------------------------------------- encode / decode


@dataclass
class MXTQWeight:
    """One MXTQ matrix [out, in] or expert stack [E, out, in], as stored in a bundle."""

    packed: np.ndarray  # uint32 [..., out, in / vpw]
    norms: np.ndarray  # float16 [..., out]
    bits: int

    @property
    def in_features(self) -> int:
        return self.packed.shape[-1] * values_per_word(self.bits)

    @property
    def out_features(self) -> int:
        return self.packed.shape[-2]

    def tensors(self, base: str) -> dict[str, np.ndarray]:
        """The bundle tensors `<base>.tq_packed|tq_norms|tq_bits` (tq_bits int32, as converted)."""
        return {
            f"{base}.tq_packed": self.packed,
            f"{base}.tq_norms": self.norms,
            f"{base}.tq_bits": np.array([self.bits], dtype=np.int32),
        }


def encode(weight: np.ndarray, bits: int, seed: int = DEFAULT_SEED) -> MXTQWeight:
    """Quantize W [..., out, in] row by row (for tests and converters).

    The norm is a float32 MLX sum like the writer's; a NumPy sum (pairwise order) can land one
    float16 ulp away. A value exactly on a midpoint takes the lower code.
    """
    d = weight.shape[-1]
    check_in_features(d, bits)
    v = rotate(mx.array(np.asarray(weight, dtype=np.float32)), mx.array(signs(d, seed)))
    n = mx.sqrt(mx.sum(v * v, axis=-1, keepdims=True))
    u = np.array(v / mx.maximum(n, 1e-10))
    c = codebook(d, bits)
    midpoints = (c[:-1] + c[1:]) / np.float32(2)
    # side="left" counts the midpoints strictly below u, i.e. Σ_j [u > β_j].
    codes = np.searchsorted(midpoints, u, side="left")
    norms = np.array(n[..., 0]).astype(np.float16)
    return MXTQWeight(pack_codes(codes, bits), norms, bits)


def decode(w: MXTQWeight, seed: int = DEFAULT_SEED) -> np.ndarray:
    """Dense float32 W [..., out, in]. For tests and tools: the runtime never builds this."""
    d = w.in_features
    c = mx.array(codebook(d, bits=w.bits))
    y = c[unpack_codes(mx.array(w.packed), w.bits)]
    y = y * mx.array(w.norms).astype(mx.float32)[..., None]
    return np.array(unrotate(y, mx.array(signs(d, seed))))
