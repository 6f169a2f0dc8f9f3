"""Every command runs the same `main` three ways: `python -m bitnest_mlx.<name>`, the console
script `bitnest-<name>`, and is listed by `python -m bitnest_mlx`."""

from __future__ import annotations

import runpy
import shutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from bitnest_mlx.cli import COMMANDS


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_python_m_bitnest_mlx_lists_every_command():
    r = run(sys.executable, "-m", "bitnest_mlx")
    assert r.returncode == 0
    listed = [line.split()[0] for line in r.stdout.splitlines()[1:]]
    assert listed == list(COMMANDS)


def test_every_command_has_a_console_script_through_the_light_entry():
    # bitnest_mlx.cli.entry imports the command inside its Ctrl-C handler (tests/test_daily_cli).
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    for name in COMMANDS:
        assert scripts.get(f"bitnest-{name}") == f"bitnest_mlx.cli.entry:{name}", name


@pytest.mark.parametrize("name", list(COMMANDS))
def test_python_m_shim_runs_the_cli_main(name, monkeypatch, capsys):
    # In this process (runpy runs the shim as `python -m` does): a new interpreter per command
    # would spend seconds importing mlx-lm and torch to print a usage line.
    monkeypatch.setattr(sys, "argv", [f"bitnest_mlx.{name}", "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(f"bitnest_mlx.{name}", run_name="__main__", alter_sys=True)
    assert e.value.code == 0 and "usage" in capsys.readouterr().out.lower()


def test_python_m_and_the_console_script_answer_help_as_processes():
    r = run(sys.executable, "-m", "bitnest_mlx.generate", "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr
    script = shutil.which("bitnest-generate")
    if script is None:
        pytest.skip("bitnest-generate is not on PATH (package not pip-installed)")
    r = run(script, "--help")
    assert r.returncode == 0 and "usage" in r.stdout.lower(), r.stderr
