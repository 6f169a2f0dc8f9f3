"""GPTQ's column sweep, shared by the hi-plane, lo-plane and joint W4/W8 code selections."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..formats.bitnest import GROUP_SIZE

# quantize(targets [P, N], column) -> (codes [C, N], dequantized [P, N])
ColumnQuantizer = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def hessian(x: np.ndarray) -> np.ndarray:
    """2 XᵀX / n over calibration rows x [n, K]."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float32)  # SGEMM: 2x DGEMM's speed, ample here
    return (2.0 * (x.T @ x) / max(len(x), 1)).astype(np.float64)


class Factor:
    """A Hessian prepared for sweeps: its column order and the damped H⁻¹'s upper Cholesky
    factor. q/k/v (and gate/up) share one Hessian, so the converter prepares it once."""

    def __init__(self, h: np.ndarray, damp: float, act_order: bool = False):
        h = h.astype(np.float64)
        self.h = h
        self.dead = np.diag(h) == 0  # inputs that are always zero: their weights cannot matter
        h = h.copy()
        h[self.dead, self.dead] = 1
        self.order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(len(h))
        h = h[self.order][:, self.order]
        h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
        self.u = np.linalg.cholesky(np.linalg.inv(h)).T


def sweep(
    w: np.ndarray,
    h: np.ndarray | Factor,
    damp: float,
    quantize: ColumnQuantizer,
    *,
    targets: int = 1,
    act_order: bool = False,
) -> np.ndarray:
    """GPTQ's column sweep in blocks of 128 over the damped H⁻¹'s upper Cholesky factor.

    Each of the `targets` copies of w is a precision with its own error feedback: `quantize`
    rounds one column of every copy (they may share codes, as the nested W4/W8 codes do) and
    each copy's rounding error is fed forward to its own columns not yet quantized. So a copy
    always holds the values that would undo its precision's error so far. `act_order` sweeps
    the columns by decreasing Hessian diagonal (a given Factor carries its own order); the
    grids (static groups) and the returned codes [C, N, K] keep the original column order."""
    f = h if isinstance(h, Factor) else Factor(h, damp, act_order)
    order, u = f.order, f.u
    # [P, K, N]: transposed, so each column is a contiguous row.
    wt = np.where(f.dead[:, None], 0.0, w.T.astype(np.float64))[order]
    wt = np.repeat(wt[None], targets, axis=0)
    k, n = wt.shape[1:]
    codes: np.ndarray | None = None
    for i1 in range(0, k, GROUP_SIZE):
        i2 = min(i1 + GROUP_SIZE, k)
        block, err = wt[:, i1:i2].copy(), np.zeros((targets, i2 - i1, n))
        for j in range(i2 - i1):
            col = i1 + j
            c, value = quantize(block[:, j], order[col])
            c = np.asarray(c).reshape(-1, n)
            if codes is None:
                codes = np.zeros((len(c), k, n), dtype=np.int8)
            codes[:, col] = c
            e = (block[:, j] - value) / u[col, col]
            block[:, j:] -= u[col, col:i2][None, :, None] * e[:, None, :]
            err[:, j] = e
        if i2 < k:
            wt[:, i2:] -= u[i1:i2, i2:].T @ err  # [P, K - i2, N], through BLAS
    out = np.empty((len(codes), n, k), dtype=np.int8)
    out[:, :, order] = codes.transpose(0, 2, 1)
    return out
