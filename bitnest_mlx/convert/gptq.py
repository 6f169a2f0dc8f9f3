"""GPTQ on the hi (W4) plane, and GPTQ-compensated lo codes for fixed hi codes: static
contiguous groups, damped Hessian. The Hessians come from the calibration forward
(`calibrate.py`); `methods.Method` chooses between these and the joint codes (`joint.py`).

The hi code is bound to the W8 code (`gptq_codes`' w8_slack); the lo plane is the residual of
the original weight, either RTN (the seed's rule) or GPTQ-compensated (`gptq_residual_codes`,
the default: see there why).
"""

from __future__ import annotations

import numpy as np

from ..formats.bitnest import (
    SEED_GROUP_SIZE,
    weight_scales,
)
from .sweep import ColumnQuantizer, Factor, column_scales, sweep


def gptq_codes(
    w: np.ndarray,
    h: np.ndarray | Factor,
    damp: float = 0.01,
    w8_slack: float | None = None,
    *,
    group_size: int = SEED_GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """q4 codes in [-8, 7] [N, K] and fp16 scales [N, K/g] minimising ||X Wᵀ - X Ŵᵀ||, for
    groups of g = `group_size` columns.

    The hi code is the W8 code's hi nibble, so every q4 that GPTQ moves off round(w/s) costs
    the target: its residual no longer fits the lo plane. `w8_slack` (in W8 steps s/16) allows
    only the hi codes of W8 codes within that distance of w, which bounds the W8 error by the
    slack (>= 0.5: RTN is always allowed); None leaves GPTQ free. Columns are swept in their
    natural order: under this constraint act-order made the draft worse on Qwen2.5-0.5B."""
    scales = weight_scales(w, group_size)

    def for_rows(rows: slice) -> ColumnQuantizer:
        s = column_scales(scales, rows)
        k = w.shape[1]
        low, high = np.full((k, 1), -8, np.int8), np.full((k, 1), 7, np.int8)  # or [K, R]
        if w8_slack is not None:
            low, high = np.empty((2, k, s.shape[1]), np.int8)
            for g in range(k // group_size):  # a group at a time: float64 temporaries stay small
                cols = slice(g * group_size, (g + 1) * group_size)
                q8 = w[rows, cols].T / (s[g] / 16)
                for bound, f, d in ((low, np.ceil, -w8_slack), (high, np.floor, w8_slack)):
                    bound[cols] = np.floor((np.clip(f(q8 + d), -128, 119) + 8) / 16)

        def hi(values: np.ndarray, col: int) -> tuple:
            sc = s[col // group_size]
            q = np.clip(np.rint(values[0] / sc), low[col], high[col])
            return q, q * sc

        return hi

    return sweep(w, h, damp, for_rows)[0], scales


def gptq_residual_codes(
    w: np.ndarray, q4: np.ndarray, scales: np.ndarray, h: np.ndarray | Factor, damp: float = 0.01
) -> np.ndarray:
    """lo codes qr [N, K] for fixed hi codes, minimising the W8 output error with GPTQ's error
    feedback: each column's grid is q4·s + qr·s/16, qr in [-8, 7] ([0, 7] where q4 = -8); the
    group is K / (the scales' columns).

    GPTQ moves q4 off round(w/s) where that helps the draft, and the RTN residual cannot reach
    back (its range is ±s/2). Feeding the lo plane's error forward (act-order: largest inputs
    first) recovers the W8 accuracy: on Qwen2.5-0.5B with w8_slack 3 the target's perplexity
    went from +2 % over RTN back to RTN's."""
    group = w.shape[1] // scales.shape[1]

    def for_rows(rows: slice) -> ColumnQuantizer:
        s, hi = column_scales(scales, rows), np.ascontiguousarray(q4[rows].T)

        def lo(values: np.ndarray, col: int) -> tuple:
            step, base = s[col // group] / 16, hi[col] * s[col // group]
            qr = np.clip(np.rint((values[0] - base) / step), np.where(hi[col] == -8, 0, -8), 7)
            return qr, base + qr * step

        return lo

    return sweep(w, h, damp, for_rows, act_order=True)[0]
