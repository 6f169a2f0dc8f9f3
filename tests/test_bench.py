import json

import pytest

from bitnest_mlx import load
from bitnest_mlx.cli import bench
from bitnest_mlx.cli.bench import CHIPS, roofline
from bitnest_mlx.demo import demo_path
from bitnest_mlx.formats import bitnest


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
    # Draft: hi + scales + biases; target: both planes, scales and biases read by both matmuls.
    assert r["weight_bytes_per_token"]["draft"] == hi + 2 * scales + embed_row
    assert r["weight_bytes_per_token"]["target"] == hi + lo + 4 * scales + embed_row
    at_100 = roofline(model, context=100)["bytes_per_token"]
    kv = r["kv_bytes_per_context_token"]
    assert at_100["target"] - r["bytes_per_token"]["target"] == 100 * kv["target"]
    assert kv["draft"] < kv["target"]
    ceiling = r["ceiling_tps"]["M4 Max (546 GB/s)"]["draft"]
    assert ceiling == pytest.approx(546e9 / r["bytes_per_token"]["draft"])


def test_bench_reports_dsv4_bundle_tok_s(capsys):
    from bitnest_mlx.demo import demo_bundle_path

    out = _bench_json(
        capsys, "--model", str(demo_bundle_path()), "--prompt-tokens", "16", "--gen-tokens", "4"
    )
    assert out["model_type"] == "deepseek_v4"
    assert out["prompt_tps"] > 0 and out["generation_tps"] > 0
