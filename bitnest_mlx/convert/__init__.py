"""Checkpoint -> bitnest package: fold norms, rotate (R1/R2), then `write_package` fuses R4 and
quantizes each Linear with GPTQ (hi plane) or RTN, with the RTN residual as the lo plane.

The package is written into a hidden sibling of `out` and renamed into place at the end
(`output.atomic_directory`); `out` may never be, or lie inside, the source (`check_output`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..formats.bitnest import Planes, planes_from_codes
from ..formats.hadamard import hadamard_k, split_k
from .calib import CALIB_TOKENS, calibration_tokens
from .gptq import SequentialGPTQ
from .joint import W8_BUDGET
from .output import OutputError, atomic_directory, check_output
from .package import fold_norms, smooth_linears, write_package
from .rotation import rotate
from .smoothing import smoothing_vectors
from .sources import load_gguf, load_hf


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
    """
    if (hf_path is None) == (gguf is None):
        raise ValueError("give exactly one of hf_path or gguf")
    check_output(
        out,
        source=hf_path or gguf,
        source_is_dir=hf_path is not None,
        inputs=[calib] if calib else [],
        replace=force,
    )
    with atomic_directory(out, replace=force) as tmp:
        source = load_hf(hf_path) if hf_path else load_gguf(gguf, scratch / "tokenizer")
        config = source.config
        n_layers = config["num_hidden_layers"]
        weights = rotate(fold_norms(source.weights, n_layers), config, rotate_kind, seed)
        del source.weights  # the folded copy is all that is needed; halves peak memory
        tokens = None
        if smooth or method != "rtn":
            tokens = calibration_tokens(
                _tokenizer(source.tokenizer_dir), calib, calib_tokens, calib_seq_len
            )
            widest = max(config["hidden_size"], config["intermediate_size"])
            if method != "rtn" and tokens.size < widest:  # rtn + smooth: no Hessian
                warnings.warn(
                    f"{tokens.size} calibration tokens are fewer than the widest Linear input "
                    f"({widest}): its Hessian is singular and only damping keeps GPTQ stable; "
                    f"give --calib-tokens above {widest}",
                    stacklevel=2,
                )
        smoothing = smoothing_vectors(weights, config, tokens) if smooth else None
        vectors = (smoothing.vectors or None) if smoothing is not None else None

        bar = tqdm(total=n_layers + 1, desc=f"{method} {source.name}", unit="layer")
        k = split_k(config["intermediate_size"])
        if method in ("joint", "gptq"):
            # Calibrated on what the package runs: the norms' d·x into the Linears' W/d.
            quantize = SequentialGPTQ(
                smooth_linears(weights, vectors) if vectors else weights,
                config,
                tokens,
                hadamard_k(k) if k > 1 else None,
                damp,
                progress=lambda _: bar.update(),
                lo_method=lo_method,
                w8_slack=w8_slack,
                method=method,
                lambda_draft=lambda_draft,
                w8_budget=w8_budget,
                norms=vectors,
            )
        elif method == "rtn":
            quantize = lambda name, w: planes_from_codes(w)
        else:
            raise ValueError(f"unknown method {method!r}; expected joint, gptq or rtn")

        stats: dict[str, dict] = {}

        def recording(name: str, w: np.ndarray) -> Planes:
            planes = quantize(name, w)
            stats[name] = {
                **{
                    k: round(v, 4) for k, v in getattr(quantize, "errors", {}).get(name, {}).items()
                },
                "saturation": round(planes.saturation, 6),
                "w8_max_rel_err": float(f"{planes.w8_max_rel_err:.3e}"),
                "w4_rel_fro_err": round(planes.w4_rel_fro_err, 5),
            }
            if "w4_hessian_err_vs_rtn" in stats[name]:
                e = stats[name]
                bar.write(
                    f"{name}: output error vs RTN: W4 {e['w4_hessian_err_vs_rtn']:.3f}x, "
                    f"W8 {e['w8_hessian_err_vs_rtn']:.3f}x"
                    + (f" (lambda {e['lambda_draft']:.3g})" if "lambda_draft" in e else ""),
                    file=sys.stderr,
                )
            if (method == "rtn" and name.endswith("down_proj")) or name == "lm_head":
                bar.update()
            return planes

        summary = {
            "source": str(hf_path or gguf),
            "method": method,
            "lo_method": {"gptq": lo_method, "rtn": "rtn"}.get(method, "joint"),
            "w8_slack": w8_slack if method == "gptq" else None,
            "lambda_draft": (lambda_draft or "auto") if method == "joint" else None,
            "w8_budget": w8_budget if method == "joint" and lambda_draft is None else None,
            "rotation": rotate_kind,
            "seed": seed,
            "r4_k": k,
            "r3": r3,
            "kv_group": kv_group,
            "smoothed_norms": len(smoothing.vectors) if smoothing is not None else 0,
            "calibration_tokens": int(tokens.size) if tokens is not None else 0,
        }
        write_package(
            tmp,
            weights,
            config,
            quantize=recording,
            tokenizer_dir=source.tokenizer_dir,
            name=source.name,
            source_model=str(hf_path or gguf),
            notes={
                **summary,
                **({"smoothing": smoothing.notes()} if smoothing is not None else {}),
                "per_linear": stats,
            },
            r3=r3,
            kv_group=kv_group,
            smoothing=vectors,
        )
        bar.close()
        layers = [s for n, s in stats.items() if n != "lm_head"]
        return {
            **summary,
            "out": str(out),
            "mean_w4_rel_fro_err": round(float(np.mean([s["w4_rel_fro_err"] for s in layers])), 5),
            "mean_saturation": round(float(np.mean([s["saturation"] for s in layers])), 6),
            "max_w8_max_rel_err": max(s["w8_max_rel_err"] for s in layers),
            **{
                f"mean_{key}": round(float(np.mean([s[key] for s in layers])), 4)
                for key in ("w4_hessian_err_vs_rtn", "w8_hessian_err_vs_rtn")
                if key in layers[0]
            },
            "lm_head": stats["lm_head"],
        }


__all__ = [
    "OutputError",
    "atomic_directory",
    "check_output",
    "convert",
    "fold_norms",
    "write_package",
]
