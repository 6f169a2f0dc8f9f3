"""The CPU emulator ships in the package (bitnest_mlx/kernels/emulator); tests import it here."""

from bitnest_mlx.kernels.emulator.emulate import (  # noqa: F401
    CXX,
    EmulatorError,
    capture,
    compile_source,
    launcher,
    parse_signature,
    run,
    translation_unit,
)
