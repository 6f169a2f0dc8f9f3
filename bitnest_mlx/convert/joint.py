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

import numpy as np

from ..formats.bitnest import (
    GROUP_SIZE,
    Planes,
    dequantize_planes,
    planes_from_codes,
    weight_scales,
)
from .sweep import Factor, sweep

W8_BUDGET = 1.0  # the target's output error may reach W8-RTN's, no more
LAMBDA_START = 8.0  # the first λ tried by the budget search
SCALE_GRID = (0.85, 0.9, 0.95, 1.0, 7.4375 / 7)  # 7.4375/7: W4's top level at the max
CANDIDATE_STEPS = 3  # hi codes tried between the target's own nibble and the draft's rounding


def joint_round(
    draft: np.ndarray, target: np.ndarray, s: np.ndarray, lambda_draft: float
) -> tuple[np.ndarray, ...]:
    """Best (q4, qr) per element for draft/target values (same shape) on step s.

    Tries the target's own hi nibble, up to CANDIDATE_STEPS codes from it towards the draft's
    rounding, and that rounding; each with the best lo code for the target. Returns
    q4, qr, w4 = q4·s, w8 = w4 + qr·s/16 and the cost."""
    s = np.broadcast_to(s, target.shape)
    own = np.floor((np.clip(np.round(target / (s / 16)), -128, 119) + 8) / 16)
    gap = np.clip(np.round(draft / s), -8, 7) - own

    def candidate(q4, draft, target, s) -> tuple[np.ndarray, ...]:
        step = s / 16
        qr = np.clip(np.round((target - q4 * s) / step), np.where(q4 == -8, 0, -8), 7)
        w4 = q4 * s
        w8 = w4 + qr * step
        return q4, qr, w4, w8, lambda_draft * ((draft - w4) / s) ** 2 + ((target - w8) / step) ** 2

    q4 = own + np.clip(gap, -1, 1)
    cost_own, cost_next = candidate(own, draft, target, s)[4], candidate(q4, draft, target, s)[4]
    q4 = np.where(cost_next < cost_own, q4, own)
    # Codes further away can only win where the draft's rounding is that far (rare).
    far = np.nonzero(np.abs(gap) > 1)
    if far[0].size:
        cost = np.minimum(cost_own, cost_next)[far]
        best, sub = q4[far], (draft[far], target[far], s[far])
        for k in (*range(2, CANDIDATE_STEPS + 1), 15):
            q4k = own[far] + np.clip(gap[far], -k, k)
            cost_k = candidate(q4k, *sub)[4]
            best = np.where(cost_k < cost, q4k, best)
            cost = np.minimum(cost_k, cost)
        q4[far] = best
    return candidate(q4, draft, target, s)


def search_scales(
    w: np.ndarray, h_diag: np.ndarray, lambda_draft: float, rows: int = 4096
) -> np.ndarray:
    """fp16 scales [N, K/128]: per group, the multiple of the W8-range scale (SCALE_GRID) with
    the lowest joint cost of rounding (`joint_round` without error feedback), each input
    weighted by its Hessian diagonal. Rows are processed in chunks to bound memory."""
    base = weight_scales(w)
    n, k = w.shape
    weight = np.maximum(h_diag, 0).reshape(1, k // GROUP_SIZE, GROUP_SIZE)
    out = base.copy()
    for r in range(0, n, rows):
        wg = w[r : r + rows].astype(np.float32).reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
        s0 = base[r : r + rows].astype(np.float32)
        best_cost = np.full(s0.shape, np.inf)
        for alpha in SCALE_GRID:
            s16 = np.maximum(alpha * s0, 2.0**-14).astype(np.float16)
            s = s16.astype(np.float32)[..., None]
            *_, cost = joint_round(wg, wg, s, lambda_draft)
            # Costs are in each candidate's own steps: convert to the base grid's units.
            cost = cost * (s / s0[..., None]) ** 2
            total = (cost * weight).sum(-1)
            better = total < best_cost
            best_cost = np.where(better, total, best_cost)
            out[r : r + rows] = np.where(better, s16, out[r : r + rows])
    return out


def joint_codes(
    w: np.ndarray, h: np.ndarray | Factor, lambda_draft: float, damp: float = 0.01
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """hi codes q4 [N, K], lo codes qr [N, K] and fp16 scales [N, K/128] for weight w [N, K]
    minimising λ·err_W4² + err_W8² (each in its own grid's steps) on the Hessian h [K, K]."""
    f = h if isinstance(h, Factor) else Factor(h, damp)
    scales = search_scales(w, np.diag(f.h), lambda_draft)
    s = np.repeat(scales.astype(np.float64), GROUP_SIZE, axis=1)

    def pair(values: np.ndarray, col: int) -> tuple[np.ndarray, np.ndarray]:
        q4, qr, w4, w8, _ = joint_round(values[0], values[1], s[:, col], lambda_draft)
        return np.stack([q4, qr]), np.stack([w4, w8])

    q4, qr = sweep(w, f, damp, pair, targets=2)
    return q4, qr, scales


def output_errors(w: np.ndarray, planes: Planes, h: np.ndarray) -> dict[int, float]:
    """The draft's (4) and the target's (8) output errors tr(E H Eᵀ)."""
    h32 = h.astype(np.float32)
    out = {}
    for bits, draft in ((4, True), (8, False)):
        e = w.astype(np.float32) - dequantize_planes(
            planes.hi, planes.lo, planes.scales, draft=draft
        )
        out[bits] = float(np.sum((e @ h32) * e))
    return out


def output_errors_vs_rtn(
    w: np.ndarray, planes: Planes, h: np.ndarray, rtn: dict[int, float] | None = None
) -> dict[str, float]:
    """`output_errors` relative to RTN's (< 1: the calibrated codes beat rounding to nearest on
    these inputs); `rtn` passes RTN's errors in when they are already known."""
    rtn = output_errors(w, planes_from_codes(w), h) if rtn is None else rtn
    errors = output_errors(w, planes, h)
    return {f"w{b}_hessian_err_vs_rtn": errors[b] / max(rtn[b], 1e-30) for b in (4, 8)}


def budgeted_joint_planes(
    w: np.ndarray, h: np.ndarray | Factor, w8_budget: float = W8_BUDGET, damp: float = 0.01
) -> tuple[Planes, float, dict[str, float]]:
    """Joint planes for the λ whose target output error just fits `w8_budget` x W8-RTN's on
    this Hessian: the target keeps the accuracy of 8-bit rounding to nearest, and the draft gets
    everything the format leaves.

    Two sweeps: λ = LAMBDA_START, then the λ predicted to land at 95 % of the budget if the
    target's error grew in proportion to λ (it grows more slowly, λ^0.5 … λ^0.95 on the test
    problems and real layers, so the guess errs on the safe side). Of the two, the lowest draft
    error within budget wins; if neither fits, the lower target error. Returns the planes,
    their λ and `output_errors_vs_rtn`."""
    f = h if isinstance(h, Factor) else Factor(h, damp)
    rtn = output_errors(w, planes_from_codes(w), f.h)  # once for both attempts

    def attempt(lam: float) -> tuple[Planes, float, dict[str, float]]:
        q4, qr, scales = joint_codes(w, f, lam, damp)
        planes = planes_from_codes(w, q4, scales, qr)
        return planes, lam, output_errors_vs_rtn(w, planes, f.h, rtn)

    first = attempt(LAMBDA_START)
    ratio = 0.95 * w8_budget / max(first[2]["w8_hessian_err_vs_rtn"], 1e-12)
    second = attempt(LAMBDA_START * float(np.clip(ratio, 1 / 16, 16)))
    fits = [t for t in (first, second) if t[2]["w8_hessian_err_vs_rtn"] <= w8_budget]
    if fits:
        return min(fits, key=lambda t: t[2]["w4_hessian_err_vs_rtn"])
    return min((first, second), key=lambda t: t[2]["w8_hessian_err_vs_rtn"])
