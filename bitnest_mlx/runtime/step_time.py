"""What a decode step costs in seconds on an Apple GPU: its bytes, its kernels and its host syncs.

    step time = bytes / (f · bandwidth) + kernels · t_k + syncs · t_sync

* bytes: what the step reads (weights, and the KV cache at its context), streamed at a
  fraction f of the chip's peak bandwidth (`chips.PEAK_GBS`);
* kernels: what the step launches, counted on the GPU basis (`measurement/dispatches.py`), each
  costing t_k beyond its bytes while the GPU is kept fed (the host builds and encodes the next
  step while this one runs: mlx-lm's `mx.async_eval` pipelining);
* syncs: host reads the GPU must drain for (the acceptance read of a speculative round), each
  leaving the GPU idle for t_sync. A read of work already launched with the next step queued
  behind it (pipelined decoding) costs nothing here.

A verify pass of M rows reads the bytes of v(M) steps (`speed_model.verify_cost`) but launches
the same kernels and syncs as one step: v(M) scales the bytes term only (`step_seconds`).

f and t_k are fitted on the M4 Max (`measurement/step_fit.py`, docs/step-time.md); other chips
carry them over and only their bandwidth differs (`provenance` says which). `bitnest-doctor`
measures t_k and t_sync on the user's Mac; `constants(chip, t_kernel=..., t_sync=...)` takes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chips import gpu

FITTED_CHIP = "M4 Max"
# Fitted by `python -m bitnest_mlx.measurement.step_fit` (least squares on relative error) to the
# seven Qwen3-4B-Instruct-2507 rows of mlx-lm's BENCHMARKS.md (64 GB M4 Max, mlx
# 0.29.2.dev20251008, mlx-lm 0.28.2, `mlx_lm.benchmark -p 2048 -g 128`: bf16 52.47 ... q4
# 134.52 tok/s), weight and KV bytes from the model's config, 729 kernels a token (726 in bf16)
# counted on mlx-lm's qwen3 by `dispatches.count_mlx_lm_qwen3`. Residuals -0.8 % to +1.1 %.
# tests/test_step_time.py refits and checks these.
F_BANDWIDTH = 0.903
T_KERNEL_S = 3.20e-6
# One host sync: mlx PR #1773 (M3 Max) measured a CPU/GPU synchronization through Metal shared
# events, MLX's default, at 0.137-0.150 ms per iteration (15-20 us with the opt-in
# MLX_METAL_FAST_SYNCH fence); mlx issue #4438 (M3 Ultra, mlx 0.32.2) measured about 180 us per
# CPU<->GPU crossing with the default fence. Both time a round trip between the two, not a
# decode loop's read, so read this as an assumed order of magnitude, not a fit. It leaves out
# the host's graph building after the read, which a sync also exposes.
T_SYNC_S = 150e-6
# The chip a published figure checks the carried-over constants on (docs/step-time.md).
CHECKED = {
    "M3 Pro": "mlx-lm PR #1569: Qwen3-4B-Instruct-2507 4-bit, 44.62 tok/s (held out of the fit)"
}


@dataclass(frozen=True)
class StepConstants:
    """A chip's step-time constants: peak bandwidth (GB/s), the fraction f of it a step's bytes
    stream at, seconds per kernel and per host sync."""

    chip: str
    bandwidth_gbs: float
    f: float
    t_kernel: float
    t_sync: float

    def bytes_seconds(self, nbytes: float) -> float:
        return nbytes / (self.f * self.bandwidth_gbs * 1e9)


def constants(
    chip: str = FITTED_CHIP,
    f: float | None = None,
    t_kernel: float | None = None,
    t_sync: float | None = None,
) -> StepConstants:
    """`chip`'s constants ("M4 Max", "Apple M3 Pro", ...): its peak bandwidth, and f, t_k and
    t_sync as fitted or assumed unless given (a doctor's measurements on that Mac)."""
    c = gpu(chip)
    return StepConstants(
        chip=c.name,
        bandwidth_gbs=c.bandwidth_gbs,
        f=F_BANDWIDTH if f is None else f,
        t_kernel=T_KERNEL_S if t_kernel is None else t_kernel,
        t_sync=T_SYNC_S if t_sync is None else t_sync,
    )


def provenance(chip: str) -> str:
    """Where `chip`'s f and t_k come from: fitted there, checked there, or carried over."""
    name = gpu(chip).name
    if name == FITTED_CHIP:
        return "fitted (mlx-lm BENCHMARKS.md, Qwen3-4B-Instruct-2507, seven precisions)"
    if name in CHECKED:
        return f"f and t_k carried over from {FITTED_CHIP}; checked: {CHECKED[name]}"
    return f"assumed: f and t_k carried over from {FITTED_CHIP}, no published figure checks them"


@dataclass(frozen=True)
class Step:
    """One forward pass before it is timed: bytes it reads at one row, kernels it launches,
    host syncs it waits on."""

    nbytes: float
    kernels: float
    syncs: float = 0.0


def _constants(chip: str | StepConstants) -> StepConstants:
    return chip if isinstance(chip, StepConstants) else constants(chip)


def step_seconds(step: Step, chip: str | StepConstants = FITTED_CHIP, verify: float = 1.0) -> float:
    """Seconds of `step` on `chip`; `verify` = v(M) for a pass of M rows, which scales the bytes
    only: M rows launch the kernels of one."""
    c = _constants(chip)
    return c.bytes_seconds(step.nbytes) * verify + step.kernels * c.t_kernel + step.syncs * c.t_sync


def tokens_per_second(step: Step, chip: str | StepConstants = FITTED_CHIP) -> float:
    """Decode speed of one token a step."""
    return 1.0 / step_seconds(step, chip)


def breakdown(step: Step, chip: str | StepConstants = FITTED_CHIP) -> dict[str, float]:
    """Milliseconds of each term and tok/s: what a report prints beside its projection."""
    c = _constants(chip)
    terms = {
        "bytes_ms": c.bytes_seconds(step.nbytes) * 1e3,
        "kernels_ms": step.kernels * c.t_kernel * 1e3,
        "syncs_ms": step.syncs * c.t_sync * 1e3,
    }
    return {**terms, "tokens_per_second": 1e3 / sum(terms.values())}
