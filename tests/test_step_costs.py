"""Step time wired into every caller: the controller's round costs (bytes only as before, timed
with kernels and the round's sync), the costs a seeded run plans with on the chip it runs on,
a DeepSeek-V4 bundle's, the reports' (the counter's kernels, each structure counted once), and
the workload table's rounds re-priced."""

from __future__ import annotations

import mlx.core as mx
import pytest

from bitnest_mlx import load
from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.workload_rounds import DEFAULTS_QWEN05, round_cost, speedup_at
from bitnest_mlx.runtime import step_kernels
from bitnest_mlx.runtime.draft_control import DraftController, Plan
from bitnest_mlx.runtime.draftless import bundle_cost
from bitnest_mlx.runtime.rounds import SpeculationPolicy, SpeculativeRun
from bitnest_mlx.runtime.speed_model import (
    DEFAULT_CHIP,
    CostModel,
    Round,
    iid_tokens_per_round,
    step_cost_model,
    verify_cost,
)
from bitnest_mlx.runtime.step_kernels import STORED, PassKernels, PathKernels
from bitnest_mlx.runtime.step_time import constants
from bitnest_mlx.runtime.token_bytes import kv_bytes, weight_bytes

# A Llama-3.2-3B-sized step on an M4 Max: ~3.4 GB, and a kernel-path count of ~600 kernels.
TARGET, DRAFT = 3.4e9, 1.75e9


def _timed(kernels: float = 600, syncs: float = 1.0) -> CostModel:
    return step_cost_model(TARGET, DRAFT, kernels, kernels, "M4 Max", "kernel", round_syncs=syncs)


@pytest.mark.parametrize("plan", [Plan(), Plan(steps=3), Plan((5, 6), 1), Plan((5, 6, 7), 0)])
def test_the_controllers_round_cost_is_the_cost_models_round(plan):
    bytes_only = CostModel(0.5, "M1", "pure")
    control = DraftController(3, "auto", cost=bytes_only)
    # Bytes only: c · Σ v(rows) + v(γ + 1), as before step time.
    want = 0.5 * sum(verify_cost(r, "M1") for r in plan.draft_calls) + verify_cost(
        plan.gamma + 1, "M1"
    )
    assert control.round_cost(plan) == pytest.approx(want)
    timed = _timed()
    control = DraftController(3, "auto", cost=timed)
    want = timed.draft(plan.draft_calls) + timed.verify_pass(plan.gamma + 1) + timed.syncs()
    assert control.round_cost(plan) == pytest.approx(want)
    assert control.round_cost(plan) == timed.round(plan.as_round(0))


def _best_copy(cost: CostModel, alpha: float) -> int:
    """The copy length (no draft step) with the most expected tokens per cost at `cost`."""
    return max(
        range(1, 9), key=lambda n: iid_tokens_per_round(alpha, n) / cost.round(Round("ngram", n, 0))
    )


def test_kernel_bound_steps_make_verify_rows_cheaper_and_draft_steps_dearer():
    bytes_only = CostModel(DRAFT / TARGET, "M4 Max", "pure")
    # 3000 kernels a step (the pure path at 3B today): 9.6 ms of launches beside 6.9 ms of bytes.
    timed = step_cost_model(TARGET, DRAFT, 3000, 3000, "M4 Max", "pure")
    assert timed.verify_pass(5) < bytes_only.verify_pass(5) == verify_cost(5, "M4 Max")
    assert timed.draft((1,)) > bytes_only.draft((1,))  # the draft launches what the target does
    # Copies (no draft step) of α = 0.8: 3 tokens bytes only, 5 when the kernels are priced.
    assert (_best_copy(bytes_only, 0.8), _best_copy(timed, 0.8)) == (3, 5)


def test_wider_passes_launch_the_counted_kernels_of_the_next_counted_width():
    cost = step_cost_model(TARGET, DRAFT, 600, 540, verify_kernels=[(2, 600), (4, 700), (8, 700)])
    assert [cost.target_kernels(m) for m in (1, 2, 3, 4, 8, 16)] == [600, 600, 700, 700, 700, 700]
    extra = 100 * constants("M4 Max").t_kernel / cost.target_seconds()
    plain = step_cost_model(TARGET, DRAFT, 600, 540)
    assert cost.verify_pass(3) == pytest.approx(plain.verify_pass(3) + extra)
    assert cost.verify_pass(2) == plain.verify_pass(2)


def test_a_seeded_run_plans_by_step_time_on_the_chip_it_runs_on():
    model, _ = load("demo")
    prompt = mx.array([5, 6, 7, 8, 9], dtype=mx.uint32)
    run = SpeculativeRun.start(model, prompt, SpeculationPolicy(draft_kv=4), seed=0)
    cost = run.control.cost
    assert cost.timed and cost.round_syncs == 1
    # Off Metal: the projections' chip, and the pure path the model takes here.
    assert step_kernels.run_chip() == DEFAULT_CHIP and step_kernels.run_path(model) == "pure"
    assert cost.chip == DEFAULT_CHIP and cost.path == "pure"
    layers, w, kv = model.args.num_hidden_layers, weight_bytes(model), kv_bytes(model.args)
    assert cost.target_step.kernels == STORED["pure"].target.per_token(layers)
    assert cost.draft_step.kernels == STORED["pure"].draft.per_token(layers)
    assert cost.target_step.nbytes == w["target"] + kv[8] * prompt.size
    assert cost.draft_step.nbytes == w["draft"] + kv[4] * prompt.size
    # An unseeded run times itself: no fixed costs.
    assert SpeculativeRun.start(model, prompt, SpeculationPolicy()).control.cost is None


def test_a_bundle_is_priced_at_flashs_bytes_and_the_bundles_kernels():
    for path in ("kernel", "pure"):
        cost = bundle_cost(path, "M4 Max")
        kernels = step_kernels.STORED_DSV4[path].per_token(step_kernels.FLASH_LAYERS)
        assert cost.timed and cost.target_step.kernels == kernels and cost.draft((1,)) == 0.0
        assert cost.target_step.nbytes == step_kernels.FLASH_TOKEN_BYTES
        # The expert union makes a row dearer than a dense one; the launches make it cheaper
        # than its bytes alone say.
        assert 1 < cost.verify_pass(4) < cost.verify(4)
    assert bundle_cost().chip == DEFAULT_CHIP


def test_reports_count_each_structure_once(monkeypatch):
    model, _ = load("demo")
    calls = []
    counts = {"kernel": STORED["kernel"], "pure": STORED["pure"]}

    def count(args):
        calls.append(args)
        return {p: {} for p in counts}

    monkeypatch.setattr(step_costs, "_COUNTED", {})
    monkeypatch.setattr(step_costs, "path_kernels", lambda c: counts)
    monkeypatch.setattr("bitnest_mlx.measurement.dispatches.count_bitnest", count)
    for chip in ("M1", "M4 Max"):
        for path in ("kernel", "pure"):
            cost = step_costs.cost_model(model, 100, chip, path)
            assert cost.target_step.kernels == STORED[path].target.per_token(4)
    assert len(calls) == 1
    given = {"pure": PathKernels(PassKernels(1, 0), PassKernels(2, 0))}
    assert step_costs.cost_model(model, 100, "M1", "pure", counts=given).draft_step.kernels == 4


def test_the_workload_tables_mean_rounds_reproduce_its_projections():
    # examples/real_model.md, "At the defaults": M4 Max pure path (kernel path), bytes only, each
    # priced from the logged rounds; the 0.5B's cost ratio there is about 0.41.
    table = {
        "code_edit T0": (2.74, 4.85),
        "code_edit T0.7": (2.53, 3.95),
        "passage_qa T0": (1.86, 2.23),
        "passage_qa T0.7": (1.70, 1.99),
        "chat T0": (1.60, 1.89),
        "chat T0.7": (1.49, 1.71),
        "free T0": (1.73, 2.02),
        "free T0.7": (1.47, 1.64),
    }
    assert set(table) == set(DEFAULTS_QWEN05)
    for name, (pure, kernel) in table.items():
        r = DEFAULTS_QWEN05[name]
        assert r.rounds * (r.tokens_per_round - 1) == pytest.approx(r.model[0] + r.ngram[0])
        assert speedup_at(r, CostModel(0.41, "M4 Max", "pure")) == pytest.approx(pure, rel=0.02)
        assert speedup_at(r, CostModel(0.41, "M4 Max", "kernel")) == pytest.approx(kernel, rel=0.05)
    # A round of copies alone: no draft step, its verify pass and sync.
    copies = DEFAULTS_QWEN05["code_edit T0"]
    timed = _timed()
    assert round_cost(copies, timed) > timed.verify_pass(copies.drafted_per_round + 1)
    assert Round("ngram", 4, 4).tokens == 5
