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


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_demo_generates_json_in_both_modes(mode):
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


def test_missing_model_is_a_clear_error(tmp_path):
    r = run_cli("--model", str(tmp_path / "nope"), "--max-tokens", "2")
    assert r.returncode == 2
    assert "nope" in r.stderr and "error" in r.stderr
