"""The GPTQ sweep in blocks and chunks of rows: the codes of the plain column-by-column sweep
whatever the chunking, and its own account of the output error."""

import numpy as np
import pytest

from bitnest_mlx.convert import sweep as sweep_module
from bitnest_mlx.convert.gptq import gptq_codes, gptq_residual_codes
from bitnest_mlx.convert.joint import (
    budgeted_joint_planes,
    joint_codes,
    output_errors,
    search_scales,
)
from bitnest_mlx.convert.sweep import Factor, hessian, sweep
from bitnest_mlx.formats import bitnest


def problem(seed: int, n: int = 300, k: int = 384) -> tuple[np.ndarray, np.ndarray]:
    """Correlated inputs with uneven channel scales, a weight [n, k] and its Hessian."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4096, k)) + rng.standard_normal((4096, 8)) @ rng.standard_normal(
        (8, k)
    )
    x *= rng.uniform(0.1, 3, k)
    return (rng.standard_normal((n, k)) * 0.02).astype(np.float32), hessian(x)


def everything(w: np.ndarray, h: np.ndarray) -> list[np.ndarray]:
    f, lo = Factor(h, 0.01), Factor(h, 0.01, act_order=True)
    q4, scales = gptq_codes(w, f, w8_slack=3.0)
    planes, lam, errors = budgeted_joint_planes(w, f)
    return [
        q4,
        gptq_codes(w, f)[0],
        gptq_residual_codes(w, q4, scales, lo),
        *joint_codes(w, f, 8.0),
        planes.hi,
        planes.lo,
        planes.scales,
        np.array([lam, *errors.values(), *output_errors(w, planes, h).values()]),
    ]


def test_row_chunks_do_not_change_any_result(monkeypatch):
    w, h = problem(0)
    whole = everything(w, h)
    # 12 to 37 rows per sweep chunk (by each sweep's state per row), 2 per chunk of error sums.
    monkeypatch.setattr(sweep_module, "CHUNK_BYTES", 37 * 2 * w.shape[1] * 4)
    chunked = everything(w, h)
    for a, b in zip(whole[:-1], chunked[:-1], strict=True):
        np.testing.assert_array_equal(a, b)
    # λ and the errors are sums over rows: equal up to their order of summation.
    np.testing.assert_allclose(whole[-1], chunked[-1], rtol=1e-6)
    np.testing.assert_array_equal(search_scales(w, np.diag(h), 8.0, rows=7), whole[5])


def reference_sweep(w: np.ndarray, f: Factor, s: np.ndarray) -> np.ndarray:
    """The textbook sweep in float64, one column at a time, rounding to the step s [N]."""
    wt = np.where(f.dead[:, None], 0.0, w.T.astype(np.float64))
    codes = np.zeros(wt.shape, dtype=np.int8)
    for j in range(len(wt)):
        q = np.clip(np.round(wt[j] / s), -8, 7)
        codes[j] = q
        wt[j + 1 :] -= np.outer(f.u[j, j + 1 :], (wt[j] - q * s) / f.u[j, j])
    return codes.T


def rounding(s: np.ndarray):
    """A RowQuantizer rounding every column of a row to its step s [N]."""

    def for_rows(rows):
        step = s[rows]

        def quantize(values, col):
            q = np.clip(np.rint(values[0] / step), -8, 7)
            return q, q * step

        return quantize

    return for_rows


@pytest.mark.parametrize("seed", [1, 2])
def test_blocked_sweep_in_float64_equals_the_column_by_column_sweep(seed):
    w, h = problem(seed, n=512, k=640)
    f = Factor(h, 0.01, dtype=np.float64)
    s = np.abs(w).max(1) / 7
    np.testing.assert_array_equal(sweep(w, f, 0.01, rounding(s))[0], reference_sweep(w, f, s))


def test_the_float32_sweep_moves_at_most_a_few_codes_of_the_float64_sweep_by_one_step():
    w, h = problem(5, n=512, k=1024)
    s = np.abs(w).max(1) / 7
    want = reference_sweep(w, Factor(h, 0.01, dtype=np.float64), s)
    f = Factor(h, 0.01)
    assert f.u.dtype == np.float32
    got = sweep(w, f, 0.01, rounding(s))[0]
    moved = got != want
    assert np.abs(got.astype(int) - want).max() <= 1 and moved.mean() < 1e-3, moved.mean()


@pytest.mark.parametrize(
    ("act_order", "dtype", "rtol"),
    [(False, np.float64, 1e-9), (True, np.float64, 1e-9), (True, np.float32, 1e-5)],
)
def test_the_sweeps_error_account_equals_the_trace_on_the_undamped_hessian(act_order, dtype, rtol):
    w, h = problem(4, n=150, k=256)
    h[7], h[:, 7] = 0, 0  # a dead input: zero in every calibration row
    f = Factor(h, 0.05, act_order, dtype)
    scales = bitnest.weight_scales(w)

    def for_rows(rows):
        s = np.repeat(scales[rows].astype(np.float64), 128, axis=1)

        def quantize(values, col):  # two copies rounded on two grids: W4 and W8 steps
            step = np.stack([s[:, col], s[:, col] / 16])
            q = np.clip(np.rint(values / step), [[-8], [-128]], [[7], [119]])
            return q, q * step

        return quantize

    errors = np.zeros(2)
    codes = sweep(w, f, 0.05, for_rows, targets=2, errors=errors)
    s = np.repeat(scales.astype(np.float64), 128, axis=1)
    for i, step in enumerate((s, s / 16)):
        e = w - codes[i] * step
        np.testing.assert_allclose(errors[i], np.sum((e @ h) * e), rtol=rtol)


def test_output_errors_equal_the_dense_trace():
    w, h = problem(3, n=200, k=384)
    planes = bitnest.planes_from_codes(w)
    errors = output_errors(w, planes, h)
    for bits, draft in ((4, True), (8, False)):
        e = w - bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=draft)
        assert errors[bits] == pytest.approx(float(np.sum((e @ h) * e)), rel=1e-5)
