"""The generate CLI: in-process through `cli.generate.main(argv)` (what the console script and
`python -m bitnest_mlx.generate` call), and once as the `python -m` process a user runs."""

import json
import subprocess
import sys
from dataclasses import dataclass

import mlx.core as mx
import pytest

from bitnest_mlx.cli import generate


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_cli(capsys):
    """`generate.main(args)` with its exit status and what it printed (no new process: each
    would spend seconds importing mlx-lm, transformers and torch)."""

    def run(*args: str) -> Result:
        capsys.readouterr()
        try:
            code = generate.main(list(args))
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


@pytest.mark.parametrize("mode", ["draft", "target", "speculative"])
def test_demo_generates_json_in_every_mode(run_cli, mode):
    r = run_cli("--prompt", "Hello", "--max-tokens", "16", "--mode", mode, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == mode
    assert len(out["tokens"]) == 16
    assert out["text"]
    assert out["stats"]["generation_tokens"] == 16
    assert out["stats"]["generation_tps"] > 0


def test_demo_streams_text_and_prints_stats_and_the_hardware_mode_as_a_python_m_process():
    r = subprocess.run(
        [sys.executable, "-m", "bitnest_mlx.generate", "--prompt", "The river"]
        + ["--max-tokens", "8", "--temp", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "generation:" in r.stderr and "tok/s" in r.stderr
    # The default mode follows the device: speculative on a GPU, target-only on a CPU.
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    assert ("[speculative] acceptance:" in r.stderr) == on_gpu, r.stderr
    assert ("[mode] target-only: on a CPU device" in r.stderr) == (not on_gpu), r.stderr


def test_speculative_json_stats_and_greedy_parity_with_target_mode(run_cli):
    common = ("--prompt", "The river", "--max-tokens", "24", "--temp", "0", "--json")
    target = json.loads(run_cli(*common, "--mode", "target").stdout)
    forced = ("--mode", "speculative", "--no-fallback", "--num-draft-tokens", "2")
    spec = json.loads(run_cli(*common, *forced).stdout)
    assert spec["mode"] == "speculative"
    assert spec["tokens"] == target["tokens"]
    stats = spec["stats"]
    for key in ("acceptance_rate", "mean_accepted", "draft_s", "verify_s", "generation_tps"):
        assert stats[key] > 0, key
    assert stats["fallback"] is False and stats["mean_drafted"] >= 1
    # --num-draft-tokens 0: target-only decoding through the same loop, no fallback involved.
    zero = json.loads(run_cli(*common, "--mode", "speculative", "--num-draft-tokens", "0").stdout)
    assert zero["tokens"] == target["tokens"]
    assert zero["stats"]["acceptance_rate"] == 0 and zero["stats"]["draft_s"] == 0
    assert zero["stats"]["fallback"] is False


def test_missing_model_is_a_clear_error(run_cli, tmp_path):
    r = run_cli("--model", str(tmp_path / "nope"), "--max-tokens", "2")
    assert r.returncode == 2
    assert "nope" in r.stderr and "error" in r.stderr


def test_dsv4_demo_bundle_generates_and_refuses_draft_mode(run_cli):
    from bitnest_mlx.runtime.demo import demo_bundle_path

    bundle = str(demo_bundle_path())
    r = run_cli("--model", bundle, "--prompt", "hi", "--max-tokens", "6", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["mode"] == "target" and len(out["tokens"]) == 6
    r = run_cli("--model", bundle, "--mode", "draft", "--max-tokens", "2")
    assert r.returncode == 2 and "no draft plane" in r.stderr
