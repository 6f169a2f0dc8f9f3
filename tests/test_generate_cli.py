import json
import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bitnest_mlx.generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("mode", ["draft", "target", "speculative"])
def test_demo_generates_json_in_every_mode(mode):
    r = run_cli("--prompt", "Hello", "--max-tokens", "16", "--mode", mode, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == mode
    assert len(out["tokens"]) == 16
    assert out["text"]
    assert out["stats"]["generation_tokens"] == 16
    assert out["stats"]["generation_tps"] > 0


def test_demo_streams_text_and_prints_stats():
    r = run_cli("--prompt", "The river", "--max-tokens", "8", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "generation:" in r.stderr and "tok/s" in r.stderr
    assert "[speculative] acceptance:" in r.stderr  # speculative is the default mode


def test_speculative_json_stats_and_greedy_parity_with_target_mode():
    common = ("--prompt", "The river", "--max-tokens", "24", "--temp", "0", "--json")
    target = json.loads(run_cli(*common, "--mode", "target").stdout)
    spec = json.loads(run_cli(*common, "--no-fallback", "--num-draft-tokens", "2").stdout)
    assert spec["mode"] == "speculative"
    assert spec["tokens"] == target["tokens"]
    stats = spec["stats"]
    for key in ("acceptance_rate", "mean_accepted", "draft_s", "verify_s", "generation_tps"):
        assert stats[key] > 0, key
    assert stats["fallback"] is False and stats["mean_drafted"] >= 1
    # --num-draft-tokens 0: target-only decoding through the same loop, no fallback involved.
    zero = json.loads(run_cli(*common, "--num-draft-tokens", "0").stdout)
    assert zero["tokens"] == target["tokens"]
    assert zero["stats"]["acceptance_rate"] == 0 and zero["stats"]["draft_s"] == 0
    assert zero["stats"]["fallback"] is False


def test_missing_model_is_a_clear_error(tmp_path):
    r = run_cli("--model", str(tmp_path / "nope"), "--max-tokens", "2")
    assert r.returncode == 2
    assert "nope" in r.stderr and "error" in r.stderr


def test_dsv4_demo_bundle_generates_and_refuses_draft_mode():
    from bitnest_mlx.demo import demo_bundle_path

    bundle = str(demo_bundle_path())
    r = run_cli("--model", bundle, "--prompt", "hi", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "target" and len(out["tokens"]) == 6
    r = run_cli("--model", bundle, "--mode", "draft", "--max-tokens", "2")
    assert r.returncode == 2 and "no draft plane" in r.stderr
