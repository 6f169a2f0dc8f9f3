"""OpenBLAS under MLX on Linux: MLX's Linux CPU wheel links the reference (netlib) BLAS, whose
float32 matmul runs at ~5 GFLOP/s on these CPUs against ~180 with OpenBLAS preloaded (MLX calls
`cblas_sgemm` through the dynamic linker, so a preloaded library takes its place). Long CPU jobs
(conversion's calibration forward) re-execute themselves once with it preloaded.

`BITNEST_MLX_BLAS=reference` keeps the process as it is. Without an OpenBLAS the command says so
in one line (`MISSING`): what it costs and the command that installs one; bitnest-doctor reports
it too (`status`).
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

ENV = "BITNEST_MLX_BLAS"
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
INSTALL = "sudo apt-get install libopenblas0-pthread"
# Measured here: SmolLM2's layer 173 s without it against 18 s with it (docs/convert.md).
MISSING = (
    "warning: no OpenBLAS on this machine, so the conversion's calibration runs about 10x "
    f"slower (MLX's Linux wheel falls back to the reference BLAS); install it: {INSTALL} "
    "(Debian/Ubuntu; elsewhere the distribution's OpenBLAS package)"
)


def openblas() -> str | None:
    """Path of a system OpenBLAS, or None."""
    for path in _CANDIDATES:
        if Path(path).is_file():
            return path
    return ctypes.util.find_library("openblas")


def status() -> str | None:
    """Linux: the OpenBLAS a conversion preloads (its path), or "missing"; elsewhere None
    (MLX uses Apple's Accelerate: nothing to preload)."""
    if sys.platform != "linux":
        return None
    return openblas() or "missing"


def reexec_with_openblas(module: str) -> None:
    """On Linux, run `python -m module <same arguments>` again with OpenBLAS preloaded, unless
    it already is, the user said no, or there is none (then `MISSING` on stderr: one line, not
    a Python warning, which would show a source line and be hidden by warning filters)."""
    if sys.platform != "linux" or os.environ.get(ENV) == "reference":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload:
        return
    lib = openblas()
    if lib is None:
        print(MISSING, file=sys.stderr)
        return
    env = {**os.environ, "LD_PRELOAD": f"{lib} {preload}".strip()}
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
