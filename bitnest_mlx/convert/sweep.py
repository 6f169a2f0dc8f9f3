"""GPTQ's column sweep, shared by the hi-plane, lo-plane and joint W4/W8 code selections."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# quantize(targets [P, R], column) -> (codes [C, R], dequantized [P, R]) (arrays; [R] for C, P = 1),
# for one chunk of rows.
ColumnQuantizer = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
# rows -> the ColumnQuantizer of those output rows (it may prepare per-chunk grids).
RowQuantizer = Callable[[slice], ColumnQuantizer]

# Rows are independent given the Hessian factor, so the sweep runs over chunks of output rows
# whose state (the Factor's dtype) [P, K, rows] stays within this many bytes.
CHUNK_BYTES = 512 * 2**20
BLOCK = 128  # columns that receive the errors of all earlier columns through one GEMM
SUB_BLOCK = 16  # columns that receive those of their block's earlier columns through one GEMM
TRI_LEAF = 256  # order below which a triangular inverse is one LAPACK call


def hessian(x: np.ndarray) -> np.ndarray:
    """2 XᵀX / n over calibration rows x [n, K]."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float32)  # SGEMM: 2x DGEMM's speed, ample here
    return (2.0 * (x.T @ x) / max(len(x), 1)).astype(np.float64)


class Factor:
    """A Hessian prepared for sweeps: its column order and the damped H⁻¹'s upper Cholesky
    factor. q/k/v (and gate/up) share one Hessian, so the converter prepares it once.

    `dtype` is the sweep's arithmetic: float32 by default, as GPTQ's reference implementation
    sweeps; float64 gives the textbook sweep's codes exactly (the tests' reference). The
    Hessian itself and the error accounts stay float64."""

    def __init__(
        self, h: np.ndarray, damp: float, act_order: bool = False, dtype: type = np.float32
    ):
        # Read only (the undamped Hessian of the error accounts): no copy of a float64 one.
        h = np.asarray(h, dtype=np.float64)
        self.h = h
        self.dead = np.diag(h) == 0  # inputs that are always zero: their weights cannot matter
        self.order = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(len(h))
        # A gather of columns is slow on a large matrix: only act-order pays for one.
        h = h[np.ix_(self.order, self.order)] if act_order else h.copy()
        dead = self.dead[self.order]
        h[dead, dead] = 1
        self.damping = damp * np.mean(np.diag(h))  # added to the diagonal; see `sweep` errors
        h[np.diag_indices_from(h)] += self.damping
        self.u = inverse_upper_cholesky(h, dtype)


def inverse_upper_cholesky(h: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    """U upper triangular with UᵀU = h⁻¹ (h SPD) in `dtype`, without forming h⁻¹: with P the
    reversal, P h P = L Lᵀ gives h⁻¹ = (P L⁻ᵀ P)(P L⁻¹ P), so U = P L⁻¹ P. One Cholesky in
    float64 (numpy's float32 one is slower here) and one triangular inverse in `dtype`."""
    lower = np.linalg.cholesky(np.ascontiguousarray(h[::-1, ::-1], dtype=np.float64))
    return np.ascontiguousarray(_lower_inverse(lower.astype(dtype))[::-1, ::-1])


def _lower_inverse(lower: np.ndarray) -> np.ndarray:
    """L⁻¹ of a lower-triangular L by halves, [[A, 0], [C, D]]⁻¹ = [[A⁻¹, 0], [-D⁻¹CA⁻¹, D⁻¹]]:
    the work is in two GEMMs per level (numpy has no trtri; its LU inverse does 6x the flops)."""
    n = len(lower)
    if n <= TRI_LEAF:
        return np.tril(np.linalg.inv(lower))
    m = n // 2
    a, d = _lower_inverse(lower[:m, :m]), _lower_inverse(lower[m:, m:])
    out = np.zeros_like(lower)
    out[:m, :m], out[m:, m:] = a, d
    out[m:, :m] = -(d @ (lower[m:, :m] @ a))
    return out


def row_chunks(n: int, bytes_per_row: int, limit: int | None = None) -> list[slice]:
    """Consecutive row ranges of at most `limit` (default CHUNK_BYTES) bytes at `bytes_per_row`,
    one row at least."""
    rows = max(1, (CHUNK_BYTES if limit is None else limit) // max(bytes_per_row, 1))
    return [slice(r, min(r + rows, n)) for r in range(0, n, rows)]


def column_scales(scales: np.ndarray, rows: slice, dtype: type = np.float32) -> np.ndarray:
    """The scales [N, K/g] of a chunk of rows as [K/g, R] (fp16 scales are exact in float32):
    column j's are row j // g."""
    return np.ascontiguousarray(scales[rows].T, dtype=dtype)


def sweep(
    w: np.ndarray,
    h: np.ndarray | Factor,
    damp: float,
    quantize: RowQuantizer,
    *,
    targets: int = 1,
    act_order: bool = False,
    chunk_bytes: int | None = None,
    errors: np.ndarray | None = None,
) -> np.ndarray:
    """GPTQ's column sweep over the damped H⁻¹'s upper Cholesky factor, in chunks of output rows.

    Each of the `targets` copies of w is a precision with its own error feedback: `quantize`
    rounds one column of every copy (they may share codes, as the nested W4/W8 codes do) and
    each copy's rounding error is fed forward to its own columns not yet quantized. So a copy
    always holds the values that would undo its precision's error so far. `act_order` sweeps
    the columns by decreasing Hessian diagonal (a given Factor carries its own order); the
    grids (static groups) and the returned codes [C, N, K] keep the original column order.
    A row's codes do not depend on the chunking (`chunk_bytes`, default CHUNK_BYTES).

    `errors` (float64 [targets]), if given, receives each copy's output error tr(E H Eᵀ) on the
    undamped Hessian, E = w - its dequantized values, from the sweep's own accounting: the
    scaled errors e it feeds forward satisfy E = e·U with H_d⁻¹ = UᵀU, so Σe² = tr(E H_d Eᵀ),
    and H_d is H plus the damping (and a unit diagonal on dead inputs). This saves the
    [N, K] x [K, K] product of computing it afterwards."""
    f = h if isinstance(h, Factor) else Factor(h, damp, act_order)
    n, k = w.shape
    # The chunk's state: the copies, and the weight itself when errors are accounted.
    copies = targets + (errors is not None)
    out: np.ndarray | None = None
    for rows in row_chunks(n, copies * k * f.u.itemsize, chunk_bytes):
        codes = _sweep_rows(w[rows], f, quantize(rows), targets, errors)
        if out is None:
            out = np.empty((len(codes), n, k), dtype=np.int8)
        out[:, rows][:, :, f.order] = codes.transpose(0, 2, 1)
    assert out is not None
    return out


def _sweep_rows(
    w: np.ndarray,
    f: Factor,
    quantize: ColumnQuantizer,
    targets: int,
    errors: np.ndarray | None,
) -> np.ndarray:
    """Codes [C, K, R] in sweep order for the rows w [R, K]; adds to `errors` (see `sweep`).

    Column j's value is its weight less the scaled errors e_i of the columns before it, each
    times u[i, j]. A quantized column's error takes its place in the state, and the updates
    are gathered late and in bulk (left-looking): a block of columns receives the errors of
    all earlier blocks in one GEMM, a sub-block those of its block's earlier sub-blocks, and a
    column those of its sub-block's earlier columns (a GEMV). Each output is small, so the
    state is read, not rewritten, once per block. The state has the Factor's dtype; in float64
    the codes equal the plain column-by-column sweep's."""
    u, order = f.u, f.order
    # [K, R] in sweep order: transposed, so each column is a contiguous row.
    w0 = w.T[order].astype(u.dtype)
    w0[f.dead[order]] = 0
    # [P, K, R], one copy per target (w0 itself when nothing else needs it)
    wt = w0[None] if targets == 1 and errors is None else np.repeat(w0[None], targets, axis=0)
    k, r = wt.shape[1:]
    codes: np.ndarray | None = None
    # Σe², Σ(w - q)² over live inputs and over dead ones (see `sweep`).
    sums = np.zeros((3, targets)) if errors is not None else None
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        if i1:
            wt[:, i1:i2] -= u[:i1, i1:i2].T @ wt[:, :i1]
        for j1 in range(i1, i2, SUB_BLOCK):
            j2 = min(j1 + SUB_BLOCK, i2)
            if j1 > i1:
                wt[:, j1:j2] -= u[i1:j1, j1:j2].T @ wt[:, i1:j1]
            for col in range(j1, j2):
                value = wt[:, col]
                if col > j1:
                    value -= u[j1:col, col] @ wt[:, j1:col]
                c, q = quantize(value, order[col])
                c, q = c.reshape(-1, r), q.reshape(targets, r)
                if codes is None:
                    codes = np.empty((len(c), k, r), dtype=np.int8)
                codes[:, col] = c
                if sums is not None:
                    d = w0[col] - q
                    sums[1 + f.dead[order[col]]] += np.einsum("pr,pr->p", d, d)
                value -= q  # the column's state becomes its scaled error
                value /= u[col, col]
        if sums is not None:
            e = wt[:, i1:i2]
            sums[0] += np.einsum("pbr,pbr->p", e, e)
    if errors is not None and sums is not None:
        errors += sums[0] - f.damping * (sums[1] + sums[2]) - sums[2]
    assert codes is not None
    return codes
