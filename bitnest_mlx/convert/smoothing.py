"""Per-channel smoothing of the RMSNorm outputs (docs/bitnest-package.md §2.5), AWQ style.

For each norm a vector d > 0 in the (rotated) basis of the weights is stored as the norm weight,
and the Linears that read the norm get their input columns divided by d: in float nothing
changes, W/d · (d·x) = W·x, but the quantizers see d·x (A8) and W/d (W4/W8). AWQ's choice is
d = 1/s with s_j = mean|x_j|^α (x the norm's output on calibration text): α > 0 shrinks the
activation's large channels (A8 gets a finer per-token step) and scales up the weight columns
they multiply, whose rounding error the large inputs would amplify. α is searched per norm on a
small grid; α = 0 (d = 1) stays unless another α lowers the joint output error
λ_d·e4/e4(0) + λ_t·e8/e8(0) of the Linears reading the norm, where
eN = ||A8(x·d)·RTN_N(W/d)ᵀ - x·Wᵀ||² / ||x·Wᵀ||² over (a sample of) the calibration rows.

The search runs the float model through the runtime's forward (`calibrate.Calibration`, A8 off)
layer by layer, reading each layer from the source as the converter does; `measure` reports the
choice for a checkpoint without writing one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.bitnest import a8, choose_group_size, dequantize_planes, quantize_planes
from ..formats.bitnest.writer import PackageWriter
from ..formats.hadamard import hadamard_k, split_k
from .calib import CALIB_TOKENS
from .calibrate import Calibration
from .defaults import DEFAULT_GROUP_SIZE
from .package import LAYER_NORMS, stored_embedding, stored_head, stored_layer
from .rotation import Rotation
from .sources import Source

DEFAULT_ALPHAS = (0.0, 0.25, 0.5)


@dataclass
class Smoothing:
    """The search's result: `vectors` for `write_package(smoothing=...)` (only norms with
    α ≠ 0; empty when smoothing does not help anywhere), and per norm the chosen α and the
    relative squared output errors before (α = 0) and after, for the draft (W4) and target (W8).
    """

    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def notes(self) -> dict:
        """JSON-able record for the manifest's `conversion.smoothing`."""
        per_norm = {
            name: {"alpha": self.alphas[name], **{k: float(f"{v:.4e}") for k, v in e.items()}}
            for name, e in self.errors.items()
        }
        return {**self.settings, "per_norm": per_norm}

    def table(self) -> str:
        """One line per norm: α, W4 and W8 relative output error at α = 0 and chosen, and the
        error summed over all norms' Linears (the draft's and target's totals)."""
        lines = [
            f"{'norm':48s} {'alpha':>5s} {'W4 err0':>9s} {'W4 err':>9s} {'W8 err0':>9s} "
            f"{'W8 err':>9s}"
        ]
        for name, e in self.errors.items():
            lines.append(
                f"{name:48s} {self.alphas[name]:5.2f} {e['w4_err0']:9.3e} {e['w4_err']:9.3e} "
                f"{e['w8_err0']:9.3e} {e['w8_err']:9.3e}"
            )
        for plane in ("w4", "w8"):
            before = sum(e[f"{plane}_err0"] for e in self.errors.values())
            after = sum(e[f"{plane}_err"] for e in self.errors.values())
            change = 100 * (after / before - 1) if before else 0.0
            lines.append(
                f"sum of {plane.upper()} relative errors: {before:.4e} -> {after:.4e} "
                f"({change:+.1f} %)"
            )
        return "\n".join(lines)


def norm_inputs(
    source, config: dict, tokens: np.ndarray, rotation: Rotation | None = None
) -> Iterator[tuple[str, np.ndarray, dict[str, np.ndarray]]]:
    """(norm weight name, the weightless RMSNorm's output [n_tokens, D], {Linear name: its
    weight as stored}) for every norm in forward order (final norm last), from the float model's
    forward over `tokens` [n_seq, seq_len]. `source` is a `sources.Source` or a
    `Source.from_arrays`; layers are read, folded and rotated one at a time."""
    config = source.config  # completed by the source
    available = set(source.names())
    k = split_k(config["intermediate_size"])
    had = hadamard_k(k) if k > 1 else None
    spec = PackageWriter.spec_for(
        config,
        biased={n.removesuffix(".bias") for n in available if n.endswith(".bias")},
        had_k=had,
        group_size=choose_group_size(
            [config["hidden_size"], config["intermediate_size"]], None, DEFAULT_GROUP_SIZE
        ),
    )
    embed = mx.array(stored_embedding(source, rotation))
    calib = Calibration(spec, embed, tokens, had)
    del embed
    readers = {"self_attn.q_proj": "input_layernorm", "mlp.gate_proj": "post_attention_layernorm"}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w = stored_layer(source, i, rotation, None, had)
        xs = calib.float_advance(i, w, capture=tuple(readers))
        for lin, norm in readers.items():
            linears = {f"{p}{r}": w[f"{r}.weight"] for r in LAYER_NORMS[norm]}
            yield f"{p}{norm}.weight", xs[lin], linears
    yield "model.norm.weight", calib.normed(), {"lm_head": stored_head(source, rotation, None)}


def output_errors(
    x: np.ndarray, linears: Sequence[np.ndarray], d: np.ndarray, group_size: int
) -> tuple:
    """(e4, e8): ||A8(x·d)·Q(W/d)ᵀ - x·Wᵀ||² / ||x·Wᵀ||² summed over `linears` (the weights
    [N, D] reading x [n, D]), Q = the writer's RTN planes read as W4 and as W8."""
    x = x.astype(np.float64)
    x8 = a8(x * d)
    err, ref = np.zeros(2), 0.0
    for w in linears:
        y = x @ w.T.astype(np.float64)
        ref += float(np.sum(y * y))
        p = quantize_planes((w / d).astype(np.float32), group_size)
        for j, draft in enumerate((True, False)):
            diff = x8 @ dequantize_planes(p.hi, p.lo, p.scales, draft=draft).T - y
            err[j] += float(np.sum(diff * diff))
    return err[0] / ref, err[1] / ref


def smoothing_vector(x: np.ndarray, alpha: float) -> np.ndarray:
    """d_j = mean|x_j|^-α over the rows of x (AWQ's 1/s), normalized to geometric mean 1 (the
    quantizers are scale-free; this keeps d·x near x's range for the float16 runtime)."""
    m = np.mean(np.abs(x), axis=0, dtype=np.float64)
    m = np.maximum(m, 1e-6 * max(m.max(), 1e-30))  # a dead channel must not give d = 0
    log_d = -alpha * (np.log(m) - np.mean(np.log(m)))
    return np.exp(log_d).astype(np.float32)


def smoothing_vectors(
    weights: Mapping[str, np.ndarray] | None,
    config: dict,
    tokens: np.ndarray,
    *,
    source=None,
    rotation: Rotation | None = None,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    lambda_draft: float = 0.5,
    lambda_target: float = 0.5,
    min_gain: float = 0.01,
    max_rows: int = 1024,
    max_out: int = 2048,
    seed: int = 0,
    group_size: int | None = None,
    progress=None,
) -> Smoothing:
    """Choose α per norm (module docstring) for the weights as they will be stored (HF names,
    rotated; gammas folded or not) from a float forward over `tokens` [n_seq, seq_len]; or, with
    `weights` None, for a `source` read a layer at a time and rotated by `rotation`.

    An α ≠ 0 must cut the joint error by `min_gain` (1 %), else the norm stays unsmoothed: a
    vector that only fits the sample is not worth storing. The error is measured on `max_rows`
    sampled token rows and `max_out` sampled output rows per Linear (RTN planes are per row, so
    that is exact for those rows). Only in-layer norms may make a package smoothed: a reader
    without the extension refuses their non-unit weights, but would silently ignore a smoothed
    final norm alone (§2.3), so then the final norm is left unsmoothed too."""
    grid = sorted({0.0, *(float(a) for a in alphas)})
    candidates = [a for a in grid if a != 0.0]
    rng = np.random.default_rng(seed)
    d_model = config["hidden_size"]
    group = choose_group_size(
        [d_model, config["intermediate_size"]], group_size, DEFAULT_GROUP_SIZE
    )
    weighting = (lambda_draft, lambda_target, min_gain)
    result = Smoothing(settings=_search_settings(grid, weighting, int(np.size(tokens)), max_rows))
    rows = None
    if weights is not None:
        source = Source.from_arrays(weights, config)
    for norm, x, stored in norm_inputs(source, config, tokens, rotation):
        if rows is None:
            rows = np.sort(rng.choice(len(x), min(max_rows, len(x)), replace=False))
        linears = _sampled_rows(stored, rng, max_out)
        del stored
        alpha, base, e, d = _best_alpha(x, x[rows], linears, candidates, group, weighting)
        result.alphas[norm] = alpha
        result.errors[norm] = {
            "w4_err0": base[0],
            "w4_err": e[0],
            "w8_err0": base[1],
            "w8_err": e[1],
        }
        if d is not None:
            result.vectors[norm] = d
        if progress is not None:
            progress(norm)
    if set(result.vectors) == {"model.norm.weight"}:
        _drop_final_norm(result)
    return result


def _search_settings(
    grid: list[float], weighting: tuple[float, float, float], n_tokens: int, max_rows: int
) -> dict:
    """The search's settings as the manifest records them."""
    lambda_draft, lambda_target, min_gain = weighting
    return {
        "alphas": grid,
        "lambda_draft": lambda_draft,
        "lambda_target": lambda_target,
        "min_gain": min_gain,
        "calibration_tokens": n_tokens,
        "rows": min(max_rows, n_tokens),
    }


def _sampled_rows(stored: Mapping[str, np.ndarray], rng, max_out: int) -> list[np.ndarray]:
    """`max_out` sampled output rows of each Linear (all of them where it has fewer), float32."""
    linears = []
    for w in stored.values():
        keep = np.sort(rng.choice(len(w), min(max_out, len(w)), replace=False))
        linears.append(np.asarray(w[keep], np.float32))
    return linears


def _best_alpha(
    x: np.ndarray,
    xs: np.ndarray,
    linears: list[np.ndarray],
    candidates: Sequence[float],
    group: int,
    weighting: tuple[float, float, float],
) -> tuple[float, tuple, tuple, np.ndarray | None]:
    """(α, errors at α = 0, errors at α, d or None for α = 0) of one norm, the Linears reading
    its output `x` measured on the rows `xs`; `weighting` is (λ_draft, λ_target, min_gain)."""
    lambda_draft, lambda_target, min_gain = weighting
    base = output_errors(xs, linears, np.ones(x.shape[-1], np.float32), group)
    # J(0) = λ_d + λ_t; another α must beat it by min_gain.
    best = ((1 - min_gain) * (lambda_draft + lambda_target), 0.0, base, None)
    for alpha in candidates:
        d = smoothing_vector(x, alpha)
        e = output_errors(xs, linears, d, group)
        score = lambda_draft * e[0] / base[0] + lambda_target * e[1] / base[1]
        if score < best[0]:
            best = (score, alpha, e, d)
    _, alpha, e, d = best
    return alpha, base, e, d


def _drop_final_norm(result: Smoothing) -> None:
    """The final norm alone smoothed: a reader without the extension would ignore it (§2.3),
    so it is left unsmoothed and the result says so."""
    result.vectors.clear()
    result.alphas["model.norm.weight"] = 0.0
    e = result.errors["model.norm.weight"]
    e.update(w4_err=e["w4_err0"], w8_err=e["w8_err0"])
    result.settings["final_norm_alone_dropped"] = True


def measure(
    hf_path: str | Path | None = None,
    *,
    gguf: str | Path | None = None,
    calib: str | Path | None = None,
    calib_tokens: int = CALIB_TOKENS,
    calib_seq_len: int = 256,
    rotate_kind: str = "hadamard",
    seed: int = 0,
    **search: float,
) -> Smoothing:
    """The smoothing `convert(..., smooth=True)` would choose for an HF checkpoint or a GGUF file
    (folded, rotated as the converter does), printed as a table; nothing is written. `search`
    goes to `smoothing_vectors` (alphas, lambda_draft, lambda_target, max_rows, max_out)."""
    import tempfile

    from .sources import load_gguf, load_hf

    if (hf_path is None) == (gguf is None):
        raise ValueError("give exactly one of hf_path or gguf")
    if gguf is not None:
        with tempfile.TemporaryDirectory() as scratch:
            source = load_gguf(gguf, Path(scratch))
            return _measure(source, calib, calib_tokens, calib_seq_len, rotate_kind, seed, search)
    return _measure(load_hf(hf_path), calib, calib_tokens, calib_seq_len, rotate_kind, seed, search)


def _measure(source, calib, calib_tokens, calib_seq_len, rotate_kind, seed, search) -> Smoothing:
    """`measure` on a loaded source (its tokenizer files must still exist)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from .calib import calibration_tokens

    config = source.config
    rotation = None if rotate_kind == "none" else Rotation(config, rotate_kind, seed)
    tokens = calibration_tokens(
        load_tokenizer(Path(source.tokenizer_dir)), calib, calib_tokens, calib_seq_len
    )
    result = smoothing_vectors(None, config, tokens, source=source, rotation=rotation, **search)
    print(result.table())
    return result
