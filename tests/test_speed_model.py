"""The one table of the verify cost v(M), the cost of logged rounds, the plan a controller with
fixed costs picks, and `bench --workloads`."""

from __future__ import annotations

import json

import pytest

from bitnest_mlx.cli import bench
from bitnest_mlx.measurement.workloads import WORKLOADS, load_workload
from bitnest_mlx.runtime.chips import GPUS, family, gpu
from bitnest_mlx.runtime.draft_control import DraftController, Plan
from bitnest_mlx.runtime.speed_model import (
    KERNEL_CYCLES,
    KV8_CYCLES,
    KV8_STREAM_BYTES,
    CostModel,
    Round,
    rounds_speedup,
    verify_cost,
)

# The reports' kernels from the stored table (conftest.stored_kernels): not what these test.
pytestmark = pytest.mark.usefixtures("stored_kernels")

ROWS = range(1, 21)


@pytest.mark.parametrize("path", ["pure", "kernel"])
def test_one_row_costs_one_step_and_more_rows_never_cost_less(path):
    for chip in GPUS:
        costs = [verify_cost(m, chip.name, path) for m in ROWS]
        assert costs[0] == 1.0
        assert all(b >= a for a, b in zip(costs, costs[1:])), chip.name


def test_m1_m2_verify_rows_dearer_than_m3_and_later_on_the_pure_path():
    assert family("Apple M2 Max") == "M1/M2" and family("M4 Pro") == "M3+"
    for m in ROWS:
        assert verify_cost(m, "M1 Max", "pure") >= verify_cost(m, "M3 Max", "pure")
    assert verify_cost(4, "M2 Ultra", "pure") > verify_cost(4, "M4 Max", "pure") > 1


def test_kernel_cost_is_bytes_until_the_rows_arithmetic_exceeds_the_alu_budget():
    # M1 Max: 32 cores x 128 lanes at 1.296 GHz against 400 GB/s, for 1 + 2/64 bytes a weight.
    budget = 32 * 128 * 1.296 * (1 + 2 / 64) / 400
    assert gpu("M1 Max").budget(1 + 2 / 64) == pytest.approx(budget)
    assert KERNEL_CYCLES[1] < budget and 8 * KERNEL_CYCLES[8] > budget
    assert verify_cost(2, "M1 Max", "kernel") == 1.0
    assert verify_cost(8, "M1 Max", "kernel") == pytest.approx(8 * KERNEL_CYCLES[8] / budget)
    # Past the kernel's 8 rows the layers run MLX's matmuls: the pure path's cost.
    assert verify_cost(9, "M1 Max", "kernel") == verify_cost(9, "M1 Max", "pure")


def test_long_context_makes_verify_rows_dearer_where_the_kv_read_is_alu_bound():
    # M4 Max: the KV8 read keeps up with memory at 2 rows, not at 4 or 8 (the nested-KV counts).
    budget = gpu("M4 Max").budget(KV8_STREAM_BYTES)
    assert 2 * KV8_CYCLES[2] < budget < 4 * KV8_CYCLES[4]
    assert verify_cost(2, "M4 Max", "kernel", 0.3) == verify_cost(2, "M4 Max", "kernel") == 1.0
    for m in (4, 8):
        short, long = (verify_cost(m, "M4 Max", "kernel", f) for f in (0.0, 0.3))
        assert long > short
    assert verify_cost(1, "M4 Max", "kernel", 0.3) == 1.0


def test_rounds_cost_their_draft_calls_and_verify_pass():
    cost = CostModel(0.5, "M1", "pure")
    rounds = [
        Round("model", 2, 2, (1, 1)),  # 3 tokens for 2 draft steps + v(3)
        Round("ngram", 4, 1, ()),  # 2 tokens for v(5) alone
        Round("target", 0, 0),  # 1 token for 1 step
    ]
    spent = 0.5 * 2 + verify_cost(3, "M1", "pure") + verify_cost(5, "M1", "pure") + 1
    assert rounds_speedup(rounds, cost) == pytest.approx(6 / spent)
    assert rounds_speedup([], cost) is None


def test_fixed_cost_controller_copies_when_copies_are_accepted():
    control = DraftController(3, "auto", cost=CostModel(0.5, "M4 Max", "pure"))
    copy = [5, 6, 7, 8, 9, 10]
    for _ in range(20):
        plan = control.choose(copy, match=4)
        control.update(plan, plan.gamma, 0.0, 0.0)  # every draft accepted
    plan = control.choose(copy, match=4)
    assert plan.ngram == tuple(copy) and plan.source in ("ngram", "ngram+model")
    # Without a copy it drafts the chain; with copies rejected it stops copying.
    assert control.choose([], 0).source == "model"
    for _ in range(30):
        plan = control.choose(copy, match=2)
        control.update(plan, 0, 0.0, 0.0)
    assert not control.choose(copy, match=2).ngram
    assert Plan((1, 2), 3).draft_calls == (3, 1, 1)  # y and the copy in one call, then steps


def test_a_match_length_never_seen_starts_from_the_run_s_copies_so_far():
    """Copies that keep failing at some match lengths make a new one start low: the controller
    drafts the chain rather than paying for a copy it has no reason to trust."""
    fresh = DraftController(3, "auto", cost=CostModel(0.5, "M4 Max", "pure"))
    failing = DraftController(3, "auto", cost=CostModel(0.5, "M4 Max", "pure"))
    copy = [5, 6, 7, 8, 9, 10]
    for match in (2, 3) * 15:
        plan = Plan(tuple(copy), 0, match)
        failing.update(plan, 0, 0.0, 0.0)  # every copied token rejected
    assert fresh.choose(copy, match=5).ngram  # no history: a 5-token match is worth copying
    assert failing._copies(5).alpha < 0.1
    assert not failing.choose(copy, match=5).ngram


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_workload_prompt_is_a_chat_ending_with_the_users_turn(name):
    prompts = load_workload(name)
    assert len(prompts) >= 3
    for p in prompts:
        assert p["messages"][-1]["role"] == "user"
        assert {m["role"] for m in p["messages"]} <= {"system", "user", "assistant"}
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("poetry")


def test_bench_workloads_reports_rounds_sources_and_projections(capsys):
    argv = ["--workloads", "code_edit", "--workload-tokens", "6", "--workload-temps", "0"]
    assert bench.main([*argv, "--workload-configs", "chain+ngram", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["workloads"]["code_edit"]["0.0"]["chain+ngram"]
    assert r["tokens_per_round"] >= 1 and r["rounds"] >= 1
    assert set(r["projected_speedup"]) == {"M1", "M3 Max", "M4 Max"}
    assert set(r["projected_speedup"]["M4 Max"]) == {"pure", "kernel"}
    assert len(r["prompts"]) == len(load_workload("code_edit"))
    assert all(len(p["tokens"]) >= 6 for p in r["prompts"].values())
    assert out["verify_cost"]["pure"]["M4 Max"]["1"] == 1.0


def test_bench_speed_model_reads_the_demo_and_refuses_a_folder_without_config_in_one_line(
    tmp_path, capsys
):
    assert bench.main(["--speed-model", "--model", "demo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vocab_size"] > 0
    assert bench.main(["--speed-model", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "config.json" in err[0]


def test_a_workload_run_ends_after_the_round_holding_its_end_of_sequence_token(monkeypatch):
    """An accepted draft can be the end-of-sequence token: the run stops after that round
    (never decoding past the end of the text) and its text ends at the token."""
    from bitnest_mlx.measurement import workloads
    from bitnest_mlx.runtime.speed_model import Round

    rounds = [[5, 6, 7], [8, 2, 9], [10, 11, 12]]  # 2 is the end, the 2nd of round 2

    def fake_loop(prompt, model, *, stats, **kwargs):
        for out in rounds:
            stats.record(Round("ngram", drafted=len(out), accepted=len(out) - 1))
            yield from ((t, None, i < len(out) - 1) for i, t in enumerate(out))

    monkeypatch.setattr(workloads, "speculative_generate_step", fake_loop)
    tokens, stats = workloads.speculate(None, [1], 100, None, 0, "auto", eos_token_ids=[2])
    assert tokens == [5, 6, 7, 8, 2]
    assert len(stats.round_log) == 2  # the round that held the end, whole; no round after it


@pytest.mark.parametrize("path", ["kernel", "pure"])
def test_a_workload_run_plans_with_the_step_time_of_the_path_and_dims_it_is_asked_to_plan_for(
    monkeypatch, path
):
    """`--workload-plan-path kernel` makes a CPU run plan as a Mac with the kernels would, and
    `--workload-plan-dims` as a model of those dims would: the loop gets that step-time cost
    model at the run's chip and the prompt's context; without either, the loop's own."""
    from bitnest_mlx.measurement import bench_workloads, step_costs, workloads
    from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
    from bitnest_mlx.runtime.demo import demo_path
    from bitnest_mlx.runtime.loader import load
    from bitnest_mlx.runtime.sampling import Sampler
    from bitnest_mlx.runtime.speed_model import Round
    from bitnest_mlx.runtime.step_kernels import STORED

    model, _ = load(demo_path())
    seen = []

    def fake_loop(prompt, model, *, stats, cost_model=None, **kwargs):
        seen.append(cost_model)
        stats.record(Round("model", drafted=1, accepted=1, draft_calls=(1,)))
        yield from ((t, None, i == 0) for i, t in enumerate([5, 6]))

    monkeypatch.setattr(workloads, "speculative_generate_step", fake_loop)
    for dims in (None, "llama-3.2-3b", "none"):
        plan = None if dims == "none" else bench_workloads.plan_costs(model, path, dims)
        workloads.run_prompts(model, {"p": [1, 2, 3]}, 2, Sampler(), 0, "auto", plan=plan)
    big = skeleton(spec_of("llama-3.2-3b"))
    assert seen == [
        step_costs.cost_model(model, 3 + 2 // 2, "M4 Max", path),
        step_costs.cost_model(big, 3 + 2 // 2, "M4 Max", path, counts=STORED),
        None,
    ]
    assert bench_workloads.plan_costs(model, None, None) is None
