"""The step-time model: its fit to mlx-lm's published Qwen3-4B speeds (kernels counted from the
graph), the held-out check, what each term adds, v(M) on the bytes only, round costs priced by
step time, and bitnest-doctor's t_k and t_sync."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bitnest_mlx.cli import doctor_launch
from bitnest_mlx.measurement import step_fit
from bitnest_mlx.measurement.dispatches import count_mlx_lm_qwen3
from bitnest_mlx.runtime import step_time
from bitnest_mlx.runtime.chips import GPUS, PEAK_GBS
from bitnest_mlx.runtime.speed_model import (
    CostModel,
    Round,
    best_iid_speedup,
    iid_tokens_per_round,
    speed_model,
    step_cost_model,
    verify_cost,
)
from bitnest_mlx.runtime.step_time import Step, constants, step_seconds

DOCS = Path(__file__).resolve().parents[1] / "docs"
SMALL = {**step_fit.QWEN3_SMALL, "num_hidden_layers": step_fit.QWEN3_4B["num_hidden_layers"]}
STATED_RESIDUAL = 0.011  # docs/step-time.md: every row within ±1.1 %


@pytest.fixture(scope="module")
def counts() -> dict:
    return step_fit.count_kernels(SMALL)


@pytest.fixture(scope="module")
def fitted(counts) -> step_fit.Fit:
    return step_fit.fit(counts)


def test_qwen3_kernels_per_layer_and_outside_come_from_the_graph():
    # mlx-lm's qwen3.py read independently of the counter: 2 norms, q/k/v, q and k norms, 2 RoPE,
    # 2 cache writes, attention, o_proj, 2 residual adds, gate, up, the compiled SwiGLU, down.
    c = count_mlx_lm_qwen3(step_fit.QWEN3_SMALL, bits=4)
    assert c.per_layer == 19 and c.per_layer_parts["projection"] == 7
    assert c.per_layer_parts["norm"] == 4 and c.per_layer_parts["attention"] == 1
    # Outside: 3 gathers and one dequantize (one kernel on Metal), the final norm, the tied head,
    # log-sum-exp, the log-probabilities and argmax.
    assert c.outside_parts == {"embedding": 4, "head": 1, "norm": 1, "sampling": 3}
    # mlx-lm 0.28's MLP (before 0.30.4), silu(gate) * up, launches one more a layer.
    assert count_mlx_lm_qwen3(step_fit.QWEN3_SMALL, bits=4, mlp="silu_mul").per_layer == 20
    bf16 = count_mlx_lm_qwen3(step_fit.QWEN3_SMALL, bits=None)
    assert (bf16.per_layer, bf16.outside) == (19, 6)


def test_the_count_depends_on_neither_the_bits_nor_the_group():
    base = count_mlx_lm_qwen3(step_fit.QWEN3_SMALL, bits=4, group_size=64)
    for bits, group in ((8, 64), (5, 32)):
        c = count_mlx_lm_qwen3(step_fit.QWEN3_SMALL, bits=bits, group_size=group)
        assert (c.per_layer, c.outside) == (base.per_layer, base.outside)


def test_bytes_follow_the_config_and_each_precisions_bits():
    cfg = step_fit.QWEN3_4B
    assert step_fit.bits_per_weight(4, 64) == 4.5 and step_fit.bits_per_weight(5, 32) == 6.0
    # K and V, bf16, 36 layers x 8 heads x 128: 147,456 bytes a cached token.
    assert step_fit.kv_bytes(cfg, 1) == 36 * 2 * 8 * 128 * 2
    assert step_fit.CONTEXT == 2048 + 64
    # About 4.02e9 weights (3.63e9 in the layers, 0.39e9 in the tied head) at 16 bits.
    assert step_fit.weight_bytes(cfg, None, 64) == pytest.approx(8.045e9, rel=1e-3)
    q4, q8 = (step_fit.weight_bytes(cfg, b, 64) for b in (4, 8))
    assert q8 / q4 == pytest.approx(8.5 / 4.5, rel=1e-3)
    # stream_generate's tok/s: 128 tokens over 127 steps.
    row = step_fit.FIT_ROWS[-1]
    assert step_fit.step_of_published(row) == pytest.approx(128 / (127 * 134.52))


def test_the_fit_reproduces_the_published_rows_within_the_stated_residuals(fitted, counts):
    assert counts == {(False, "silu_mul"): 726, (True, "silu_mul"): 729, (True, "swiglu"): 693}
    assert [r["precision"] for r in fitted.rows] == [r.precision for r in step_fit.FIT_ROWS]
    assert fitted.max_residual <= STATED_RESIDUAL
    # The constants the runtime prices with are this fit's, rounded.
    assert fitted.f == pytest.approx(step_time.F_BANDWIDTH, abs=5e-4)
    assert fitted.t_kernel == pytest.approx(step_time.T_KERNEL_S, abs=5e-9)
    for row in fitted.rows:
        assert row["fitted_tok_s"] == pytest.approx(row["published_tok_s"] * (1 + row["residual"]))


def test_the_held_out_figure_is_within_25_percent(fitted, counts):
    held = step_fit.check(fitted, counts)
    assert held["chip"] == "M3 Pro" and held["kernels"] == 693
    assert abs(held["residual"]) <= step_fit.CHECK_TOLERANCE and held["within_tolerance"]
    assert abs(held["residual"]) < 0.07  # docs/step-time.md: +6.5 %


def test_the_docs_table_is_the_fits_output(fitted, counts):
    r = {
        "chip": "M4 Max",
        "f": fitted.f,
        "t_kernel_us": fitted.t_kernel * 1e6,
        "context_tokens": step_fit.CONTEXT,
        "kernels": {},
        "counted_at": "",
        "rows": fitted.rows,
        "held_out": step_fit.check(fitted, counts),
    }
    table = [line for line in step_fit.markdown(r).splitlines() if line.startswith("| ")]
    text = (DOCS / "step-time.md").read_text(encoding="utf-8")
    assert all(line in text for line in table)
    assert f"f = {step_time.F_BANDWIDTH}" in text
    assert f"t_k = {step_time.T_KERNEL_S * 1e6:.2f} us" in text


def test_kernels_and_syncs_add_time_to_the_bytes():
    c = constants("M4 Max")
    assert c.bandwidth_gbs == PEAK_GBS["M4 Max"]
    nbytes = 2.5e9
    bytes_only = step_seconds(Step(nbytes, 0), c)
    assert bytes_only == pytest.approx(nbytes / (step_time.F_BANDWIDTH * 546e9))
    with_kernels = step_seconds(Step(nbytes, 700), c)
    assert with_kernels == pytest.approx(bytes_only + 700 * step_time.T_KERNEL_S)
    with_syncs = step_seconds(Step(nbytes, 700, 2), c)
    assert with_syncs == pytest.approx(with_kernels + 2 * step_time.T_SYNC_S)
    b = step_time.breakdown(Step(nbytes, 700, 2), c)
    assert b["tokens_per_second"] == pytest.approx(1 / with_syncs)
    # A doctor's t_k and t_sync replace the assumed ones.
    mine = constants("Apple M4 Max", t_kernel=5e-6, t_sync=20e-6)
    assert step_seconds(Step(nbytes, 700, 2), mine) == pytest.approx(bytes_only + 700 * 5e-6 + 4e-5)


def test_every_chip_has_constants_and_says_where_they_come_from():
    for chip in GPUS:
        c = constants(chip.name)
        assert c.bandwidth_gbs == chip.bandwidth_gbs and c.f > 0 and c.t_kernel > 0
    assert step_time.provenance("M4 Max").startswith("fitted")
    assert "PR #1569" in step_time.provenance("Apple M3 Pro")
    assert step_time.provenance("M1").startswith("assumed")


def test_v_of_m_scales_the_bytes_only_a_verify_pass_launches_one_steps_kernels():
    step = Step(3e9, 1500)
    c = constants("M4 Max")
    v = verify_cost(8, "M4 Max")
    assert v > 1
    extra = step_seconds(step, c, verify=v) - step_seconds(step, c)
    assert extra == pytest.approx(c.bytes_seconds(3e9) * (v - 1))
    cost = step_cost_model(3e9, 1.6e9, 1500, 1400, round_syncs=0)
    unit = cost.target_seconds()
    assert cost.verify_pass(1) == pytest.approx(1.0)
    assert cost.verify_pass(8) * unit == pytest.approx(
        c.bytes_seconds(3e9) * v + 1500 * step_time.T_KERNEL_S
    )
    # Kernel-bound steps: extra rows are nearly free, unlike bytes alone.
    assert cost.verify_pass(8) < CostModel(1.6 / 3).verify_pass(8) == v


def test_existing_constructors_price_bytes_only_as_before():
    old = CostModel(0.5)
    assert not old.timed and old.syncs() == 0.0
    r = Round("model", 3, 2, (1, 1, 1))
    assert old.round(r) == 0.5 * 3 * old.verify(1) + verify_cost(4)
    assert old.chain(3) == 3 * 0.5 + verify_cost(4)
    kv = CostModel(0.5, "M1 Max", "kernel", 0.2)
    assert kv.round(r) == 1.5 * kv.verify(1) + verify_cost(4, "M1 Max", "kernel", 0.2)
    with pytest.raises(ValueError, match="both"):
        CostModel(0.5, target_step=Step(1e9, 10))


def test_step_time_rounds_add_kernels_and_the_rounds_sync():
    bytes_only = CostModel(0.5)
    no_launch = step_cost_model(2e9, 1e9, 0, 0, round_syncs=0)
    r = Round("model", 3, 2, (1, 1, 1))
    # Without kernels or syncs, step time prices what bytes alone did.
    assert no_launch.round(r) == pytest.approx(bytes_only.round(r))
    # A draft that launches as many kernels as the target costs more than its bytes say.
    launched = step_cost_model(2e9, 1e9, 3000, 3000, round_syncs=0)
    assert launched.draft((1,)) > bytes_only.draft((1,))
    synced = step_cost_model(2e9, 1e9, 3000, 3000, round_syncs=1)
    t_sync = step_time.T_SYNC_S / synced.target_seconds()
    assert synced.round(r) == pytest.approx(launched.round(r) + t_sync)
    # The projections read the same costs.
    alpha, tokens = 0.8, {3: 2.5}
    speedup, gamma = best_iid_speedup(alpha, synced)
    best = max((iid_tokens_per_round(alpha, g) / synced.chain(g), g) for g in range(1, 9))
    assert (speedup, gamma) == best
    report = speed_model({"draft": 1e9, "target": 2e9}, alpha, tokens, cost=synced)
    assert report["gammas"]["3"]["measured_speedup"] == pytest.approx(2.5 / synced.round(r))
    plain = speed_model({"draft": 1e9, "target": 2e9}, alpha, tokens)
    assert report["gammas"]["3"]["measured_speedup"] < plain["gammas"]["3"]["measured_speedup"]


def test_doctor_times_t_k_and_t_sync_here_beside_the_models_constants():
    r = doctor_launch.launch_report(None, repeats=5)
    # Each is a difference of medians clamped at 0 (a loaded machine may time either as 0);
    # together they are one eval's time, never 0.
    assert r["t_kernel_us"] >= 0 and r["t_sync_us"] >= 0
    assert r["t_kernel_us"] + r["t_sync_us"] > 0
    assert r["chain"] == list(doctor_launch.CHAIN) and r["repeats"] == 5
    assert r["table_chip"] is None and r["table_t_kernel_us"] is None
    mac = doctor_launch.launch_report("Apple M3 Pro", repeats=5)
    assert mac["table_chip"] == "M3 Pro"
    assert mac["table_t_kernel_us"] == pytest.approx(step_time.T_KERNEL_S * 1e6)
    assert "PR #1569" in mac["table_provenance"]
    text = "\n".join(doctor_launch.markdown(mac))
    assert "| step-time model (M3 Pro) | 3.20 | 150.00 |" in text


def test_doctor_step_cost_fields_are_documented():
    doc = (DOCS / "doctor.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `step_costs\.(\w+)` \|", doc, re.M))
    assert documented == set(doctor_launch.launch_report(None, repeats=5))
