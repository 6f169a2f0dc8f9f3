"""Which path serves a call: the kernel after its first-use self-test passed, else pure MLX.

Layers ask `use(name, self_test)` before routing to a kernel, after their own `RunOptions`
allowed kernels (`BITNEST_MLX_KERNELS` is read into those when a model is loaded, not here); it is
true only on Metal and after the layer's self-test (its kernel against its own pure path, passed
in by the layer: this package knows no layer) passed. On a mismatch it warns once and the pure
path is used for the rest of the process.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import mlx.core as mx

from .launch import Runner


@dataclass
class _State:
    status: dict[str, str] = field(default_factory=dict)  # name -> "ok" | "failed: ..."
    calls: Counter = field(default_factory=Counter)  # (name, "kernel" | "pure") -> count


_state = _State()


@cache
def _metal() -> bool:
    # A fact of the machine, so one answer per process is right (a switch would not be).
    return mx.metal.is_available()


SelfTest = Callable[[Runner | None], tuple[mx.array, mx.array]]


def use(name: str, self_test: SelfTest) -> bool:
    """Should the layer route to kernel `name`? At first use runs `self_test` (from the layer:
    kernel output via the runner it is given vs the layer's pure path) and remembers the verdict."""
    if not _metal():
        return False
    if name not in _state.status:
        _state.status[name] = check(self_test)
        if _state.status[name] != "ok":
            warnings.warn(
                f"bitnest_mlx: Metal kernel {name!r} failed its self-test "
                f"({_state.status[name]}); using the pure-MLX path",
                RuntimeWarning,
                stacklevel=3,
            )
    return _state.status[name] == "ok"


def record(name: str, path: str) -> None:
    """Count which path served a call (for `bitnest_mlx.bench`); cheap, host-side only."""
    _state.calls[(name, path)] += 1


def report() -> dict:
    """{kernel: {"status": ..., "kernel": calls, "pure": calls}} for the kernels seen so far."""
    names = sorted({n for n, _ in _state.calls} | set(_state.status))
    return {
        n: {
            "status": _state.status.get(n, "not tested" if _metal() else "no Metal"),
            "kernel": _state.calls[(n, "kernel")],
            "pure": _state.calls[(n, "pure")],
        }
        for n in names
    }


def check(self_test: SelfTest, runner: Runner | None = None) -> str:
    """Run a layer's kernel-vs-pure comparison; "ok" or the reason for falling back."""
    try:
        got, want = self_test(runner)
        mx.eval(got, want)
        err = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item()
        tol = 1e-3 * max(1.0, mx.abs(want.astype(mx.float32)).max().item())
        return "ok" if err <= tol else f"max error {err:.3g} > {tol:.3g}"
    except Exception as e:  # a compile error on some Metal version must not break generation
        return f"{type(e).__name__}: {e}"
