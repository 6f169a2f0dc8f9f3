"""Joint W4/W8 code selection: exact per-weight choice, and on calibration Hessians a draft
error below RTN's with the target's within 10 % of W8-RTN's."""

import itertools

import numpy as np
import pytest

from bitnest_mlx.convert.joint import budgeted_joint_planes, joint_codes, joint_round
from bitnest_mlx.convert.sweep import hessian
from bitnest_mlx.formats import bitnest


def calibration_problem(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Correlated, outlier-heavy inputs x [2048, 256] and a weight [192, 256]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, 256)) @ rng.standard_normal((256, 256))
    return x * rng.uniform(0.1, 3, 256), rng.standard_normal((192, 256))


def output_errors(w: np.ndarray, planes: bitnest.Planes, h: np.ndarray) -> tuple[float, float]:
    """tr(E H Eᵀ) of the draft (W4) and the target (W8)."""
    out = []
    for draft in (True, False):
        e = w - bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=draft)
        out.append(float(np.sum((e @ h) * e)))
    return out[0], out[1]


def test_joint_round_picks_the_cheapest_of_all_256_code_pairs():
    rng = np.random.default_rng(0)
    s = 0.1
    target = rng.uniform(-0.8, 0.74, 4000)
    draft = target + rng.normal(0, 0.12, 4000)  # error feedback pulls the two copies apart
    pairs = [(q4, qr) for q4, qr in itertools.product(range(-8, 8), repeat=2) if q4 > -8 or qr >= 0]
    for lam in (0.5, 4.0, 16.0):
        *_, cost = joint_round(draft, target, np.full_like(draft, s), lam)
        brute = np.min(
            [
                lam * ((draft - q4 * s) / s) ** 2
                + ((target - q4 * s - qr * s / 16) / (s / 16)) ** 2
                for q4, qr in pairs
            ],
            axis=0,
        )
        np.testing.assert_allclose(cost, brute, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1])
def test_joint_codes_lower_the_draft_error_below_rtn_and_keep_w8_within_10_percent(seed):
    x, w = calibration_problem(seed)
    h = hessian(x)
    joint, lam, _ = budgeted_joint_planes(w, h)  # the converter's default: λ auto
    rtn = bitnest.planes_from_codes(w)
    (j4, j8), (r4, r8) = output_errors(w, joint, h), output_errors(w, rtn, h)
    assert j4 < 0.9 * r4
    assert j8 <= 1.10 * r8


@pytest.mark.parametrize("budget", [1.0, 0.9])
def test_lambda_found_on_a_row_sample_lands_the_whole_weight_within_its_w8_budget(budget):
    """A weight of 1024 rows: λ comes from two trial sweeps of 256 sampled rows; the one sweep
    of the whole weight fits the budget on the dense trace, close to its 95 % aim, and its
    draft beats the trials' fixed λ = 8 where the budget leaves room."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((4096, 256)) @ rng.standard_normal((256, 256))) * rng.uniform(
        0.1, 3, 256
    )
    w, h = rng.standard_normal((1024, 256)), hessian(x)
    planes, lam, errors = budgeted_joint_planes(w, h, budget)
    (j4, j8), (r4, r8) = (
        output_errors(w, planes, h),
        output_errors(w, bitnest.planes_from_codes(w), h),
    )
    assert 0.85 * budget <= j8 / r8 <= budget
    assert errors["w8_hessian_err_vs_rtn"] == pytest.approx(j8 / r8, rel=1e-4)
    assert errors["w4_hessian_err_vs_rtn"] == pytest.approx(j4 / r4, rel=1e-4)
    q4, qr, scales = joint_codes(w, h, 8.0)
    fixed = bitnest.planes_from_codes(w, q4, scales, qr)
    if lam > 8.0:
        assert j4 < output_errors(w, fixed, h)[0]


def test_lambda_draft_trades_the_target_error_for_the_draft_error():
    x, w = calibration_problem(2)
    h = hessian(x)
    errors = [
        output_errors(w, bitnest.planes_from_codes(w, q4, s, qr), h)
        for q4, qr, s in (joint_codes(w, h, lam) for lam in (0.25, 4.0, 64.0))
    ]
    drafts, targets = zip(*errors)
    assert drafts[0] > drafts[1] > drafts[2]
    assert targets[0] < targets[1] < targets[2]


def test_joint_codes_are_valid_nested_codes_on_their_searched_scales():
    x, w = calibration_problem(3)
    w[0, :128] *= 40  # one outlier group: the scale search must still hold its range in W8
    q4, qr, scales = joint_codes(w, hessian(x), 16.0)
    assert q4.min() >= -8 and q4.max() <= 7 and qr.min() >= -8 and qr.max() <= 7
    assert np.all(qr[q4 == -8] >= 0)
    planes = bitnest.planes_from_codes(w, q4, scales, qr)  # refuses invalid codes itself
    w8 = bitnest.dequantize_planes(planes.hi, planes.lo, planes.scales, draft=False)
    assert np.abs(w8 - w)[0, :128].max() < 0.05 * np.abs(w[0, :128]).max()


def test_convert_cli_defaults_to_joint_with_lambda_auto_and_refuses_a_non_positive_lambda(capsys):
    from bitnest_mlx.cli.convert import build_parser

    args = build_parser().parse_args(["--gguf", "x", "--out", "y"])
    assert (args.method, args.lambda_draft, args.w8_budget) == ("joint", None, 1.0)
    assert (
        build_parser().parse_args(["--gguf", "x", "--out", "y", "--lambda-draft", "8"]).lambda_draft
        == 8.0
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gguf", "x", "--out", "y", "--lambda-draft", "0"])
    assert "> 0 or 'auto'" in capsys.readouterr().err
