"""Checkpoint -> bitnest package, streamed a layer at a time (`pipeline.build`): fold norms,
rotate (R1/R2), smooth (optional), fuse R4, calibrate through the runtime's forward and quantize
each Linear (joint W4/W8 codes, GPTQ or RTN), writing shard by shard.

The package is written into a hidden sibling of `out` and renamed into place at the end
(`output.atomic_directory`); `out` may never be, or lie inside, the source (`check_output`)."""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.bitnest import choose_group_size, linear_shapes
from .calib import CALIB_TOKENS, calibration_tokens
from .defaults import GROUP_SIZE
from .draft_vocab import build_draft_vocab
from .joint import W8_BUDGET
from .methods import Method
from .output import OutputError, atomic_directory, check_output
from .package import fold_norms, smooth_linears
from .pipeline import build, write_package
from .rotation import Rotation
from .smoothing import smoothing_vectors
from .sources import SourceError, load_gguf, load_hf
from .stages import Stages


def _tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


def convert(
    *,
    out: str | Path,
    hf_path: str | Path | None = None,
    gguf: str | Path | None = None,
    calib: str | Path | None = None,
    method: str = "joint",
    rotate_kind: str = "hadamard",
    seed: int = 0,
    calib_tokens: int = CALIB_TOKENS,
    calib_seq_len: int = 256,
    damp: float = 0.01,
    lo_method: str = "gptq",
    w8_slack: float | None = 3.0,
    lambda_draft: float | None = None,
    w8_budget: float = W8_BUDGET,
    r3: bool = True,
    kv_group: int = 32,
    smooth: bool = False,
    group_size: int | None = None,
    draft_vocab: int | str = "auto",
    scratch: Path,
    force: bool = False,
) -> dict:
    """Convert one checkpoint; returns a summary (also recorded in the manifest's `conversion`).

    `out` must not be the source or lie inside its directory, nor contain an input; an existing
    non-empty `out` is replaced only with `force`, and only once the new package is complete
    (OutputError otherwise, before anything is read). Nothing appears at `out` until the end: an
    exception or KeyboardInterrupt leaves it as it was, with no temporary folder beside it.

    `smooth` searches per-norm smoothing vectors on the calibration text (`smoothing.py`) and
    stores those that lower the joint W4/W8 output error (manifest `norms.smoothing`).
    `draft_vocab`: the draft's reduced vocabulary (`draft_vocab.py`): "auto" (K by the bytes
    model), a K, or "full" (none).
    """
    if (hf_path is None) == (gguf is None):
        raise ValueError("give exactly one of hf_path or gguf")
    m = Method(method, damp, lo_method, w8_slack, lambda_draft, w8_budget)
    check_output(
        out,
        source=hf_path or gguf,
        source_is_dir=hf_path is not None,
        inputs=[calib] if calib else [],
        replace=force,
    )
    stages = Stages()
    try:
        with atomic_directory(out, replace=force) as tmp:
            with stages("read"):
                source = load_hf(hf_path) if hf_path else load_gguf(gguf, scratch / "tokenizer")
            config = source.config
            try:
                group = choose_group_size(
                    {k for _, k in linear_shapes(config).values()}, group_size, GROUP_SIZE
                )
            except ValueError as e:
                raise SourceError(f"{hf_path or gguf}: {e}") from e
            rotation = None if rotate_kind == "none" else Rotation(config, rotate_kind, seed)
            tokens = None
            if smooth or m.calibrated or draft_vocab != "full":
                tokens = calibration_tokens(
                    _tokenizer(source.tokenizer_dir), calib, calib_tokens, calib_seq_len
                )
                widest = max(config["hidden_size"], config["intermediate_size"])
                if m.calibrated and tokens.size < widest:  # rtn + smooth: no Hessian
                    warnings.warn(
                        f"{tokens.size} calibration tokens are fewer than the widest Linear "
                        f"input ({widest}): its Hessian is singular and only damping keeps GPTQ "
                        f"stable; give --calib-tokens above {widest}",
                        stacklevel=2,
                    )
            smoothing = None
            if smooth:
                with stages("calibrate"):
                    smoothing = smoothing_vectors(
                        None, config, tokens, source=source, rotation=rotation, group_size=group
                    )
            vectors = (smoothing.vectors or None) if smoothing is not None else None
            summary = {
                "source": source.name,
                "group_size": group,
                **m.notes(),
                "rotation": rotate_kind,
                "seed": seed,
                "r3": r3,
                "kv_group": kv_group,
                "smoothed_norms": len(smoothing.vectors) if smoothing is not None else 0,
                "calibration_tokens": int(tokens.size) if tokens is not None else 0,
            }
            per_linear: dict[str, dict] = {}
            build(
                tmp,
                source,
                method=m,
                rotation=rotation,
                tokens=tokens if m.calibrated else None,
                smoothing=vectors,
                group_size=group,
                name=source.name,
                source_model=source.name,
                notes=lambda: {
                    **summary,
                    **({"smoothing": smoothing.notes()} if smoothing is not None else {}),
                    "per_linear": per_linear,
                    # Up to here: the checksum pass over the shards is not in it.
                    "resources": stages.report(),
                },
                r3=r3,
                kv_group=kv_group,
                stages=stages,
                progress=True,
                per_linear=per_linear,
            )
            source.close()
            mx.clear_cache()  # the build's cached MLX buffers, before the next stage's
            with stages("draft_vocab"):
                draft = build_draft_vocab(tmp, tokens, draft_vocab)
    finally:
        stages.close()
    layers = [s for n, s in per_linear.items() if n != "lm_head"]
    return {
        **summary,
        "out": str(out),
        "draft_vocab": draft["vocab_size"],
        "mean_w4_rel_fro_err": round(float(np.mean([s["w4_rel_fro_err"] for s in layers])), 5),
        "mean_saturation": round(float(np.mean([s["saturation"] for s in layers])), 6),
        "max_w8_max_rel_err": max(s["w8_max_rel_err"] for s in layers),
        **{
            f"mean_{key}": round(float(np.mean([s[key] for s in layers])), 4)
            for key in ("w4_hessian_err_vs_rtn", "w8_hessian_err_vs_rtn")
            if key in layers[0]
        },
        "lm_head": per_linear["lm_head"],
        **stages.report(),
    }


__all__ = [
    "OutputError",
    "atomic_directory",
    "check_output",
    "convert",
    "fold_norms",
    "smooth_linears",
    "write_package",
]
