"""The CPU emulator ships in the package (bitnest_mlx/kernels/emulator); tests import it here,
with `InlineSpec`, a throwaway kernel for testing the emulator itself."""

from dataclasses import dataclass

from bitnest_mlx import kernels
from bitnest_mlx.kernels.emulator.emulate import (  # noqa: F401
    EmulatorError,
    capture,
    compile_source,
    cxx,
    launcher,
    parse_signature,
    run,
    translation_unit,
)


@dataclass(frozen=True)
class InlineSpec(kernels.KernelSpec):
    """A kernel whose body is given inline, with no header."""

    body: str = ""

    @property
    def source(self) -> str:
        return self.body

    @property
    def header(self) -> str:
        return ""
