"""One kernel = a `.metal` body (`KernelSpec`) + a planned call (`Launch`) + a runner.

Each kernel's body lives in `bitnest_mlx/metal_kernels/<file>.metal` (helpers in `common.metal`)
and is built into an `mx.fast.metal_kernel` once per process. On Metal the runner is the real
kernel; the test suite passes the CPU emulator (`kernels.emulator`), which compiles the exact
source MLX generates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources

import mlx.core as mx


@dataclass(frozen=True)
class KernelSpec:
    """One kernel: its .metal body, argument names and the attributes of the generated source."""

    name: str
    file: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]

    @property
    def source(self) -> str:
        return _read(self.file)

    @property
    def header(self) -> str:
        return _read("common.metal")

    def build(self):
        return _build(self)


@cache
def _read(file: str) -> str:
    return resources.files("bitnest_mlx.metal_kernels").joinpath(file).read_text()


@cache
def _build(spec: KernelSpec):
    # Built once per process: MLX caches the compiled library by name + source hash.
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        header=spec.header,
    )


@dataclass
class Launch:
    """Everything one kernel call needs; runners turn it into output arrays."""

    spec: KernelSpec
    inputs: list
    template: list[tuple[str, object]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    init_value: float | None = None


Runner = Callable[[Launch], list[mx.array]]


def metal_runner(launch: Launch, verbose: bool = False) -> list[mx.array]:
    return launch.spec.build()(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
        init_value=launch.init_value,
        verbose=verbose,
    )


def run(launch: Launch, runner: Runner | None = None) -> list[mx.array]:
    """`runner(launch)`, or the real kernel when no runner is given."""
    return (runner or metal_runner)(launch)
