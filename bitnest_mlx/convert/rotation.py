"""QuaRot/SpinQuant transformations fused offline into float weights (HF names, [out, in] layout).

The residual stream becomes h' = R1 h. Weightless RMSNorm commutes with an orthogonal R1, so
every Linear reading the stream absorbs R1ᵀ on its input side and every Linear writing it absorbs
R1 on its output side. R2 rotates each value head: v' = R2 v, and o_proj absorbs R2ᵀ per head. R4
is fused later by the package writer. Embedding mean-centering (QuaRot) is exact only before a
LayerNorm; these models use RMSNorm, so it is not applied.
"""

from __future__ import annotations

import numpy as np

from ..formats.hadamard import hadamard_k, split_k

ROTATIONS = ("hadamard", "random", "none")


def orthogonal(n: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """A seeded n×n orthogonal matrix: random-sign normalized Hadamard, or Haar-random via QR."""
    if kind == "hadamard":
        return _hadamard(n) * rng.choice([-1.0, 1.0], size=n)
    if kind == "random":
        q, r = np.linalg.qr(rng.standard_normal((n, n)))
        return q * np.sign(np.diag(r))
    raise ValueError(f"unknown rotation {kind!r}; expected one of {ROTATIONS}")


def _hadamard(n: int) -> np.ndarray:
    k = split_k(n)
    return np.kron(hadamard_k(k), hadamard_k(n // k)) / np.sqrt(n)


class Rotation:
    """R1 and the per-layer R2s of one conversion, drawn in a fixed order from `seed` (R1, then
    R2 of layer 0, 1, ...), applied a layer (or a row block of the embedding) at a time."""

    def __init__(self, config: dict, kind: str = "hadamard", seed: int = 0):
        rng = np.random.default_rng(seed)
        d, hd = config["hidden_size"], config["head_dim"]
        self.n_kv, self.n_heads, self.d, self.hd = (
            config["num_key_value_heads"],
            config["num_attention_heads"],
            d,
            hd,
        )
        self.r1 = orthogonal(d, kind, rng)
        self.r2 = [orthogonal(hd, kind, rng) for _ in range(config["num_hidden_layers"])]

    def rows(self, w: np.ndarray, block: int = 8192, inplace: bool = False) -> np.ndarray:
        """W R1ᵀ for a matrix whose columns live in the residual stream (embedding, lm_head),
        a block of rows at a time; `inplace` overwrites w (float32) instead of allocating a
        second [V, D] copy."""
        out = w if inplace and w.dtype == np.float32 else np.empty(w.shape, dtype=np.float32)
        for r in range(0, len(w), block):
            out[r : r + block] = _mm(w[r : r + block], self.r1.T)
        return out

    def layer(self, w: dict[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
        """One layer's norm-folded float weights (names relative to the layer, e.g.
        "self_attn.q_proj.weight") rotated: inputs by R1ᵀ, outputs by R1, v heads by R2."""
        d, hd, r2 = self.d, self.hd, self.r2[i]
        w = dict(w)
        for lin in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            w[f"{lin}.weight"] = _mm(w[f"{lin}.weight"], self.r1.T)
        for lin in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"{lin}.weight"] = _mm(self.r1, w[f"{lin}.weight"])
        v = w["self_attn.v_proj.weight"].reshape(self.n_kv, hd, d)
        w["self_attn.v_proj.weight"] = _mm(r2, v).reshape(self.n_kv * hd, d)
        if "self_attn.v_proj.bias" in w:
            b = w["self_attn.v_proj.bias"].reshape(self.n_kv, hd)
            w["self_attn.v_proj.bias"] = _mm(b, r2.T).reshape(-1)
        o = w["self_attn.o_proj.weight"].reshape(d, self.n_heads, hd)
        w["self_attn.o_proj.weight"] = _mm(o, r2.T).reshape(d, self.n_heads * hd)
        return w


def _mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # float32 like the weights it rotates, which are quantized to 8 bits next; float64 products
    # cost 2.5x the time at the mission's sizes (docs/convert.md, "Bounds").
    return np.asarray(a, np.float32) @ np.asarray(b, np.float32)


def rotate(
    weights: dict[str, np.ndarray], config: dict, kind: str = "hadamard", seed: int = 0
) -> dict[str, np.ndarray]:
    """Apply R1 (hidden) and R2 (per value head) to a whole model's norm-folded float weights
    (HF names): `Rotation` over every layer."""
    if kind == "none":
        return weights
    rot = Rotation(config, kind, seed)
    w = dict(weights)
    w["model.embed_tokens.weight"] = rot.rows(w["model.embed_tokens.weight"])
    w["lm_head.weight"] = rot.rows(w["lm_head.weight"])
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {k.removeprefix(p): v for k, v in w.items() if k.startswith(p)}
        w.update({p + k: v for k, v in rot.layer(layer, i).items()})
    return w
