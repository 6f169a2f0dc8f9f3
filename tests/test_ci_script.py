"""CI runs what the README tells a contributor to run, and no test installs anything."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_test_command_is_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = [line for line in ci if "pytest" in line and not line.startswith("#")]
    assert len(command) == 1 and "--durations=10" in command[0], command
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert command[0] in readme


def test_no_test_installs_a_package():
    installs = re.compile(r"""["'](apt-get|apt|pip|pip3|dnf|yum|brew)["']\s*,\s*["']install""")
    found = [
        f.name
        for f in (ROOT / "tests").rglob("*.py")
        if installs.search(f.read_text(encoding="utf-8"))
    ]
    assert not found, found
