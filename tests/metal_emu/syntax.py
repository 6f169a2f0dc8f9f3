"""Metal syntax check on Linux: the generated source against msl_stub.h, with clang or g++.

clang is preferred (real address spaces, and the check runs as for an arm64 Apple target, where
`half` is a native type); g++ is the fallback. This is a gate for typos, undeclared names, wrong
types and address-space mistakes, not a Metal compiler.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

STUB = Path(__file__).parent / "msl_stub.h"


@cache
def compiler() -> tuple[str, str] | None:
    """("clang", path) or ("g++", path), or None; installs nothing (.ci/run installs clang)."""
    clang = shutil.which("clang++")
    if clang:
        return "clang", clang
    gxx = shutil.which("g++")
    return ("g++", gxx) if gxx else None


def check(source: str, tool: tuple[str, str]) -> subprocess.CompletedProcess:
    """-fsyntax-only over one generated kernel source; returncode 0 means it passed."""
    kind, path = tool
    # clang rejects attribute lists on an explicit instantiation (Metal's [[host_name]]).
    text = re.sub(r"template \[\[host_name\([^)]*\)\]\] \[\[kernel\]\]", "template", source)
    if kind == "clang":
        flags = ["--target=arm64-apple-macos", "-nostdinc++", "-Wno-unknown-attributes"]
    else:
        flags = ["-Wno-attributes"]
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as f:
        f.write(text)
    try:
        cmd = [path, "-std=c++17", "-fsyntax-only", "-Werror=return-type", *flags]
        return subprocess.run(
            [*cmd, "-include", str(STUB), f.name], capture_output=True, text=True, timeout=120
        )
    finally:
        os.unlink(f.name)
