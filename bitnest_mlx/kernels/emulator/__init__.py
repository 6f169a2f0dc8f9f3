"""The CPU emulator of the Metal kernels: the exact source MLX generates, compiled as C++.

It needs a C++ compiler (g++, or `BITNEST_EMU_CXX`) at run time and nothing else; the test suite
runs every kernel through it, and `bench --kernels` counts the operations each kernel executes
(`profile`). Not imported by `bitnest_mlx.kernels`: the runtime never needs it.
"""

from .emulate import EmulatorError, capture, compile_source, cxx, parse_signature, run

__all__ = ["EmulatorError", "cxx", "capture", "compile_source", "parse_signature", "run"]
