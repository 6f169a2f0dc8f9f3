"""eval's sampling acceptance (mean Σ min(p, q) at temp 0.7 / top-p 0.95), the mean accepted
length of the real speculative loop at fixed γ, and the speed model (bytes only, and by step time
in eval's report)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from factory import differing_pair, edit_tensors, tiny_package

import bitnest_mlx
from bitnest_mlx.cli import eval as eval_cli
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.evaluation import builtin_prompts, evaluate, sampled_acceptance
from bitnest_mlx.runtime.sampling import acceptance_probability
from bitnest_mlx.runtime.speed_model import (
    iid_tokens_per_round,
    projected_speedup,
    speed_model,
    verify_cost,
)

# The reports' kernels from the stored table (conftest.stored_kernels): not what these test.
pytestmark = pytest.mark.usefixtures("stored_kernels")

TEXT = "the mill by the river turned slowly while the water ran under the old stone bridge. " * 4
FAST = dict(max_tokens=96, window=48, gamma=2, spec_tokens=0)  # teacher-forced part only


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    path = tmp_path_factory.mktemp("pkg")
    tiny_package(path, seed=11)
    return path


@pytest.fixture(scope="module")
def same_planes(tmp_path_factory):
    """A package whose lo planes are all zero codes (nibble 8 = qr 0), so W8 == W4."""
    path = tmp_path_factory.mktemp("same")
    tiny_package(path, seed=11)
    edit_tensors(
        path,
        lambda t: t.update(
            {k: mx.full(v.shape, 0x88, dtype=mx.uint8) for k, v in t.items() if k.endswith(".lo")}
        ),
    )
    return path


def test_sum_min_pq_is_one_when_the_draft_is_the_target(same_planes):
    model, tokenizer = bitnest_mlx.load(same_planes)
    # Reading KV8 too, the draft computes exactly what the target does.
    r = evaluate(model, tokenizer, TEXT, draft_kv=8, gen_tokens=0, **FAST)
    assert r["sum_min_pq"] == pytest.approx(1.0, abs=1e-5)
    assert r["argmax_agreement"] == 1.0
    # KV4 is still a coarser read of the same cache: the draft differs a little.
    assert r["draft_kv"]["readings"]["4"]["sum_min_pq"] < 1 - 1e-4


def test_every_draft_is_accepted_when_the_draft_is_the_target(same_planes):
    model, tokenizer = bitnest_mlx.load(same_planes)
    runs = sampled_acceptance(
        model, builtin_prompts(tokenizer), gammas=(2, 3), gen_tokens=12, draft_kv=8
    )
    for gamma in (2, 3):
        assert runs[str(gamma)]["mean_accepted"] == gamma
        assert runs[str(gamma)]["tokens_per_round"] == gamma + 1
        assert runs[str(gamma)]["acceptance_rate"] == 1.0


def test_sum_min_pq_is_below_one_for_a_differing_pair(tmp_path):
    model, y, sampler, p, q = differing_pair(tmp_path, temp=0.7)
    lp = sampler.logprobs(model(y[None], mode="target")[0, -1])
    lq = sampler.logprobs(model(y[None], mode="draft")[0, -1])
    got = acceptance_probability(lq, lp).item()
    assert got == pytest.approx(np.minimum(p, q).sum(), abs=1e-6)
    assert got < 0.95


def numpy_sampling(logits: np.ndarray, temp: float, top_p: float) -> np.ndarray:
    """Probabilities [T, V] after top-p then temperature, from the definitions: keep a token
    when the tokens more probable than it hold less than top_p of the mass."""
    lp = logits - logits.max(-1, keepdims=True)
    prob = np.exp(lp)
    prob /= prob.sum(-1, keepdims=True)
    order = np.argsort(-prob, axis=-1)
    ranked = np.take_along_axis(prob, order, -1)
    before = np.cumsum(ranked, -1) - ranked
    keep = np.zeros_like(prob, dtype=bool)
    np.put_along_axis(keep, order, before < top_p, -1)
    z = np.where(keep, lp / temp, -np.inf)
    out = np.exp(z - z.max(-1, keepdims=True))
    return out / out.sum(-1, keepdims=True)


def test_sum_min_pq_matches_a_numpy_reference(package):
    model, tokenizer = bitnest_mlx.load(package)
    tokens = tokenizer.encode(TEXT)[:64]
    r = evaluate(model, tokenizer, TEXT, max_tokens=64, window=64, gamma=2, spec_tokens=0,
                 draft_kv=4, gen_tokens=0)  # fmt: skip
    dense = RunOptions(dense_min_rows=32)
    run = lambda o: np.array(model(mx.array([tokens]), options=o)[0]).astype(np.float64)
    p = numpy_sampling(run(dense), 0.7, 0.95)
    q = numpy_sampling(run(RunOptions("draft", dense_min_rows=32, draft_kv=4)), 0.7, 0.95)
    expected = np.minimum(p, q).sum(-1).mean()
    assert r["sum_min_pq"] == pytest.approx(expected, abs=1e-5)
    assert 0.3 < expected < 0.999  # a real, partial overlap
    assert r["sampling"] == {"temp": 0.7, "top_p": 0.95, "seed": 0, "rule": "rejection"}


def test_speed_formulas_against_hand_computed_values():
    # i.i.d. acceptance α = 0.8: 1 + α + ... + α^γ.
    assert iid_tokens_per_round(0.8, 2) == pytest.approx(1 + 0.8 + 0.64)  # 2.44
    assert iid_tokens_per_round(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)  # 2.952
    assert iid_tokens_per_round(1.0, 4) == 5
    # Speedup = tokens per round / (γ·c + v(γ+1)): c = 0.5, γ = 3, v = 1 -> 2.952 / 2.5;
    # v = 1.3 -> 2.952 / 2.8.
    assert projected_speedup(2.952, 3, 0.5) == pytest.approx(1.1808)
    assert projected_speedup(2.952, 3, 0.5, verify=1.3) == pytest.approx(2.952 / 2.8)
    # Measured tokens per round 2.5, 2.9, 3.0 at γ = 2, 3, 4, c = 1/2, with the table's v(M)
    # on the pure path of an M1 (verify passes of 3, 4, 5 rows).
    m = speed_model({"draft": 1.0, "target": 2.0}, 0.8, {2: 2.5, 3: 2.9, 4: 3.0}, "M1", "pure")
    assert m["cost_ratio"] == 0.5 and m["alpha"] == 0.8 and m["chip"] == "M1"
    v = [verify_cost(g + 1, "M1", "pure") for g in (2, 3, 4)]
    assert [m["gammas"][g]["verify_cost"] for g in ("2", "3", "4")] == v
    speedups = [m["gammas"][g]["measured_speedup"] for g in ("2", "3", "4")]
    assert speedups == pytest.approx([2.5 / (1 + v[0]), 2.9 / (1.5 + v[1]), 3 / (2 + v[2])])
    iid = [m["gammas"][g]["iid_speedup"] for g in ("2", "3", "4")]
    assert iid == pytest.approx([2.44 / (1 + v[0]), 2.952 / (1.5 + v[1]), 3.3616 / (2 + v[2])])
    best = max(range(3), key=lambda i: speedups[i])
    assert (m["best_gamma"], m["best_speedup"]) == (best + 2, pytest.approx(speedups[best]))


def test_eval_reports_the_speed_model_from_the_measured_runs(package):
    model, tokenizer = bitnest_mlx.load(package)
    r = evaluate(model, tokenizer, TEXT, gammas=(2, 3), gen_tokens=16, **FAST)
    runs, speed = r["speculative_sampling"], r["speed_model"]
    context, kv = speed["context_tokens"], speed["draft_kv"]
    cost = step_costs.cost_model(model, context, speed["chip"], speed["path"], draft_kv=kv)
    assert speed["kernels_per_token"]["target"] == cost.target_step.kernels
    assert runs["gen_tokens"] == 16 and set(runs["prompt_tokens"]) == {"code", "prose", "chat"}
    for g, row in runs["gammas"].items():
        assert 0 <= row["mean_accepted"] <= int(g)
        assert row["tokens_per_round"] == row["mean_accepted"] + 1
        # Whole rounds until 16 tokens per prompt: at least 16 / (γ + 1) rounds each.
        assert row["rounds"] >= 3 * 16 // (int(g) + 1)
        measured = speed["gammas"][g]
        assert measured["measured_tokens_per_round"] == row["tokens_per_round"]
        # Priced by step time: the draft's and target's bytes and kernels, the round's sync.
        assert measured["measured_speedup"] == pytest.approx(
            row["tokens_per_round"] / cost.chain(int(g))
        )
    b = speed["bytes_per_token"]
    assert speed["cost_ratio"] == pytest.approx(b["draft"] / b["target"])
    assert speed["alpha"] == r["sum_min_pq"]
    assert speed["best_speedup"] == max(s["measured_speedup"] for s in speed["gammas"].values())


def test_eval_cli_prints_the_new_fields(package, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["--model", str(package), "--text", str(text), "--max-tokens", "64", "--window", "32"]
    argv += ["--gen-tokens", "8", "--gammas", "2,3"]
    assert eval_cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["sum_min_pq"] <= 1
    assert set(out["speculative_sampling"]["gammas"]) == {"2", "3"}
    assert out["speed_model"]["best_gamma"] in (2, 3)
    assert out["draft_kv"]["policy"] == "auto" and out["draft_kv"]["windows"] in (4, 8)
    assert set(out["draft_kv"]["readings"]) == {"4", "8"}
    assert eval_cli.main([*argv, "--draft-kv", "4"]) == 0
    report = capsys.readouterr().out
    assert "sum min(p, q)" in report and "tokens a round" in report
    assert "the draft reads KV4: --draft-kv 4" in report and "best: gamma" in report
