"""Checkpoint -> bitnest package, streamed a layer at a time (`pipeline.build`): fold norms,
rotate (R1/R2), smooth (optional), fuse R4, calibrate through the runtime's forward and quantize
each Linear (joint W4/W8 codes, GPTQ or RTN), writing shard by shard.

The package is written into a hidden sibling of `out` and renamed into place at the end
(`output.atomic_directory`); `out` may never be, or lie inside, the source (`check_output`).
An interrupted conversion keeps that sibling with a record of its finished layers, and the same
conversion run again continues from there (`resume.py`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.bitnest import choose_group_size, linear_shapes
from .calib import calibration_tokens
from .defaults import DEFAULT_GROUP_SIZE
from .draft_vocab import build_draft_vocab
from .methods import Method
from .output import OutputError, atomic_directory, check_output
from .package import fold_norms, smooth_linears
from .pipeline import Built, build, write_package
from .resume import Identity, Partial, ResumeError, open_partial
from .rotation import Rotation
from .settings import BuildSettings, ConvertSettings
from .smoothing import smoothing_vectors
from .sources import SourceError, load_gguf, load_hf
from .stages import Stages

DEFAULTS = ConvertSettings()  # the CLI's defaults


def _tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


def convert(
    *,
    out: str | Path,
    hf_path: str | Path | None = None,
    gguf: str | Path | None = None,
    settings: ConvertSettings = DEFAULTS,
    scratch: Path,
    force: bool = False,
    fresh: bool = False,
) -> dict:
    """Convert one checkpoint (`hf_path` or `gguf`) as `settings` say; returns a summary (also
    recorded in the manifest's `conversion`).

    `out` must not be the source or lie inside its directory, nor contain an input; an existing
    non-empty `out` is replaced only with `force`, and only once the new package is complete
    (OutputError otherwise, before anything is read). Nothing appears at `out` until the end: an
    exception or KeyboardInterrupt leaves it as it was.

    Finished layers are kept: an exception, KeyboardInterrupt or SystemExit after the first
    layer leaves the hidden sibling with its record (`resume.py`), and a later call with the same
    `out`, source and settings continues after the last finished layer; one with other settings
    or another source is refused (`ResumeError`, an OutputError) unless `fresh`, which deletes
    the partial conversions of `out` and starts over.
    """
    if (hf_path is None) == (gguf is None):
        raise ValueError("give exactly one of hf_path or gguf")
    method = settings.code_method()
    calib = settings.calib
    check_output(
        out,
        source=hf_path or gguf,
        source_is_dir=hf_path is not None,
        inputs=[calib] if calib else [],
        replace=force,
    )
    partial = open_partial(out, Identity.of(hf_path or gguf, settings.flags()), fresh)
    stages = Stages()
    try:
        with atomic_directory(out, replace=force, into=partial.path, keep=partial.keep) as tmp:
            partial.attach(tmp)
            if partial.layers_done:
                print(
                    f"[convert] resuming {tmp}: {partial.layers_done} layers were finished",
                    file=sys.stderr,
                )
            with stages("read"):
                source = load_hf(hf_path) if hf_path else load_gguf(gguf, scratch / "tokenizer")
            plan, summary, tokens = _plan(
                source, hf_path or gguf, settings, method, partial, stages
            )
            built = build(tmp, source, plan, stages=stages, progress=True, resume=partial)
            source.close()
            mx.clear_cache()  # the build's cached MLX buffers, before the next stage's
            with stages("draft_vocab"):
                draft = build_draft_vocab(tmp, tokens, settings.draft_vocab)
            partial.close(finished=True)  # the record and segments go; the package is complete
    finally:
        partial.close(finished=False)
        stages.close()
    return _summary(out, summary, built, draft, stages)


def _plan(
    source,
    where: str | Path,
    settings: ConvertSettings,
    method: Method,
    partial: Partial,
    stages: Stages,
) -> tuple[BuildSettings, dict, np.ndarray | None]:
    """What `build` writes the source (read from `where`) with, the summary so far (the
    manifest's notes but the smoothing search's), and the calibration tokens (None where
    nothing calibrates)."""
    config = source.config
    try:
        group = choose_group_size(
            {k for _, k in linear_shapes(config).values()}, settings.group_size, DEFAULT_GROUP_SIZE
        )
    except ValueError as e:
        raise SourceError(f"{where}: {e}") from e
    kind = settings.rotate_kind
    rotation = None if kind == "none" else Rotation(config, kind, settings.seed)
    tokens = _tokens(source, settings, method)
    smoothing = None
    if settings.smooth:
        smoothing = _smoothing(partial, stages, config, tokens, source, rotation, group)
    summary = {
        "source": source.name,
        "group_size": group,
        **method.notes(),
        "rotation": kind,
        "seed": settings.seed,
        "r3": settings.r3,
        "kv_group": settings.kv_group,
        "smoothed_norms": len(smoothing.vectors) if smoothing is not None else 0,
        "calibration_tokens": int(tokens.size) if tokens is not None else 0,
    }
    plan = BuildSettings(
        method=method,
        rotation=rotation,
        tokens=tokens if method.calibrated else None,
        smoothing=(smoothing.vectors or None) if smoothing is not None else None,
        group_size=group,
        name=source.name,
        source_model=source.name,
        notes={**summary, **({"smoothing": smoothing.notes()} if smoothing is not None else {})},
        diagnostics=True,
        r3=settings.r3,
        kv_group=settings.kv_group,
    )
    return plan, summary, tokens


def _tokens(source, settings: ConvertSettings, method: Method) -> np.ndarray | None:
    """The calibration text's tokens, where anything uses them: the method, the smoothing
    search or the draft vocabulary's count."""
    if not (settings.smooth or method.calibrated or settings.draft_vocab != "full"):
        return None
    tokenizer = _tokenizer(source.tokenizer_dir)
    tokens = calibration_tokens(
        tokenizer, settings.calib, settings.calib_tokens, settings.calib_seq_len
    )
    widest = max(source.config["hidden_size"], source.config["intermediate_size"])
    if method.calibrated and tokens.size < widest:  # rtn + smooth: no Hessian
        warnings.warn(
            f"{tokens.size} calibration tokens are fewer than the widest Linear "
            f"input ({widest}): its Hessian is singular and only damping keeps GPTQ "
            f"stable; give --calib-tokens above {widest}",
            stacklevel=4,  # convert's caller (convert -> _plan -> _tokens)
        )
    return tokens


def _smoothing(partial: Partial, stages: Stages, config, tokens, source, rotation, group):
    """The --smooth search's result: the one a resumed conversion kept, else searched and
    kept."""
    found = partial.smoothing()
    if found is None:
        with stages("calibrate"):
            found = smoothing_vectors(
                None, config, tokens, source=source, rotation=rotation, group_size=group
            )
        partial.save_smoothing(found)
    return found


def _summary(out: str | Path, summary: dict, built: Built, draft: dict, stages: Stages) -> dict:
    """convert's summary: `_plan`'s, the mean diagnostics of the decoder layers' Linears,
    lm_head's, and the stages' resources."""
    per_linear = built.per_linear
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
    "ConvertSettings",
    "OutputError",
    "ResumeError",
    "atomic_directory",
    "check_output",
    "convert",
    "fold_norms",
    "smooth_linears",
    "write_package",
]
