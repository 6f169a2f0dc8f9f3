"""bitnest-doctor's kernel checks: every launch this runtime makes, run on this machine against
the layers' pure path (did it compile, did it match), then replayed at a decode-sized shape and
timed (GB/s beside the chip's bandwidth).

The runner is a parameter: the Metal kernels on a Mac, the CPU emulator in tests (and with
`bitnest-doctor --emulator` on Linux). Self-test shapes are the layers' own (a few KB, ragged
edges); only the timed replay is large, and it runs on Metal only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from .. import kernels
from ..layers.dsv4_hc import after_self_test, before_self_test
from ..layers.dsv4_route import route_self_test
from ..layers.dual_plane import grouped_self_test, matmul_self_test
from ..layers.hadamard import head_hadamard_self_test
from ..layers.mxtq_linear import gather_self_test, hadamard_self_test, swiglu_self_test
from ..layers.nested_kv import attention_self_test, write_self_test

Pair = tuple[mx.array, mx.array]  # (kernel output, pure-path output)


@dataclass(frozen=True)
class Check:
    """One kernel use: `run(runner, big)` -> (kernel, pure); `big` picks the timed shape."""

    name: str
    run: Callable[[kernels.Runner, bool], Pair]


def _layer(self_test: Callable[..., Pair], **kwargs) -> Callable[[kernels.Runner, bool], Pair]:
    """The layer's own self-test (one definition for the first use and the doctor); `big`
    there is the timed shape."""
    return lambda runner, big: self_test(runner, big=big, **kwargs)


CHECKS = (
    *(
        Check(f"dual-plane A8 qmv, group {g}", _layer(matmul_self_test, group_size=g, seed=g))
        for g in (32, 64, 128)
    ),
    Check("dual-plane grouped q/k/v (one launch)", _layer(grouped_self_test)),
    Check("dual-plane gate/up + SiLU·up epilogue", _layer(grouped_self_test, gate_up=True)),
    Check(
        "nested-KV attention KV4, L=1 (+ merge)", _layer(attention_self_test, draft=True, rows=1)
    ),
    Check("nested-KV attention KV8, L=4 (+ merge)", _layer(attention_self_test, rows=4)),
    Check("KV write: K and V to both nested planes", _layer(write_self_test)),
    Check("R3 of q and k (head Hadamard)", _layer(head_hadamard_self_test)),
    Check("Hadamard rotation d=4096 and 2048", _layer(hadamard_self_test)),
    *(Check(f"MXTQ gather {b}-bit", _layer(gather_self_test, widths=(b,))) for b in (2, 4)),
    *(
        Check(f"MXTQ gate+up+SwiGLU {b}-bit (fused)", _layer(swiglu_self_test, widths=(b,)))
        for b in (2, 4)
    ),
    Check("DeepSeek-V4 hyper-connection pre (gates, Sinkhorn, norm)", _layer(before_self_test)),
    Check("DeepSeek-V4 hyper-connection post", _layer(after_self_test)),
    Check("DeepSeek-V4 MoE routing (top-k and hash)", _layer(route_self_test)),
)


class Recorder:
    """A runner that keeps every launch, evaluates each at once (so a compile error is pinned
    on its kernel) and notes which kernels compiled."""

    def __init__(self, runner: kernels.Runner):
        self.runner = runner
        self.launches: list[kernels.Launch] = []
        self.compiled: dict[str, str] = {}

    def __call__(self, launch: kernels.Launch) -> list[mx.array]:
        self.launches.append(launch)
        try:
            outputs = self.runner(launch)
            mx.eval(outputs)
        except Exception as e:
            self.compiled[launch.spec.name] = f"{type(e).__name__}: {e}".splitlines()[0]
            raise
        self.compiled.setdefault(launch.spec.name, "yes")
        return outputs


def streamed_bytes(launches: list[kernels.Launch]) -> int:
    """Bytes the launches read (every input once) and write."""
    read = sum(getattr(a, "nbytes", 0) for launch in launches for a in launch.inputs)
    written = sum(
        math.prod(shape) * dtype.size
        for launch in launches
        for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)
    )
    return read + written


def replay_gbps(launches: list[kernels.Launch], runner: kernels.Runner, repeats: int) -> float:
    """GB/s of `repeats` replays of the launches (inputs already evaluated; one warm-up)."""
    mx.eval([a for launch in launches for a in launch.inputs if isinstance(a, mx.array)])
    mx.eval([runner(launch) for launch in launches])
    tic = time.perf_counter()
    outputs = [runner(launch) for _ in range(repeats) for launch in launches]
    mx.eval(outputs)
    seconds = time.perf_counter() - tic
    return streamed_bytes(launches) * repeats / seconds / 1e9


def run_checks(
    runner: kernels.Runner,
    repeats: int,
    big: bool,
    peak_gbs: float | None,
    checks: tuple[Check, ...] = CHECKS,
) -> dict:
    """{"checks": [...], "compiled": {kernel: "yes" | error | "not launched"}} (docs/doctor.md
    "What a healthy report looks like" has the fields)."""
    compiled: dict[str, str] = {}
    rows = []
    for check in checks:
        rec = Recorder(runner)
        status = kernels.check(lambda r, c=check: c.run(r, False), rec)
        compiled.update(rec.compiled)
        row = {
            "name": check.name,
            "kernels": sorted({launch.spec.name for launch in rec.launches}),
            "compiled": bool(rec.launches) and all(v == "yes" for v in rec.compiled.values()),
            "self_test": "passed" if status == "ok" else f"failed: {status}",
            "gbps": None,
            "peak_fraction": None,
        }
        if status == "ok" and repeats > 0:
            timed = Recorder(runner)
            check.run(timed, big)  # the pure reference stays lazy: never computed
            row["gbps"] = replay_gbps(timed.launches, runner, repeats)
            if peak_gbs:
                row["peak_fraction"] = row["gbps"] / peak_gbs
        rows.append(row)
    every = {spec.name: compiled.get(spec.name, "not launched") for spec in kernels.SPECS}
    return {"checks": rows, "compiled": every}
