import json

import pytest

from bitnest_mlx import load
from bitnest_mlx.cli import bench
from bitnest_mlx.cli.bench import CHIPS, roofline
from bitnest_mlx.formats import bitnest
from bitnest_mlx.measurement.workload_rounds import DEFAULTS_QWEN05
from bitnest_mlx.runtime.demo import demo_path

# The reports' kernels from the stored table (conftest.stored_kernels): not what these test.
pytestmark = pytest.mark.usefixtures("stored_kernels")


def _bench_json(capsys, *argv: str) -> dict:
    """`bench.main(argv)` in this process (test_cli_entry_points runs the command as one)."""
    capsys.readouterr()
    assert bench.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_bench_json_on_demo_reports_all_fields(capsys):
    out = _bench_json(
        capsys,
        *("--model", str(demo_path()), "--prompt-tokens", "8", "--gen-tokens", "6"),
        *("--num-draft-tokens", "2"),
    )
    assert out["settings"]["prompt_tokens"] == 8
    for mode in ("draft", "target"):
        assert out["prompt_tps"][mode] > 0
    for mode in ("draft", "target", "speculative", "speculative_auto"):
        assert out["generation_tps"][mode] > 0
        assert out["peak_memory_gb"][mode] > 0
    spec = out["speculative"]
    assert 0 <= spec["acceptance_rate"] <= 1 and spec["mean_drafted"] >= 1  # forced: it drafted
    assert spec["draft_s"] > 0 and spec["verify_s"] > 0 and spec["fallback"] is False
    assert isinstance(out["speculative_auto"]["fallback"], bool)
    for name in ("q4", "q8"):
        assert out["mlx_lm"][name]["prompt_tps"] > 0 and out["mlx_lm"][name]["generation_tps"] > 0
    assert set(out["ratios_vs_mlx_lm"]) == {
        "draft_prompt_vs_q4",
        "target_prompt_vs_q8",
        "draft_generation_vs_q4",
        "target_generation_vs_q8",
        "speculative_generation_vs_q8",
    }
    assert len(out["roofline"]["ceiling_tps"]) == len(CHIPS)


def test_roofline_counts_the_package_planes_and_scales():
    path = demo_path()
    model, _ = load(path)
    tensors = bitnest.read(path).tensors
    hi = sum(v.nbytes for k, v in tensors.items() if k.endswith(".hi"))
    lo = sum(v.nbytes for k, v in tensors.items() if k.endswith(".lo"))
    scales = sum(v.nbytes for k, v in tensors.items() if k.endswith(".scales"))  # fp16
    embed_row = model.args.hidden_size * 2
    r = roofline(model, context=0)
    # As the dual-plane kernel reads them: the hi plane (draft) or both planes (target), and the
    # fp16 scales once (the -8 offset is folded through Σx: no affine biases are read).
    assert r["weight_bytes_per_token"]["draft"] == hi + scales + embed_row
    assert r["weight_bytes_per_token"]["target"] == hi + lo + scales + embed_row
    at_100 = roofline(model, context=100)["bytes_per_token"]
    kv = r["kv_bytes_per_context_token"]
    assert at_100["target"] - r["bytes_per_token"]["target"] == 100 * kv["target"]
    assert kv["draft"] < kv["target"]
    ceiling = r["ceiling_tps"]["M4 Max (546 GB/s)"]["draft"]
    assert ceiling == pytest.approx(546e9 / r["bytes_per_token"]["draft"])


def test_bench_reports_dsv4_bundle_tok_s(capsys):
    from bitnest_mlx.runtime.demo import demo_bundle_path

    out = _bench_json(
        capsys, "--model", str(demo_bundle_path()), "--prompt-tokens", "16", "--gen-tokens", "4"
    )
    assert out["model_type"] == "deepseek_v4"
    assert out["prompt_tps"] > 0 and out["generation_tps"] > 0


def test_speed_model_of_a_package_reads_its_bytes_without_loading_weights(capsys):
    from bitnest_mlx.measurement import speed_projection, step_costs
    from bitnest_mlx.runtime.speed_model import best_iid_speedup

    path = demo_path()
    out = _bench_json(
        capsys, "--speed-model", "--model", str(path), "--acceptance", "full=0.8", "64=0.5"
    )
    model, _ = load(path)
    loaded = roofline(model, out["context_tokens"])["bytes_per_token"]
    full, small = out["rows"]["full"], out["rows"]["64"]
    assert full["bytes_per_token"] == loaded and full["draft_vocab"] == model.args.vocab_size
    # Priced by step time: bytes, the kernels of the path (counted; the stored table here) and
    # a round's sync, each chip at its own constants and v(M).
    for chip in ("M1", "M4 Max"):
        for p in ("kernel", "pure"):
            cost = step_costs.cost_model(model, out["context_tokens"], chip, p)
            got = full["chips"][chip][p]
            assert got["target_tps"] == pytest.approx(1 / cost.target_seconds())
            assert (got["speedup"], got["gamma"]) == best_iid_speedup(0.8, cost)
            assert got["speculative_tps"] == pytest.approx(got["target_tps"] * got["speedup"])
            kernels = full["chips"][chip]["kernels_per_token"][p]
            assert kernels == {"draft": cost.draft_step.kernels, "target": cost.target_step.kernels}
    # Kernels make a step dearer than its bytes at the chip's bandwidth say.
    assert full["chips"]["M1"]["pure"]["target_tps"] < 68.25e9 / loaded["target"]
    assert set(full["chips"]["M4 Max"]["kernel"]["workloads"]) == set(DEFAULTS_QWEN05)
    assert "workloads" not in small["chips"]["M4 Max"]["kernel"]  # the first row only
    for bits in ("4bit", "8bit"):
        peer = out["mlx_lm"][bits]
        assert peer["kernels_per_token"] > 0 and peer["tps"]["M4 Max"] > peer["tps"]["M1"]
    # The docs' tables (docs/step-time.md): a row per chip, then a row per workload.
    lines = [x for x in speed_projection.markdown(out).splitlines() if x.startswith("| ")]
    assert len(lines) == 2 + len(speed_projection.CHIPS) + len(DEFAULTS_QWEN05)
    # 64 kept ids: the draft's lm_head reads 64 rows (and their ids) instead of the vocabulary's.
    d = model.args.hidden_size
    row = d // 2 + 2 * (d // model.args.group_size)
    assert full["lm_head_bytes_per_token"]["draft"] == model.args.vocab_size * row
    assert small["lm_head_bytes_per_token"]["draft"] == 64 * row + 64 * 4
    assert small["bytes_per_token"]["target"] == loaded["target"]


def test_speed_model_of_a_checkpoint_config_uses_the_converters_defaults(capsys, tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 576,  # 4.5 x 128: the converter picks group 64
        "intermediate_size": 1536,
        "num_hidden_layers": 2,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = _bench_json(capsys, "--speed-model", "--model", str(tmp_path))
    assert out["group_size"] == 64 and out["vocab_size"] == 49152
    row = out["rows"]["package"]  # a checkpoint's default package keeps every row
    assert row["draft_vocab"] == 49152 and "acceptance" not in row
    assert "speedup" not in row["chips"]["M4 Max"]["kernel"]
    planes = sum(n * k // 2 for n, k in bitnest.linear_shapes({**config, "head_dim": 64}).values())
    scales = sum(
        n * k // 64 * 2 for n, k in bitnest.linear_shapes({**config, "head_dim": 64}).values()
    )
    kv_lo_plane = out["context_tokens"] * 2 * 2 * 3 * 64 // 2  # KV8 - KV4: K and V low nibbles
    assert (
        row["bytes_per_token"]["target"] - row["bytes_per_token"]["draft"] == planes + kv_lo_plane
    )
    assert row["bytes_per_token"]["draft"] > planes + scales  # + KV at the context, the embed row
