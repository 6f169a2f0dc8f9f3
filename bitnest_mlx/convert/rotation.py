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


def rotate(
    weights: dict[str, np.ndarray], config: dict, kind: str = "hadamard", seed: int = 0
) -> dict[str, np.ndarray]:
    """Apply R1 (hidden) and R2 (per value head) to norm-folded float weights."""
    if kind == "none":
        return weights
    rng = np.random.default_rng(seed)
    d, hd = config["hidden_size"], config["head_dim"]
    n_kv, n_heads = config["num_key_value_heads"], config["num_attention_heads"]
    r1 = orthogonal(d, kind, rng)

    def mm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        # float64 products keep the fused model equal to the original to ~1e-7; stored float32.
        return (np.asarray(a, np.float64) @ np.asarray(b, np.float64)).astype(np.float32)

    w = dict(weights)
    w["model.embed_tokens.weight"] = mm(w["model.embed_tokens.weight"], r1.T)
    w["lm_head.weight"] = mm(w["lm_head.weight"], r1.T)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        r2 = orthogonal(hd, kind, rng)
        for lin in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
        ):
            w[f"{p}{lin}.weight"] = mm(w[f"{p}{lin}.weight"], r1.T)
        for lin in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"{p}{lin}.weight"] = mm(r1, w[f"{p}{lin}.weight"])
        v = w[f"{p}self_attn.v_proj.weight"].reshape(n_kv, hd, d)
        w[f"{p}self_attn.v_proj.weight"] = mm(r2, v).reshape(n_kv * hd, d)
        if f"{p}self_attn.v_proj.bias" in w:
            b = w[f"{p}self_attn.v_proj.bias"].reshape(n_kv, hd)
            w[f"{p}self_attn.v_proj.bias"] = mm(b, r2.T).reshape(-1)
        o = w[f"{p}self_attn.o_proj.weight"].reshape(d, n_heads, hd)
        w[f"{p}self_attn.o_proj.weight"] = mm(o, r2.T).reshape(d, n_heads * hd)
    return w
