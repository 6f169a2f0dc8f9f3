"""The kernels a decode pass launches, as the runtime prices them, and the timed round costs the
controller plans with on the chip it runs on.

Counting a model's kernels (`measurement/dispatches.py`, `bench --dispatches`) builds and walks
its graph: about 20 s for the demo and 17 min at 3B dims on a 2-core CPU, and the runtime
cannot import measurement. So a run plans with the counts stored here: kernels per layer and
outside the layers of each pass, by path, as the counter gave them on the demo's structure,
times the model's layers. Measurement's reports count the model itself instead
(`measurement/step_costs.py`); both build their costs with `timed_cost`.

What this leaves out: a package of another structure (Qwen2's biases and rotated k bias, a
reduced draft vocabulary's gathers) launches a few kernels more or less than the demo's; the
counter reports them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .chips import chip_peak
from .loader import uses_kernels
from .speed_model import DEFAULT_CHIP, CostModel, step_cost_model
from .step_time import constants
from .token_bytes import kv_bytes, weight_bytes


@dataclass(frozen=True)
class PassKernels:
    """Kernels of one pass: per layer and outside the layers (embedding, final norm, head,
    sampling)."""

    per_layer: float
    outside: float

    def per_token(self, layers: int) -> float:
        return self.per_layer * layers + self.outside


@dataclass(frozen=True)
class PathKernels:
    """What one path launches: a draft step, a target step, target passes of several rows as
    counted (rows, kernels; `CostModel.verify_kernels`), and the host syncs of a speculative
    round."""

    draft: PassKernels
    target: PassKernels
    verify: tuple[tuple[int, PassKernels], ...] = ()
    round_syncs: float = 1.0


# Counted by `python -m bitnest_mlx.bench --dispatches` (float16, the GPU basis, per layer = the
# model at 2 layers minus at 1) on the demo's structure (Llama, R3 and R4, no biases, the full
# draft vocabulary), 2026-12-07: the kernel path 18 a layer for a draft step, 20 for a target
# step or a 2-row pass, 24 from 3 rows (each projection's input quantized by its own launch);
# the pure path 41 (draft) and 51 (target and verify); one host sync a round (its acceptance
# read). tests/test_dispatches.py checks this table against the counter: a cut to the kernels
# updates it.
STORED = {
    "kernel": PathKernels(
        draft=PassKernels(18, 15),
        target=PassKernels(20, 15),
        verify=((2, PassKernels(20, 15)), (4, PassKernels(24, 16)), (8, PassKernels(24, 16))),
    ),
    "pure": PathKernels(
        draft=PassKernels(41, 18),
        target=PassKernels(51, 20),
        verify=((2, PassKernels(51, 20)), (4, PassKernels(51, 20)), (8, PassKernels(51, 20))),
    ),
}
# A DeepSeek-V4 bundle's target step, counted the same way on the demo bundle (per layer = 6
# layers minus 3, over 3: its hash and learned-gate layers differ), same day; no draft plane.
# tests/test_dispatches.py checks it against the counter.
STORED_DSV4 = {"kernel": PassKernels(118 / 3, 19), "pure": PassKernels(343 / 3, 19)}
# DeepSeek-V4-Flash, the bundle its verify cost (`speed_model.DSV4_FLASH`) is measured for: 43
# layers; a token reads 7.766 GB of dense weights, head and embedding row and 2.760 GB of routed
# experts (6 a layer at the q3.4 bit plan), the figures beside DSV4_FLASH.
FLASH_LAYERS = 43
FLASH_TOKEN_BYTES = 7.766e9 + 2.760e9


def run_chip() -> str:
    """The chip this process runs on ("Apple M3 Max" ...), or the projections' default off
    Metal and on a chip the tables do not know."""
    peak = chip_peak()
    return DEFAULT_CHIP if peak is None else peak[0]


def run_path(model: nn.Module) -> str:
    """The path `model`'s calls take here: the kernels where it may use them on Metal (their
    self-tests decide at first use), else pure MLX."""
    return "kernel" if uses_kernels(model) and mx.metal.is_available() else "pure"


def timed_cost(
    target_bytes: float,
    draft_bytes: float,
    kernels: PathKernels,
    layers: int,
    chip: str,
    path: str,
    kv_fraction: float = 0.0,
) -> CostModel:
    """A step-time CostModel from bytes per token and the kernels of `layers` layers."""
    return step_cost_model(
        target_bytes,
        draft_bytes,
        kernels.target.per_token(layers),
        kernels.draft.per_token(layers),
        chip,
        path,
        kv_fraction,
        round_syncs=kernels.round_syncs,
        constants=constants(chip),
        verify_kernels=[(m, k.per_token(layers)) for m, k in kernels.verify],
    )


def run_cost(model: nn.Module, context: int, draft_kv: int = 4) -> CostModel:
    """The fixed costs a seeded run plans with: this chip, the path the model runs, its weight
    and KV bytes per token at `context` tokens (the draft reading KV `draft_kv`), the stored
    kernels of that path."""
    path = run_path(model)
    weights, kv = weight_bytes(model), kv_bytes(model.args)
    target = weights["target"] + kv[8] * context
    draft = weights["draft"] + kv[draft_kv] * context
    layers = model.args.num_hidden_layers
    fraction = kv[8] * context / weights["target"]
    return timed_cost(target, draft, STORED[path], layers, run_chip(), path, fraction)
