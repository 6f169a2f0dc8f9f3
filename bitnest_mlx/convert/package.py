"""Float Llama/Qwen2 weights -> a package: norms folded, R4 fused into down_proj, planes chosen.

The writer in formats/ only lays out planes; everything that changes float weights lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..formats.bitnest import (
    ARCHS,
    GROUP_SIZE,
    LAYER_LINEARS,
    PackageError,
    Planes,
    linear_shapes,
    norm_names,
    norm_readers,
    quantize_planes,
    writer,
)
from ..formats.hadamard import hadamard_k, r4_transform, split_k


def _rope_params(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from a config dict: transformers 5 nests both in `rope_parameters`."""
    theta, scaling = config.get("rope_theta"), config.get("rope_scaling")
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return (10000.0 if theta is None else float(theta)), scaling


def fold_norms(weights: Mapping[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Fold every RMSNorm gamma into the Linears that read it (exact); the norms become ones and
    lm_head is untied (it absorbs the final norm)."""
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for norm, linears in (
            ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ):
            gamma = w[f"{p}{norm}.weight"]
            for lin in linears:
                w[f"{p}{lin}.weight"] = w[f"{p}{lin}.weight"] * gamma
            w[f"{p}{norm}.weight"] = np.ones_like(gamma)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    w["lm_head.weight"] = head * w["model.norm.weight"]
    w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
    return w


def smooth_linears(
    weights: Mapping[str, np.ndarray], vectors: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Divide the input columns of the Linears that read each norm by its smoothing vector d
    (`{norm weight name: d}`, norms folded to ones first): with the norm weight d the float
    function is unchanged, W/d · (d·x) = W·x, while the quantizers see d·x and W/d."""
    w = dict(weights)
    for norm, d in vectors.items():
        for lin in norm_readers(norm):
            w[f"{lin}.weight"] = (w[f"{lin}.weight"] / np.asarray(d, np.float32)).astype(np.float32)
    return w


def write_package(
    out_dir: str | Path,
    weights: Mapping[str, np.ndarray],
    config: dict,
    *,
    tokenizer_dir: str | Path | None = None,
    name: str | None = None,
    source_model: str | None = None,
    quantize: Callable[[str, np.ndarray], Planes] | None = None,
    notes: dict | None = None,
    r3: bool = False,
    kv_group: int | None = None,
    smoothing: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """Write float Llama/Qwen2 weights (HF names) as a package: norms folded, R4 fused, RTN.

    `smoothing` ({norm weight name: d [D] > 0}, e.g. `convert.smoothing.smoothing_vectors(...)
    .vectors`) stores d as those norm weights and divides the columns of the Linears reading them
    by d after folding (`smooth_linears`): the package says `norms.smoothing: true` (§2.5).

    `quantize(name, w)` replaces RTN (e.g. GPTQ hi codes via `planes_from_codes`); it is called
    once per Linear in forward order (layer 0 q, k, v, o, gate, up, down, layer 1, ..., lm_head)
    with the weight as stored (norms folded, R4 fused into down_proj). The other keywords go to
    `formats.bitnest.writer.write`.
    """
    arch = config.get("model_type")
    if arch not in ARCHS:
        raise PackageError(f"model_type {arch!r} is not one of {ARCHS}")
    config = dict(config)
    config["rope_theta"], config["rope_scaling"] = _rope_params(config)
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    names = [
        f"model.layers.{i}.{lin}"
        for i in range(config["num_hidden_layers"])
        for lin in LAYER_LINEARS
    ] + ["lm_head"]
    # Checked up front so a bad input fails before any file is written.
    required = [f"{lin}.weight" for lin in names[:-1]] + [
        f"model.layers.{i}.{norm}.weight"
        for i in range(config["num_hidden_layers"])
        for norm in ("input_layernorm", "post_attention_layernorm")
    ]
    required += ["model.embed_tokens.weight", "model.norm.weight"]
    missing = [n for n in required if n not in weights]
    if missing:
        raise PackageError(f"write: missing float weight {missing[0]} (expected HF tensor names)")
    # The reader derives every shape from the config dims: a weight that disagrees would give a
    # package that `read` refuses, so refuse it here, naming the weight.
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    for lin, shape in linear_shapes(config).items():
        wname = head if lin == "lm_head" else f"{lin}.weight"
        got = list(np.shape(weights[wname]))
        if got != list(shape):
            raise PackageError(f"write: {wname} has shape {got}; the config implies {list(shape)}")
        if shape[1] % GROUP_SIZE:
            raise PackageError(
                f"write: {wname} has shape {got}; expected K (the last dim) to be a multiple of "
                f"{GROUP_SIZE}"
            )
    n_inter = config["intermediate_size"]
    try:
        k = split_k(n_inter)
    except ValueError as e:
        raise PackageError(f"write: {e}") from e
    had = hadamard_k(k) if k > 1 else None

    w = fold_norms(weights, config["num_hidden_layers"])
    if smoothing is not None:
        known = set(norm_names(config["num_hidden_layers"]))
        for norm, d in smoothing.items():
            d = np.asarray(d)
            ok = d.shape == (config["hidden_size"],) and np.all(np.isfinite(d) & (d > 0))
            if norm not in known or not ok:  # checked before any file is written
                raise PackageError(
                    f"write: smoothing vector {norm} {list(d.shape)}: expected a norm weight "
                    f"name of this model and [{config['hidden_size']}] finite positive values"
                )
        w = smooth_linears(w, smoothing)
    planes: dict[str, Planes] = {}
    for lin in names:
        wt = w[f"{lin}.weight"]
        if lin.endswith("down_proj"):
            # Rows get x -> T x with T = (hadK ⊗ H)/sqrt(n) orthogonal: W' = W Tᵀ, W' (T a) = W a.
            wt = r4_transform(wt, had)
        planes[lin] = quantize(lin, wt) if quantize is not None else quantize_planes(wt)
    return writer.write(
        out_dir,
        config,
        planes,
        biases={lin: w[f"{lin}.bias"] for lin in names if f"{lin}.bias" in w},
        embed=w["model.embed_tokens.weight"],
        had_k=had,
        tokenizer_dir=tokenizer_dir,
        name=name,
        source_model=source_model,
        notes=notes,
        r3=r3,
        kv_group=kv_group,
        norms=None if smoothing is None else dict(smoothing),
    )
