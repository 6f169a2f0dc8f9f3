"""RoPE settings of a checkpoint: an HF config's (theta, scaling) whichever way transformers
stored them, and the scaling a GGUF encodes in metadata or in llama.cpp's `rope_freqs` tensor."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

# What llama.cpp's converter assumes when a config has no original_max_position_embeddings at
# its top level, which Llama 3.x configs never have: their scaling says 8192 too.
LLAMA3_CONTEXT = 8192


def rope_params(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) of an HF config. transformers 5 keeps both only in `rope_parameters`
    ({"rope_theta": ..., "rope_type": "llama3", "factor": ...}); older configs use `rope_theta`
    and `rope_scaling`. The scaling keeps its HF keys with `rope_type` set (older files say
    `type`, which is dropped); default RoPE is None."""
    theta, scaling = config.get("rope_theta"), config.get("rope_scaling")
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        rest = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
        scaling = None if kind == "default" else {"rope_type": kind, **rest}
    else:
        scaling = None
    return (10000.0 if theta is None else float(theta)), scaling


def _periods(theta: float, head_dim: int) -> np.ndarray:
    """theta^(2i/d): what mlx-lm's RoPE divides positions by, before any scaling."""
    return theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def _short(x: float) -> float:
    """6 significant digits: 4.0 rather than 3.9999998 (the result is checked afterwards)."""
    return float(f"{x:.6g}")


def llama3_scaling(
    divisors: np.ndarray,
    theta: float,
    head_dim: int,
    max_positions: int,
    factor: float | None = None,
    context: int | None = None,
) -> dict | None:
    """The llama3 rope_scaling whose per-frequency divisors llama.cpp wrote as `rope_freqs`.

    Its converter writes 1 for short wavelengths (< context / high_freq_factor), `factor` for
    long ones (> context / low_freq_factor), and 1 / ((1 - s) / factor + s) between, where
    s = (context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor). `factor`
    is the largest divisor unless given. The divisors fix only context / low_freq_factor and
    context / high_freq_factor, so `context` (GGUF metadata when present) defaults to
    LLAMA3_CONTEXT and the two factors follow from a line fit of s against 1 / wavelength.
    Raises ValueError unless mlx-lm's RoPE with the result has the tensor's frequencies.
    """
    from mlx_lm.models.rope_utils import initialize_rope

    r = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if r.size != head_dim // 2:
        raise ValueError(f"rope_freqs.weight has {r.size} values, expected head_dim / 2")
    if np.all(r == 1):
        return None
    factor = float(factor or r.max())
    context = int(context or LLAMA3_CONTEXT)
    wavelengths = 2 * math.pi * _periods(theta, head_dim)
    medium = (r > 1 + 1e-6) & (r < factor * (1 - 1e-6))
    if medium.sum() >= 2 and factor > 1:
        s = (1 / r - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[medium], s[medium], 1)
        span = context / slope  # high_freq_factor - low_freq_factor
        low, high = -intercept * span, -intercept * span + span
    else:  # too few points to fit: mlx-lm's defaults, accepted only if they reproduce r
        low, high = 1.0, 4.0
    scaling = {
        "rope_type": "llama3",
        "factor": _short(factor),
        "low_freq_factor": _short(low),
        "high_freq_factor": _short(high),
        "original_max_position_embeddings": context,
    }
    rope = initialize_rope(head_dim, theta, False, scaling, max_positions)
    got = np.array(rope._freqs, dtype=np.float64)
    want = _periods(theta, head_dim) * r
    error = float(np.max(np.abs(got - want) / want))
    if not error < 1e-5:  # float32 powers of theta agree to ~1e-7
        raise ValueError(
            f"rope_freqs.weight is not a llama3 RoPE scaling: the closest ({scaling}) "
            f"differs by {error:.2g} (relative)"
        )
    return scaling


def gguf_rope_scaling(
    meta: Callable[[str], object],
    divisors: np.ndarray | None,
    theta: float,
    head_dim: int,
    max_positions: int,
) -> dict | None:
    """A GGUF's rope_scaling: `meta(key)` reads `{arch}.rope.scaling.{key}` (None if absent),
    `divisors` is its rope_freqs tensor if it has one. Raises ValueError for other kinds."""
    kind = meta("type")
    if divisors is not None and kind in (None, "none"):
        return llama3_scaling(
            divisors,
            theta,
            head_dim,
            max_positions,
            meta("factor"),
            meta("original_context_length"),
        )
    if divisors is None and kind in (None, "none"):
        return None
    if divisors is None and kind == "linear":
        return {"rope_type": "linear", "factor": float(meta("factor"))}
    raise ValueError(
        f"RoPE scaling {kind!r}{' with rope_freqs.weight' if divisors is not None else ''} is "
        "not supported (none, linear, or llama3 through rope_freqs.weight)"
    )
