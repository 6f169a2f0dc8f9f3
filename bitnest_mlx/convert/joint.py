"""Joint W4/W8 code selection: one GPTQ sweep that picks each weight's nested code pair.

A package stores q8 = 16·q4 + qr: the draft reads q4·s, the target q4·s + qr·s/16. The lo
plane reaches only about ±s/2 around q4·s, so the two precisions are bound together, but not
tightly: where the weight lies between two W4 levels, either q4 serves the target equally well,
and the draft may take the one that suits it. `joint_codes` makes that choice on the
calibration Hessian, minimising per weight

    λ·(e4 / s)² + (e8 / (s/16))²

where e4, e8 are the draft's and the target's errors against their own error-fed targets.
Each error is measured in its own grid's steps, so λ = 1 weighs a draft error of one W4 step
like a target error of one W8 step: both precisions are asked for the same relative accuracy.
The sweep carries both errors forward (`sweep(..., targets=2)`): the draft's copy of the
remaining columns absorbs the draft's rounding, the target's copy the target's, so later lo
codes repair what an earlier hi choice cost the target (cross-bit compensation).

The per-group scale is searched for the same objective (weighted by the Hessian diagonal), not
fixed at the W8 range.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np

from ..formats.bitnest import (
    SEED_GROUP_SIZE,
    Planes,
    dequantize_planes,
    planes_from_codes,
    weight_scales,
)
from .sweep import ColumnQuantizer, Factor, column_scales, row_chunks, sweep

W8_BUDGET = 1.0  # the target's output error may reach W8-RTN's, no more
LAMBDA_START = 8.0  # the first λ tried by the budget search
LAMBDA_RANGE = (LAMBDA_START / 16, LAMBDA_START * 16)
GROWTH = (0.25, 1.5)  # bounds on the fitted exponent of the target error's growth with λ
SAMPLE_ROWS = 256  # rows whose trial sweeps choose λ for a wide weight
SCALE_GRID = (0.85, 0.9, 0.95, 1.0, 7.4375 / 7)  # 7.4375/7: W4's top level at the max
CANDIDATE_STEPS = 3  # hi codes tried between the target's own nibble and the draft's rounding
# Moves from the target's own nibble tried towards the draft's rounding; 15 reaches it.
_STEPS = np.array([*range(1, CANDIDATE_STEPS + 1), 15], dtype=np.float32).reshape(-1, 1)
# The scale search's ~20 elementwise passes run fastest on chunks whose temporaries stay in
# cache: about this many weights per chunk (2.4x faster than 4 k rows at K = 896).
SEARCH_WEIGHTS = 2**16
# Bytes of working memory per weight in the row-chunked error sums (RTN planes, float64
# dequantization, float32 GEMM operands), so each chunk stays near CHUNK_BYTES.
BYTES_PER_WEIGHT = 128
ERROR_BLOCK = 128  # columns per block of the symmetric quadratic form


def _clip(x: np.ndarray, low, high) -> np.ndarray:
    """np.clip without its dispatch overhead (~20 µs a call, paid once per swept column)."""
    return np.minimum(np.maximum(x, low), high)


def _candidates(q4: np.ndarray, a: np.ndarray, b: np.ndarray, lambda_draft: float) -> tuple:
    """(qr, cost) for hi codes q4 [C, ...] against the draft a = d/s and target b = t/(s/16):
    the target's best lo code (>= 0 where q4 = -8, so q8 >= -128) and the joint cost."""
    r = b - 16 * q4
    qr = _clip(np.rint(r), -8, 7)
    np.maximum(qr, 0, out=qr, where=q4 == -8)  # in place: bounds as arrays would widen dtypes
    return qr, lambda_draft * np.square(a - q4) + np.square(r - qr)


def joint_round(
    draft: np.ndarray, target: np.ndarray, s: np.ndarray, lambda_draft: float
) -> tuple[np.ndarray, ...]:
    """Best (q4, qr) per element for draft/target values (same shape) on step s.

    Tries the target's own hi nibble, up to CANDIDATE_STEPS codes from it towards the draft's
    rounding, and that rounding; each with the best lo code for the target; ties keep the
    code nearer the target's own. Returns q4, qr, w4 = q4·s, w8 = w4 + qr·s/16 and the cost."""
    a, b = draft / s, target / (s / 16)  # in W4 and W8 steps
    own = np.floor((_clip(np.rint(b), -128, 119) + 8) / 16)
    gap = _clip(np.rint(a), -8, 7) - own
    q4 = own
    qr, cost = _candidates(own, a, b, lambda_draft)
    # Other codes can win only where the draft's rounding is not the target's nibble: ~3 % of
    # the weights without error feedback, ~12 % in the sweep. All of their candidates at once.
    moved = np.flatnonzero(gap)
    if moved.size:
        flat = [x.reshape(-1) for x in (own, gap, a, b)]  # views: all are fresh arrays
        own_m, gap_m = flat[0][moved], flat[1][moved]
        q4m = np.concatenate([own_m[None], own_m + _clip(gap_m, -_STEPS, _STEPS)])
        qrm, costm = _candidates(q4m, flat[2][moved], flat[3][moved], lambda_draft)
        best = np.argmin(costm, axis=0)  # the first minimum: the nearest code on ties
        pick = (best, np.arange(moved.size))
        for x, xm in ((q4, q4m), (qr, qrm), (cost, costm)):
            x.reshape(-1)[moved] = xm[pick]
    w4 = q4 * s
    return q4, qr, w4, w4 + qr * (s / 16), cost


def search_scales(
    w: np.ndarray,
    h_diag: np.ndarray,
    lambda_draft: float,
    rows: int | None = None,
    *,
    group_size: int = SEED_GROUP_SIZE,
) -> np.ndarray:
    """fp16 scales [N, K/g]: per group of g = `group_size` columns, the multiple of the W8-range
    scale (SCALE_GRID) with the lowest joint cost of rounding (`joint_round` without error
    feedback), each input weighted by its Hessian diagonal. Rows are processed in chunks of
    `rows` (default: about SEARCH_WEIGHTS weights)."""
    base = weight_scales(w, group_size)
    n, k = w.shape
    groups = k // group_size
    weight = np.maximum(h_diag, 0).astype(np.float32).reshape(1, groups, group_size)
    out = base.copy()
    rows = rows or max(1, SEARCH_WEIGHTS // k)
    for chunk in (slice(r, min(r + rows, n)) for r in range(0, n, rows)):
        wg = w[chunk].astype(np.float32).reshape(-1, groups, group_size)
        s0 = base[chunk].astype(np.float32)
        best_cost = np.full(s0.shape, np.inf, dtype=np.float32)
        for alpha in SCALE_GRID:
            s16 = np.maximum(alpha * s0, 2.0**-14).astype(np.float16)
            s = s16.astype(np.float32)
            *_, cost = joint_round(wg, wg, s[..., None], lambda_draft)
            # Costs are in each candidate's own steps: convert to the base grid's units.
            total = np.einsum("rgc,rgc->rg", cost, np.broadcast_to(weight, cost.shape))
            total *= np.square(s / s0)
            better = total < best_cost
            np.copyto(best_cost, total, where=better)
            np.copyto(out[chunk], s16, where=better)
    return out


def _joint_quantizer(
    scales: np.ndarray, k: int, lambda_draft: float
) -> Callable[[slice], ColumnQuantizer]:
    group = k // scales.shape[1]

    def for_rows(rows: slice) -> ColumnQuantizer:
        s = column_scales(scales, rows)

        def pair(values: np.ndarray, col: int) -> tuple[np.ndarray, np.ndarray]:
            q4, qr, w4, w8, _ = joint_round(values[0], values[1], s[col // group], lambda_draft)
            codes = np.empty((2, *q4.shape), q4.dtype)
            dequantized = np.empty_like(codes)
            codes[0], codes[1], dequantized[0], dequantized[1] = q4, qr, w4, w8
            return codes, dequantized

        return pair

    return for_rows


def joint_codes(
    w: np.ndarray,
    h: np.ndarray | Factor,
    lambda_draft: float,
    damp: float = 0.01,
    *,
    group_size: int = SEED_GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hi codes q4 [N, K], lo codes qr [N, K] and fp16 scales [N, K/g] for weight w [N, K]
    minimising λ·err_W4² + err_W8² (each in its own grid's steps) on the Hessian h [K, K]."""
    f = h if isinstance(h, Factor) else Factor(h, damp)
    return _joint_codes(w, f, lambda_draft, damp, group_size)


def _joint_codes(
    w: np.ndarray,
    f: Factor,
    lambda_draft: float,
    damp: float,
    group_size: int,
    errors: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`joint_codes`; `errors` ([2]) receives the draft's and the target's output errors."""
    scales = search_scales(w, np.diag(f.h), lambda_draft, group_size=group_size)
    quantizer = _joint_quantizer(scales, w.shape[1], lambda_draft)
    q4, qr = sweep(w, f, damp, quantizer, targets=2, errors=errors)
    return q4, qr, scales


def _quadratic_rows(e: np.ndarray, h: np.ndarray) -> np.ndarray:
    """diag(E H Eᵀ) as float64 [R] for e [R, K] and a symmetric h [K, K] (float32): each
    off-diagonal block of h is used once and counted twice, about half the flops of E @ H."""
    out = np.zeros(len(e))
    k = e.shape[1]
    for i1 in range(0, k, ERROR_BLOCK):
        i2 = min(i1 + ERROR_BLOCK, k)
        m = e[:, i1:i2] @ h[i1:i2, i1:]
        out += np.einsum("ij,ij->i", m[:, : i2 - i1], e[:, i1:i2])
        out += 2 * np.einsum("ij,ij->i", m[:, i2 - i1 :], e[:, i2:])
    return out


def _row_errors(w: np.ndarray, h: np.ndarray, planes_of: Callable[[slice], Planes]) -> np.ndarray:
    """Each row's draft and target output errors [2, N] (float64), over chunks of rows with the
    planes of each chunk from `planes_of`."""
    h32 = h.astype(np.float32)
    n, k = w.shape
    out = np.empty((2, n))
    for rows in row_chunks(n, BYTES_PER_WEIGHT * k):
        p = planes_of(rows)
        e = np.concatenate(
            [w[rows] - dequantize_planes(p.hi, p.lo, p.scales, draft) for draft in (True, False)]
        ).astype(np.float32)
        out[:, rows] = _quadratic_rows(e, h32).reshape(2, -1)
    return out


def _errors_by_rows(
    w: np.ndarray, h: np.ndarray, planes_of: Callable[[slice], Planes]
) -> dict[int, float]:
    """`output_errors` over chunks of rows, with the planes of each chunk from `planes_of`."""
    sums = _row_errors(w, h, planes_of).sum(1)
    return {4: float(sums[0]), 8: float(sums[1])}


def output_errors(w: np.ndarray, planes: Planes, h: np.ndarray) -> dict[int, float]:
    """The draft's (4) and the target's (8) output errors tr(E H Eᵀ)."""
    p = planes
    return _errors_by_rows(
        w, h, lambda rows: replace(p, hi=p.hi[rows], lo=p.lo[rows], scales=p.scales[rows])
    )


def rtn_errors(w: np.ndarray, h: np.ndarray, group_size: int = SEED_GROUP_SIZE) -> dict[int, float]:
    """`output_errors` of RTN's planes, built a chunk of rows at a time."""
    return _errors_by_rows(w, h, lambda rows: planes_from_codes(w[rows], group_size=group_size))


def _vs_rtn(errors: dict[int, float], rtn: dict[int, float]) -> dict[str, float]:
    return {f"w{b}_hessian_err_vs_rtn": errors[b] / max(rtn[b], 1e-30) for b in (4, 8)}


def output_errors_vs_rtn(
    w: np.ndarray, planes: Planes, h: np.ndarray, rtn: dict[int, float] | None = None
) -> dict[str, float]:
    """`output_errors` relative to RTN's (< 1: the calibrated codes beat rounding to nearest on
    these inputs); `rtn` passes RTN's errors in when they are already known."""
    if rtn is None:
        rtn = rtn_errors(w, h, w.shape[1] // planes.scales.shape[-1])
    return _vs_rtn(output_errors(w, planes, h), rtn)


def budgeted_joint_planes(
    w: np.ndarray,
    h: np.ndarray | Factor,
    w8_budget: float = W8_BUDGET,
    damp: float = 0.01,
    *,
    group_size: int = SEED_GROUP_SIZE,
) -> tuple[Planes, float, dict[str, float]]:
    """Joint planes for the λ whose target output error just fits `w8_budget` x W8-RTN's on
    this Hessian: the target keeps the accuracy of 8-bit rounding to nearest, and the draft gets
    everything the format leaves. Returns the planes, their λ and `output_errors_vs_rtn`.

    λ is found on a sample of rows (`SAMPLE_ROWS`, every n/SAMPLE_ROWS-th: rows are swept
    independently and the budget is a ratio of sums over rows), then the whole weight is
    swept once at it: two trial sweeps, λ = LAMBDA_START and the λ that would land at 95 % of
    the budget if the target's error grew in proportion to λ, fix the exponent of its growth
    (λ^0.5 … λ^0.95 on the test problems and real layers), which predicts the λ landing at
    95 %. If the whole weight misses the budget there, one more sweep at the λ the exponent
    predicts from it. Weights of fewer than 2·SAMPLE_ROWS rows run the two trials on every
    row and keep the better (`_best`)."""
    f = h if isinstance(h, Factor) else Factor(h, damp)
    n = len(w)
    rtn = _row_errors(w, f.h, lambda rows: planes_from_codes(w[rows], group_size=group_size))

    def attempt(lam: float, rows: slice) -> tuple[tuple, float, dict[str, float]]:
        errors = np.zeros(2)  # from the sweep itself: no [N, K] x [K, K] product
        q4, qr, scales = _joint_codes(w[rows], f, lam, damp, group_size, errors)
        r = rtn[:, rows].sum(1)
        return (q4, scales, qr), lam, _vs_rtn({4: errors[0], 8: errors[1]}, {4: r[0], 8: r[1]})

    def w8(t: tuple) -> float:
        return max(t[2]["w8_hessian_err_vs_rtn"], 1e-12)

    step = n // SAMPLE_ROWS
    rows = slice(0, n, step) if step >= 2 else slice(0, n)
    first = attempt(LAMBDA_START, rows)
    lam = LAMBDA_START * float(np.clip(0.95 * w8_budget / w8(first), 1 / 16, 16))
    second = attempt(lam, rows)
    if step < 2:
        codes, lam, errors = _best((first, second), w8_budget)
        return planes_from_codes(w, *codes), lam, errors
    growth = 1.0
    if lam != LAMBDA_START and w8(second) != w8(first):
        growth = float(
            np.clip(np.log(w8(second) / w8(first)) / np.log(lam / LAMBDA_START), *GROWTH)
        )

    def aim(t: tuple) -> float:
        return float(np.clip(t[1] * (0.95 * w8_budget / w8(t)) ** (1 / growth), *LAMBDA_RANGE))

    tries = [attempt(aim(second), slice(0, n))]
    if w8(tries[0]) > w8_budget:
        tries.append(attempt(aim(tries[0]), slice(0, n)))
    codes, lam, errors = _best(tries, w8_budget)
    return planes_from_codes(w, *codes), lam, errors


def _best(tries, w8_budget: float) -> tuple:
    """Of (codes, λ, errors vs RTN) tries, the lowest draft error within the budget; if none
    fits, the lowest target error."""
    fits = [t for t in tries if t[2]["w8_hessian_err_vs_rtn"] <= w8_budget]
    if fits:
        return min(fits, key=lambda t: t[2]["w4_hessian_err_vs_rtn"])
    return min(tries, key=lambda t: t[2]["w8_hessian_err_vs_rtn"])
