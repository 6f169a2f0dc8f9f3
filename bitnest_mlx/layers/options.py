"""How one forward pass of a bitnest model runs: which planes, which quantizations, which path."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

MODES = ("draft", "target")
DRAFT_KV = (4, 8)  # the KV planes a draft call reads: KV4 (hi plane) or KV8 (both)


@dataclass(frozen=True)
class RunOptions:
    """Passed down a bitnest model's forward (and fixed in a cache when it is created).

    mode: "draft" reads the hi planes (W4) and KV4; "target" reads both (W8) and KV8.
    quantize_activations / quantize_kv: A8 and the nested KV quantization; off only for parity
    checks against float models (quantize_kv is fixed per cache, at `make_cache`).
    dense_min_rows: inputs with at least this many rows use a dense matmul on the dequantized
    planes (0 = never). MLX's CPU quantized matmul has no blocked GEMM, so long teacher-forced
    passes (perplexity) are much faster dense; the quantized matmul stays the default because it
    gives bit-identical rows whatever the batch, which exact cache rollback relies on.
    use_kernels: allow the Metal kernels (they still run only on Metal, after their self-test).
    A model loaded while `BITNEST_MLX_KERNELS=0` gets False here (`at_load`); options passed to
    one call are used as given.
    draft_kv: the KV a draft call reads, 4 (the hi plane, default) or 8 (both planes, as the
    target). The cache stores both planes either way; only the read differs, so the target's
    verification, and with it the exactness of speculative output, does not depend on it.
    draft_vocab: a draft call scores only the package's reduced draft vocabulary when it has one
    (§2.9, -inf elsewhere); False scores every row of the W4 lm_head (the W4 model itself, e.g.
    for its perplexity, which a reduced vocabulary leaves undefined).
    draft_join: a `draft_vocab.DraftVocabJoin` (or None): the ids of one generation's context
    that the reduced draft vocabulary also scores. It lives in the options because they are
    what one generation passes down its calls; it holds that generation's state (it grows as the
    text does), so only the generation that made it refers to it and the model keeps no switch.
    draft_skip: the layers a draft call skips (their residual passes through unchanged): a
    shallower, cheaper draft. Their caches advance without a write; the verify pass, which runs
    every layer, writes those positions, so the target's output does not depend on it.
    qat: DeepSeek-V4's QAT simulation (FP8 KV, Hadamard + FP4 indexer scores), as the reference
    model runs when trained; bitnest models have no such pass and ignore it. Both families take
    the same options so that a face or the loader never asks which family it holds.

    A model with one precision (DeepSeek-V4) has one reading: it takes the options (kernels,
    QAT) and reads its one set of weights whatever the mode.
    """

    mode: str = "target"
    quantize_activations: bool = True
    quantize_kv: bool = True
    dense_min_rows: int = 0
    use_kernels: bool = True
    draft_kv: int = 4
    draft_vocab: bool = True
    draft_join: Any = None  # DraftVocabJoin; typed loosely: that module imports this one
    qat: bool = False
    draft_skip: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.draft_kv not in DRAFT_KV:
            raise ValueError(f"draft_kv must be one of {DRAFT_KV}, got {self.draft_kv!r}")

    @property
    def draft(self) -> bool:
        return self.mode == "draft"

    @property
    def reads_kv4(self) -> bool:
        """Whether attention reads KV4 (the hi plane only): a draft call with draft_kv == 4."""
        return self.draft and self.draft_kv == 4


KERNELS_ENV = "BITNEST_MLX_KERNELS"  # "0": models loaded while it is set take the pure path


def kernels_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment allows the Metal kernels (anything but `BITNEST_MLX_KERNELS=0`)."""
    return (os.environ if environ is None else environ).get(KERNELS_ENV, "1") != "0"


def at_load(options: RunOptions, environ: Mapping[str, str] | None = None) -> RunOptions:
    """`options` as a model being loaded now keeps them: the environment's kernel switch is read
    here, once per load, so a process can load one model with kernels and one without (and a
    test can flip it) instead of the first read deciding for the whole process."""
    if options.use_kernels and not kernels_allowed(environ):
        return replace(options, use_kernels=False)
    return options
