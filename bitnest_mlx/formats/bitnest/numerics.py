"""The package's numeric rules, each written once: plane packing, scales, W8 = W4 + lo/16, A8.

Numpy for the writer and validators, MLX where the runtime needs the same rule (`nested`, `a8`).
Spec: docs/bitnest-package.md (integer maps, activation quantization).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np

# Columns per weight scale of the seed packages: a manifest without `group_size` means this, and
# the format-level helpers default to it. The converter's own default is a separate choice
# (convert/defaults.py DEFAULT_GROUP_SIZE).
SEED_GROUP_SIZE = 128
# Weight scale groups a package may use: MLX's 4-bit (de)quantization supports exactly these.
WEIGHT_GROUPS = (32, 64, 128)
KV_GROUPS = (32, 64, 128)  # KV scale groups MLX's 4-bit (de)quantization supports
LO_STEP = 1 / 16  # the lo plane's step, in units of the hi plane's
W8_MAX = 119 / 16  # the W8 grid spans [-8 s, 7.4375 s]: q8 = 16 q4 + qr in [-128, 119]


def nested(hi, lo):
    """The 8-bit value from its two 4-bit planes' values (weights or KV; numpy or MLX):
    hi + lo/16, i.e. (16 q4 + qr)·s/16 for planes q4·s and qr·s. MLX: one compiled kernel, the
    same values (lo/16 is exact, so a fused multiply-add rounds once, as the add does)."""
    return _mx_nested(hi, lo) if isinstance(hi, mx.array) else hi + lo * LO_STEP


@partial(mx.compile, shapeless=True)
def _mx_nested(hi: mx.array, lo: mx.array) -> mx.array:
    return hi + lo * LO_STEP


def _xp(x):
    return np if isinstance(x, np.ndarray) else mx


def _grouped(x, group: int):
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group) if group > 0 else x


def _a8_groups(x, group: int):
    """(x as float, grouped when group > 0; its A8 scale amax/127 per row or group, 1 where
    amax == 0, with the reduced axis kept). MLX arrays in float32, numpy in their own dtype."""
    if _xp(x) is mx:
        xg = _grouped(x, group)
        return xg.astype(mx.float32), _mx_scale(_mx_amax(xg))
    xf = _grouped(x, group)
    amax = np.abs(xf).max(axis=-1, keepdims=True)
    return xf, np.where(amax == 0, 1.0, amax / 127.0)


# MLX: the same rule as a reduction (|x|, its max: two kernels) and one compiled elementwise kernel
# after it (a GPU launches each op of a graph as a kernel). |x| and its max are exact in x's
# dtype, and every other step runs in float32 in the order the numpy rule does, so the results
# are the same bits. The compiles are per shape: a shapeless one splits at the broadcast of the
# per-row scale, three kernels more a call.
def _mx_amax(xg: mx.array) -> mx.array:
    return mx.abs(xg).max(axis=-1, keepdims=True)


def _scale_of(amax: mx.array) -> mx.array:
    amax = amax.astype(mx.float32)
    return mx.where(amax == 0, 1.0, amax / 127.0)


_mx_scale = mx.compile(_scale_of)


def _codes_of(xg: mx.array, amax: mx.array) -> tuple[mx.array, mx.array]:
    scale = _scale_of(amax)
    return mx.clip(mx.round(xg.astype(mx.float32) / scale), -128, 127), scale


_mx_codes = mx.compile(_codes_of)


@mx.compile
def _mx_fake_quant(xg: mx.array, amax: mx.array) -> mx.array:
    q, scale = _codes_of(xg, amax)
    return (q * scale).astype(xg.dtype)


def a8_scale(x, group: int = -1):
    """The A8 scale of x per token ([..., 1]) or per `group` columns ([..., K/group]): what a
    fused kernel needs to quantize x while loading it."""
    scale = _a8_groups(x, group)[1]
    return scale[..., 0] if group > 0 else scale


def _a8_q(x, group: int):
    """(q grouped, scale grouped): q = clip(round_half_even(x/scale), -128, 127), as floats."""
    if _xp(x) is mx:
        xg = _grouped(x, group)
        return _mx_codes(xg, _mx_amax(xg))
    xf, scale = _a8_groups(x, group)
    return np.clip(np.round(xf / scale), -128, 127), scale


def a8_codes(x, group: int = -1):
    """(q, scale): the A8 codes of x (float32 integers in [-128, 127], x's shape) and their
    scale as `a8_scale` gives it; a8(x) = q·scale. What a kernel with integer-exact dots needs."""
    q, scale = _a8_q(x, group)
    return q.reshape(x.shape), scale[..., 0] if group > 0 else scale


def a8(x, group: int = -1):
    """Symmetric int8 fake-quantization per token (group=-1) or per `group` columns:
    q = clip(round_half_even(x/scale), -128, 127), returns q·scale in x's dtype (MLX) or float.

    Division (not multiplication by 127/amax) reproduces the reference rounding at ties. The
    input rule is one for every path: x in its own dtype, widened to float32 (MLX).
    """
    if _xp(x) is mx:
        xg = _grouped(x, group)
        return _mx_fake_quant(xg, _mx_amax(xg)).reshape(x.shape)
    q, scale = _a8_q(x, group)
    return (q * scale).reshape(x.shape)


def pack_nibbles(u: np.ndarray) -> np.ndarray:
    """uint8 codes in [0, 15], [N, K] -> [N, K/2]; byte j = column 2j (low) | column 2j+1 (high)."""
    u = u.astype(np.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """Inverse of pack_nibbles: uint8 [N, K/2] -> uint8 codes [N, K]."""
    out = np.empty((*b.shape[:-1], b.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = b & 0xF, b >> 4
    return out


@dataclass
class Planes:
    hi: np.ndarray  # uint8 [N, K/2]
    lo: np.ndarray  # uint8 [N, K/2]
    scales: np.ndarray  # float16 [N, K/group_size]
    saturation: float  # fraction of residuals clipped at +-8
    w8_max_rel_err: float  # max|W8 - W| / max|W|
    w4_rel_fro_err: float  # ||W4 - W||_F / ||W||_F


def choose_group_size(
    ks: Iterable[int], requested: int | None = None, largest: int = SEED_GROUP_SIZE
) -> int:
    """The weight group for Linears with input widths `ks`: `requested` when given (it must be
    one of WEIGHT_GROUPS and divide every K), else the largest of WEIGHT_GROUPS up to `largest`
    dividing all K (by default 128, the seed packages' group, whenever it can be)."""
    ks = [int(k) for k in ks]
    if requested is not None:
        if requested not in WEIGHT_GROUPS:
            raise ValueError(f"group_size {requested!r}: expected one of {WEIGHT_GROUPS}")
        if bad := [k for k in ks if k % requested]:
            raise ValueError(f"group_size {requested}: K = {bad[0]} is not a multiple of it")
        return requested
    for group in sorted(WEIGHT_GROUPS, reverse=True):
        if group <= largest and all(k % group == 0 for k in ks):
            return group
    bad = next(k for k in ks if k % min(WEIGHT_GROUPS))
    raise ValueError(f"K = {bad} is not a multiple of any weight group size {WEIGHT_GROUPS}")


def _check_group(k: int, group_size: int, shape: list[int]) -> None:
    """A weight of `shape` can be quantized in groups of `group_size` columns."""
    if group_size not in WEIGHT_GROUPS or k % group_size:
        raise ValueError(
            f"weight shape {shape}: group_size {group_size} must be one of {WEIGHT_GROUPS} "
            "and divide K"
        )


def quantize_planes(w: np.ndarray, group_size: int = SEED_GROUP_SIZE) -> Planes:
    """RTN planes: the W8 code q8 = round(w/(s/16)) split into hi and lo nibbles (see
    `planes_from_codes`), s from `weight_scales`."""
    return planes_from_codes(w, group_size=group_size)


def weight_scales(w: np.ndarray, group_size: int = SEED_GROUP_SIZE) -> np.ndarray:
    """fp16 scales [N, K/group_size]: the smallest s whose W8 grid still holds every value of the
    group (max/7.4375 and -min/8), so W8 never clips and W4 gets a ~6 % finer step than amax/7."""
    n, k = w.shape
    _check_group(k, group_size, [n, k])
    out = np.empty((n, k // group_size), np.float16)
    step = _rows_per_block(k)
    for r in range(0, n, step):
        wg = w[r : r + step].astype(np.float32).reshape(-1, k // group_size, group_size)
        s = np.maximum(wg.max(-1) / W8_MAX, -wg.min(-1) / 8)
        s16 = np.maximum(s, 2.0**-14).astype(np.float16)
        s16[s == 0] = 1
        out[r : r + step] = s16
    return out


def planes_from_codes(
    w: np.ndarray,
    codes: np.ndarray | None = None,
    scales: np.ndarray | None = None,
    residual: np.ndarray | None = None,
    group_size: int | None = None,
) -> Planes:
    """Planes for weight `w` [N, K] from given hi codes q4 [N, K] and fp16 scales [N, K/g].

    The group g is `group_size`; None means the one the given scales imply (K / their last
    dim), or SEED_GROUP_SIZE without scales. Missing scales come from `weight_scales`. Missing codes
    are RTN of the W8 code: q8 = clip(round(w/(s/16)), -128, 119) and q4 = floor((q8 + 8)/16),
    its hi nibble, which is round(w/s) except within s/32 of a midpoint; so the residual below
    never clips. A missing `residual` (lo codes qr [N, K]) is the RTN residual of the original
    weight: qr = clip(round((w - q4 s)/(s/16)), -8, 7), kept >= 0 where q4 = -8 (q8 >= -128).
    """
    n, k = w.shape
    if group_size is None:
        group_size = SEED_GROUP_SIZE if scales is None else k // max(np.shape(scales)[-1], 1)
    _check_group(k, group_size, [n, k])
    s16 = weight_scales(w, group_size) if scales is None else np.asarray(scales, np.float16)
    if s16.size != n * (k // group_size):
        raise ValueError(
            f"scales of shape {list(s16.shape)}: expected [{n}, {k // group_size}] for weight "
            f"[{n}, {k}] at group_size {group_size}"
        )
    s16 = s16.reshape(n, k // group_size)
    codes = None if codes is None else np.asarray(codes).reshape(n, k)
    residual = None if residual is None else np.asarray(residual).reshape(n, k)
    hi, lo = np.empty((n, k // 2), np.uint8), np.empty((n, k // 2), np.uint8)
    saturated, err8, err4, norm2, wmax = 0, 0.0, 0.0, 0.0, 1e-30
    step = _rows_per_block(k)  # a vocabulary-sized lm_head would need GBs of temporaries at once
    for r in range(0, n, step):
        rows = slice(r, r + step)
        part = _plane_rows(
            w[rows],
            s16[rows],
            None if codes is None else codes[rows],
            None if residual is None else residual[rows],
            group_size,
        )
        hi[rows], lo[rows] = part[0], part[1]
        saturated += part[2]
        err8, err4, norm2, wmax = (
            max(err8, part[3]),
            err4 + part[4],
            norm2 + part[5],
            max(wmax, part[6]),
        )
    return Planes(
        hi=hi,
        lo=lo,
        scales=s16,
        saturation=saturated / max(n * k, 1),
        w8_max_rel_err=err8 / wmax,
        w4_rel_fro_err=float(np.sqrt(err4) / max(np.sqrt(norm2), 1e-30)),
    )


def _rows_per_block(k: int) -> int:
    return max(1, 2**22 // k)


def _plane_rows(w, s16, codes, residual, group_size: int) -> tuple:
    """`planes_from_codes` on a block of rows: (hi, lo, saturated count, max |W8 - W|,
    ||W4 - W||², ||W||², max |W|)."""
    n, k = w.shape
    wg = w.astype(np.float32).reshape(n, k // group_size, group_size)
    # Codes are computed from the fp16 scale actually stored, so dequantization is consistent.
    s = s16.astype(np.float32)[..., None]
    if codes is None:
        q8 = np.clip(np.round(wg / (s / 16)), -128, 119)
        q4 = np.floor((q8 + 8) / 16)
    else:
        q4 = np.asarray(codes, dtype=np.float32).reshape(wg.shape)
        if q4.min() < -8 or q4.max() > 7:
            raise ValueError(f"hi codes must lie in [-8, 7], got [{q4.min()}, {q4.max()}]")
    raw = np.round((wg - q4 * s) / (s / 16))
    if residual is None:
        qr = np.where(q4 == -8, np.clip(raw, 0, 7), np.clip(raw, -8, 7))
    else:
        qr = np.asarray(residual, dtype=np.float32).reshape(wg.shape)
        if qr.min() < -8 or qr.max() > 7 or np.any(qr[q4 == -8] < 0):
            raise ValueError("lo codes must lie in [-8, 7], and in [0, 7] where q4 = -8")
    w4 = q4 * s
    w8 = nested(w4, qr * s)
    return (
        pack_nibbles((q4 + 8).reshape(n, k)),
        pack_nibbles((qr + 8).reshape(n, k)),
        int(np.count_nonzero(raw != qr)),
        float(np.abs(w8 - wg).max()),
        float(np.sum((w4 - wg).astype(np.float64) ** 2)),
        float(np.sum(wg.astype(np.float64) ** 2)),
        float(np.abs(wg).max()),
    )


def dequantize_planes(
    hi: np.ndarray, lo: np.ndarray, scales: np.ndarray, draft: bool
) -> np.ndarray:
    """W4 = q4 s (draft) or W8 = (16 q4 + qr) s / 16 (target), float64 [N, K]; the group is
    K / (scales' last dim), so this reads every group size."""
    q4 = unpack_nibbles(np.asarray(hi)).astype(np.float64) - 8
    scales = np.asarray(scales, dtype=np.float64)
    s = np.repeat(scales, q4.shape[-1] // scales.shape[-1], axis=-1)
    if draft:
        return q4 * s
    qr = unpack_nibbles(np.asarray(lo)).astype(np.float64) - 8
    return nested(q4 * s, qr * s)
