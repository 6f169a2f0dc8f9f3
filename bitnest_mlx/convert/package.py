"""Float Llama/Qwen2 weights -> what a package stores, a layer at a time: norms folded, rotated,
smoothed, R4 fused into down_proj. The writer in formats/ only lays out planes; everything that
changes float weights lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..formats.bitnest import LAYER_LINEARS, Planes, norm_readers
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
    group_size: int | None = None,
) -> Path:
    """Write float Llama/Qwen2 weights (HF names) as a package: norms folded, R4 fused, RTN
    (no rotation, no calibration; `convert.convert` does those), through the converter's own
    streaming pipeline.

    `smoothing` ({norm weight name: d [D] > 0}) stores d as those norm weights and divides the
    columns of the Linears reading them by d after folding (`smooth_linears`): the package says
    `norms.smoothing: true` (§2.5). `quantize(name, w)` replaces RTN (e.g. GPTQ hi codes via
    `planes_from_codes`); it is called once per Linear in forward order (layer 0 q, k, v, o,
    gate, up, down, layer 1, ..., lm_head) with the weight as stored (norms folded, R4 fused).
    """
    from .pipeline import build
    from .sources import Source

    tok = Path(tokenizer_dir) if tokenizer_dir is not None else None
    source = Source.from_arrays(weights, config, tok, name or Path(out_dir).name)
    return build(
        out_dir,
        source,
        quantize=quantize,
        name=name,
        source_model=source_model,
        notes=notes,
        r3=r3,
        kv_group=kv_group,
        smoothing=smoothing,
        group_size=group_size,
    )
