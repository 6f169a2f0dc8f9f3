"""Checkpoint -> bitnest package, streamed a layer at a time (`pipeline.build`): fold norms,
rotate (R1/R2), smooth (optional), fuse R4, calibrate through the runtime's forward and quantize
each Linear (joint W4/W8 codes, GPTQ or RTN), writing shard by shard.

The package is written into a hidden sibling of `out` and renamed into place at the end
(`output.atomic_directory`); `out` may never be, or lie inside, the source (`check_output`).
An interrupted conversion keeps that sibling with a record of its finished layers, and the same
conversion run again continues from there (`resume.py`)."""

from __future__ import annotations

import hashlib
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.bitnest import choose_group_size, linear_shapes
from .calib import CALIB_TOKENS, calibration_tokens
from .defaults import DEFAULT_GROUP_SIZE
from .draft_vocab import build_draft_vocab
from .joint import W8_BUDGET
from .methods import Method
from .output import OutputError, atomic_directory, check_output
from .package import fold_norms, smooth_linears
from .pipeline import build, write_package
from .resume import Identity, Partial, ResumeError, open_partial
from .rotation import Rotation
from .smoothing import smoothing_vectors
from .sources import SourceError, load_gguf, load_hf
from .stages import Stages


def _tokenizer(path: Path):
    from mlx_lm.tokenizer_utils import load

    return load(path)


def _settings(method: Method, calib: str | Path | None, **flags) -> dict:
    """{CLI flag: value} of every setting that changes the package (a resumed conversion must
    have them all the same), the converter's version included: another version may choose
    other codes. The method's settings come as its manifest notes have them, so one that does
    not apply to the method (--w8-slack with joint) does not keep a conversion from resuming."""
    names = {"method": "--method", "lo_method": "--lo", "w8_slack": "--w8-slack"}
    names |= {"lambda_draft": "--lambda-draft", "w8_budget": "--w8-budget"}
    settings = {names[key]: value for key, value in method.notes().items()}
    settings["--damp"] = method.damp if method.calibrated else None
    text = Path(calib).read_bytes() if calib else None
    settings["--calib"] = hashlib.sha256(text).hexdigest()[:16] if text else "built-in"
    settings |= {f"--{key.replace('_', '-')}": value for key, value in flags.items()}
    try:
        settings["bitnest-mlx"] = version("bitnest-mlx")
    except PackageNotFoundError:  # run from a source tree
        settings["bitnest-mlx"] = "source"
    return settings


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
    fresh: bool = False,
) -> dict:
    """Convert one checkpoint; returns a summary (also recorded in the manifest's `conversion`).

    `out` must not be the source or lie inside its directory, nor contain an input; an existing
    non-empty `out` is replaced only with `force`, and only once the new package is complete
    (OutputError otherwise, before anything is read). Nothing appears at `out` until the end: an
    exception or KeyboardInterrupt leaves it as it was.

    Finished layers are kept: an exception, KeyboardInterrupt or SystemExit after the first
    layer leaves the hidden sibling with its record (`resume.py`), and a later call with the same
    `out`, source and settings continues after the last finished layer; one with other settings
    or another source is refused (`ResumeError`, an OutputError) unless `fresh`, which deletes
    the partial conversions of `out` and starts over.

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
    identity = Identity.of(
        hf_path or gguf,
        _settings(
            m,
            calib,
            rotate=rotate_kind,
            seed=seed,
            calib_tokens=calib_tokens,
            calib_seq_len=calib_seq_len,
            r3="on" if r3 else "off",
            kv_group=kv_group,
            group_size=group_size or "auto",
            smooth="on" if smooth else "off",
            draft_vocab=draft_vocab,
        ),
    )
    partial = open_partial(out, identity, fresh)
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
            config = source.config
            try:
                group = choose_group_size(
                    {k for _, k in linear_shapes(config).values()}, group_size, DEFAULT_GROUP_SIZE
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
                smoothing = _smoothing(partial, stages, config, tokens, source, rotation, group)
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
                resume=partial,
            )
            source.close()
            mx.clear_cache()  # the build's cached MLX buffers, before the next stage's
            with stages("draft_vocab"):
                draft = build_draft_vocab(tmp, tokens, draft_vocab)
            partial.close(finished=True)  # the record and segments go; the package is complete
    finally:
        partial.close(finished=False)
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
    "ResumeError",
    "atomic_directory",
    "check_output",
    "convert",
    "fold_norms",
    "smooth_linears",
    "write_package",
]
