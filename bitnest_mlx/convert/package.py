"""Float Llama/Qwen2 weights -> what a package stores, a layer at a time: norms folded, rotated,
smoothed, R4 fused into down_proj. The writer in formats/ only lays out planes; everything that
changes float weights lives here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..formats.bitnest import LAYER_LINEARS, norm_readers
from ..formats.hadamard import r4_transform
from .rotation import Rotation

# The norm each layer's Linears read, and the Linears that read it.
LAYER_NORMS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def layer_names(i: int) -> list[str]:
    """The float tensors layer i must have (HF names)."""
    p = f"model.layers.{i}."
    return [f"{p}{lin}.weight" for lin in LAYER_LINEARS] + [
        f"{p}{norm}.weight" for norm in LAYER_NORMS
    ]


def fold_layer(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One layer (names relative to it) with each RMSNorm gamma multiplied into the Linears
    that read it (exact); the norm weights are dropped: the package's norms are weightless."""
    w = dict(w)
    for norm, linears in LAYER_NORMS.items():
        gamma = w.pop(f"{norm}.weight")
        for lin in linears:
            w[f"{lin}.weight"] = w[f"{lin}.weight"] * gamma
    return w


def fold_norms(weights: Mapping[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """Fold every RMSNorm gamma into the Linears that read it (exact); the norms become ones and
    lm_head is untied (it absorbs the final norm)."""
    w = {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        layer = fold_layer({k.removeprefix(p): v for k, v in w.items() if k.startswith(p)})
        w.update({p + k: v for k, v in layer.items()})
        for norm in LAYER_NORMS:
            w[f"{p}{norm}.weight"] = np.ones_like(w[f"{p}{norm}.weight"])
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
            if f"{lin}.weight" in w:
                w[f"{lin}.weight"] = (w[f"{lin}.weight"] / np.asarray(d, np.float32)).astype(
                    np.float32
                )
    return w


def stored_layer(
    source,
    i: int,
    rotation: Rotation | None,
    smoothing: Mapping[str, np.ndarray] | None,
    had_k: np.ndarray | None,
) -> dict[str, np.ndarray]:
    """Layer i's float weights as the package stores them before quantization, names relative
    to the layer ("self_attn.q_proj.weight", biases too): folded, rotated, smoothed, R4 fused."""
    p = f"model.layers.{i}."
    available = set(source.names())
    names = layer_names(i) + [
        f"{p}{lin}.bias" for lin in LAYER_LINEARS if f"{p}{lin}.bias" in available
    ]
    w = fold_layer({n.removeprefix(p): source.tensor(n) for n in names})
    if rotation is not None:
        w = rotation.layer(w, i)
    if smoothing:
        full = smooth_linears({p + k: v for k, v in w.items()}, smoothing)
        w = {k.removeprefix(p): v for k, v in full.items()}
    # Rows get x -> T x with T = (hadK ⊗ H)/sqrt(n) orthogonal: W' = W Tᵀ, W' (T a) = W a.
    w["mlp.down_proj.weight"] = r4_transform(w["mlp.down_proj.weight"], had_k)
    return w


def stored_embedding(source, rotation: Rotation | None) -> np.ndarray:
    """The embedding [V, D] float32 as stored (rotated; the package rounds it to bf16)."""
    e = source.tensor("model.embed_tokens.weight")
    return e if rotation is None else rotation.rows(e, inplace=True)


def stored_head(
    source, rotation: Rotation | None, smoothing: Mapping[str, np.ndarray] | None
) -> np.ndarray:
    """lm_head [V, D] float32 as stored before quantization: the source's (or the tied
    embedding), the final norm's gamma folded in, rotated, divided by the final norm's
    smoothing vector when it has one."""
    name = "lm_head.weight" if "lm_head.weight" in source.names() else "model.embed_tokens.weight"
    head = source.tensor(name)
    head *= source.tensor("model.norm.weight")
    if rotation is not None:
        head = rotation.rows(head, inplace=True)
    d = (smoothing or {}).get("model.norm.weight")
    if d is not None:
        head /= np.asarray(d, np.float32)
    return head
