"""A Linux machine without the system OpenBLAS: the converter says so in one line (what it costs,
the command that fixes it), never through Python's warnings, and bitnest-doctor reports it."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from bitnest_mlx.cli import blas, doctor

# The finder looks at the usual paths, then asks the dynamic linker: both come up empty.
NO_OPENBLAS = (
    "from bitnest_mlx.cli import blas\n"
    "import ctypes.util\n"
    "blas._CANDIDATES = ()\n"
    "ctypes.util.find_library = lambda name: None\n"
)


@pytest.fixture
def no_openblas(monkeypatch):
    monkeypatch.setattr(blas, "_CANDIDATES", ())
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)


def test_a_missing_openblas_is_one_line_with_its_cost_and_its_fix(no_openblas, capsys, monkeypatch):
    monkeypatch.setattr(blas.os, "execve", lambda *a: pytest.fail("re-executed without OpenBLAS"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any Python warning fails the test
        blas.reexec_with_openblas("bitnest_mlx.convert")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == blas.MISSING + "\n"
    assert "about 10x slower" in blas.MISSING
    assert "apt-get install libopenblas0-pthread" in blas.MISSING
    assert blas.status() == "missing"


def test_a_found_openblas_is_preloaded_and_named(monkeypatch, capsys):
    monkeypatch.setattr(blas, "openblas", lambda: "/usr/lib/libopenblas.so.0")
    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.delenv(blas.ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    calls = []

    def execve(path, argv, env):
        calls.append(env["LD_PRELOAD"])

    monkeypatch.setattr(blas.os, "execve", execve)
    blas.reexec_with_openblas("bitnest_mlx.convert")
    assert calls == ["/usr/lib/libopenblas.so.0"] and capsys.readouterr().err == ""
    assert blas.status() == "/usr/lib/libopenblas.so.0"
    monkeypatch.setattr(blas.sys, "platform", "darwin")
    assert blas.status() is None  # Accelerate: nothing to preload


@pytest.mark.skipif(sys.platform != "linux", reason="the re-execution is Linux's")
def test_the_convert_command_prints_the_line_and_no_python_warning(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.ENV)}
    script = NO_OPENBLAS + (
        "import sys\n"
        "from bitnest_mlx.cli.convert import main\n"
        f"sys.argv = ['convert', '--hf-path', {str(tmp_path / 'none')!r}, "
        f"'--out', {str(tmp_path / 'pkg')!r}]\n"
        "sys.exit(main())\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "default", "-c", script], env=env, capture_output=True, text=True
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines[0] == blas.MISSING, done.stderr
    assert not any("Warning" in line for line in lines)
    assert lines[1].startswith("error: ")  # the missing source, the command's own refusal


def test_the_doctor_reports_a_missing_openblas(no_openblas):
    assert doctor.system()["openblas"] == "missing"
    (row,) = doctor._openblas_row("missing")
    assert "about 10x slower" in row and blas.INSTALL in row
    assert doctor._openblas_row("/usr/lib/libopenblas.so.0") == [
        "| OpenBLAS | /usr/lib/libopenblas.so.0 |"
    ]
    assert doctor._openblas_row(None) == []
