"""Models with one set of weights (DeepSeek-V4 bundles) in the speculative loop: n-gram drafts.

`speculative.speculative_generate_step` calls a model as `model(x, cache, mode, options=...)`
(both families take that call) and drafts with its W4 plane. A model with
`supports_draft = False` has no draft plane: only copies from the context (`prompt_lookup`) can
draft for it, and a round is a copy or a target-only step. `adapt` is the one bridge: it
refuses draft calls and makes caches that roll back a whole copy; everything else (the plan,
the accept rules, `commit`'s rollback) is the loop's own.

Its round costs are fixed, not timed: a draftless run never drafts with a model, so the timed
controller would only ever see 1-row and copy-length passes, and a MoE's verify cost is the
expert union of `speed_model.DSV4_FLASH`, which the timing of a few rounds would not reveal.
They are priced by step time (bytes, kernels, the round's sync) on the chip this runs on.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..layers.options import RunOptions
from .speed_model import DSV4_FLASH, CostModel, step_cost_model
from .step_kernels import FLASH_LAYERS, FLASH_TOKEN_BYTES, STORED_DSV4, run_chip, run_path
from .step_time import constants


class NoDraftError(ValueError):
    """A draft from the model was asked of a model that has no draft plane."""


def draft_source_for(source: str, name: str = "this model") -> str:
    """The controller's source for a model without a draft plane: "model" is refused, "auto"
    is copies or target-only steps (the "ngram" controller, which falls back by itself)."""
    if source == "model":
        raise NoDraftError(
            f"{name} has no draft plane (one set of weights, e.g. a DeepSeek-V4 bundle): use "
            "--draft-source ngram or auto (n-gram copies from the context), or none"
        )
    return "ngram" if source == "auto" else source


def bundle_cost(path: str = "pure", chip: str | None = None) -> CostModel:
    """Round costs of a DeepSeek-V4 bundle at `chip` (default: the one this runs on): no draft
    calls; a target step of Flash's bytes and layers with the demo bundle's kernels a layer on
    `path` (`step_kernels.STORED_DSV4`) and one host sync a round; verify passes at the expert
    union of Flash's routing on the pure path's v(M) (its dense layers are MLX affine
    matmuls)."""
    chip = chip or run_chip()
    kernels = STORED_DSV4[path].per_token(FLASH_LAYERS)
    return step_cost_model(
        FLASH_TOKEN_BYTES,
        0.0,
        kernels,
        0.0,
        chip,
        "pure",
        constants=constants(chip),
        experts=DSV4_FLASH,
    )


class TargetOnly:
    """A draftless model in the speculative loop: "target" calls only (its options passed on),
    caches that roll back `max_rollback` tokens."""

    supports_draft = False

    def __init__(self, model: nn.Module, max_rollback: int):
        self.model, self.max_rollback = model, max_rollback
        self.args = model.args

    @property
    def options(self) -> RunOptions:
        """The model's own call defaults (as loaded: `BITNEST_MLX_KERNELS` included)."""
        return self.model.options

    def __call__(
        self, x: mx.array, cache: list, mode: str = "target", options: RunOptions | None = None
    ) -> mx.array:
        if mode != "target":
            raise NoDraftError(f"a model without a draft plane has no {mode!r} reading")
        if options is None:  # the model's own defaults; any (inputs, cache) callable serves
            return self.model(x, cache)
        return self.model(x, cache, options=options)

    def make_cache(self, options: RunOptions | None = None) -> list:
        return self.model.make_cache(max_rollback=self.max_rollback)


def adapt(
    model: nn.Module,
    source: str,
    ngram_tokens: int,
    cost: CostModel | None,
    prompt_cache: list | None,
) -> tuple[TargetOnly, str, CostModel]:
    """(the model under the loop's convention, the controller's source, the round costs).

    A round verifies at most `ngram_tokens` copies and `commit` rolls the rejected ones back,
    so every cache must keep that many tokens of history (`DSV4Cache.max_rollback`)."""
    source = draft_source_for(source)
    for c in prompt_cache or []:
        kept = getattr(c, "max_rollback", ngram_tokens)
        if kept < ngram_tokens:
            raise ValueError(
                f"the prompt cache rolls back at most {kept} tokens but an n-gram draft may "
                f"hold ngram_tokens={ngram_tokens}: make it with "
                f"make_cache(max_rollback={ngram_tokens}) or lower ngram_tokens"
            )
    return TargetOnly(model, ngram_tokens), source, cost or bundle_cost(run_path(model))


__all__ = ["NoDraftError", "TargetOnly", "adapt", "bundle_cost", "draft_source_for"]
