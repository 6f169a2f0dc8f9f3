"""OpenBLAS under MLX on Linux: MLX's Linux CPU wheel links the reference (netlib) BLAS, whose
float32 matmul runs at ~5 GFLOP/s on these CPUs against ~180 with OpenBLAS preloaded (MLX calls
`cblas_sgemm` through the dynamic linker, so a preloaded library takes its place). Long CPU jobs
(conversion's calibration forward) re-execute themselves once with it preloaded.

`BITNEST_MLX_BLAS=reference` keeps the process as it is.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
import warnings
from pathlib import Path

ENV = "BITNEST_MLX_BLAS"
_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def openblas() -> str | None:
    """Path of a system OpenBLAS, or None."""
    for path in _CANDIDATES:
        if Path(path).is_file():
            return path
    return ctypes.util.find_library("openblas")


def reexec_with_openblas(module: str) -> None:
    """On Linux, run `python -m module <same arguments>` again with OpenBLAS preloaded, unless
    it already is, the user said no, or there is none (then warn how to get it)."""
    if sys.platform != "linux" or os.environ.get(ENV) == "reference":
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if "openblas" in preload:
        return
    lib = openblas()
    if lib is None:
        warnings.warn(
            "MLX's Linux wheel uses the reference BLAS (slow float matmul): install OpenBLAS "
            "(Debian: apt-get install libopenblas0-pthread) for a much faster calibration",
            stacklevel=2,
        )
        return
    env = {**os.environ, "LD_PRELOAD": f"{lib} {preload}".strip()}
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)
