"""Sequential calibration (`SequentialGPTQ`) for the joint codes (`joint.py`) and for GPTQ on the
hi (W4) plane: static contiguous groups of 128, damped Hessian.

Calibration inputs are collected layer by layer from the partly quantized model: layer i sees the
hidden states produced by layers < i running on their W4 planes with A8, which is how the draft
runs. The hi code is bound to the W8 code (`gptq_codes`' w8_slack); the lo plane is the residual
of the original weight, either RTN (the seed's rule) or GPTQ-compensated (`gptq_residual_codes`,
the default: see there why).
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models.rope_utils import initialize_rope

from ..formats.bitnest import (
    GROUP_SIZE,
    Planes,
    a8,
    dequantize_planes,
    planes_from_codes,
    weight_scales,
)
from ..formats.hadamard import r4_transform
from .joint import W8_BUDGET, budgeted_joint_planes, joint_codes, output_errors_vs_rtn
from .sweep import ColumnQuantizer, Factor, column_scales, hessian, sweep


def gptq_codes(
    w: np.ndarray,
    h: np.ndarray | Factor,
    damp: float = 0.01,
    w8_slack: float | None = None,
    *,
    group_size: int = GROUP_SIZE,
) -> tuple[np.ndarray, np.ndarray]:
    """q4 codes in [-8, 7] [N, K] and fp16 scales [N, K/g] minimising ||X Wᵀ - X Ŵᵀ||, for
    groups of g = `group_size` columns.

    The hi code is the W8 code's hi nibble, so every q4 that GPTQ moves off round(w/s) costs
    the target: its residual no longer fits the lo plane. `w8_slack` (in W8 steps s/16) allows
    only the hi codes of W8 codes within that distance of w, which bounds the W8 error by the
    slack (>= 0.5: RTN is always allowed); None leaves GPTQ free. Columns are swept in their
    natural order: under this constraint act-order made the draft worse on Qwen2.5-0.5B."""
    scales = weight_scales(w, group_size)

    def for_rows(rows: slice) -> ColumnQuantizer:
        s = column_scales(scales, rows)
        k = w.shape[1]
        low, high = np.full((k, 1), -8, np.int8), np.full((k, 1), 7, np.int8)  # or [K, R]
        if w8_slack is not None:
            q8 = w[rows].T / (np.repeat(s, group_size, axis=0) / 16)
            low, high = (
                np.floor((np.clip(f(q8 + d), -128, 119) + 8) / 16).astype(np.int8)
                for f, d in ((np.ceil, -w8_slack), (np.floor, w8_slack))
            )

        def hi(values: np.ndarray, col: int) -> tuple:
            sc = s[col // group_size]
            q = np.clip(np.rint(values[0] / sc), low[col], high[col])
            return q, q * sc

        return hi

    return sweep(w, h, damp, for_rows)[0], scales


def gptq_residual_codes(
    w: np.ndarray, q4: np.ndarray, scales: np.ndarray, h: np.ndarray | Factor, damp: float = 0.01
) -> np.ndarray:
    """lo codes qr [N, K] for fixed hi codes, minimising the W8 output error with GPTQ's error
    feedback: each column's grid is q4·s + qr·s/16, qr in [-8, 7] ([0, 7] where q4 = -8); the
    group is K / (the scales' columns).

    GPTQ moves q4 off round(w/s) where that helps the draft, and the RTN residual cannot reach
    back (its range is ±s/2). Feeding the lo plane's error forward (act-order: largest inputs
    first) recovers the W8 accuracy: on Qwen2.5-0.5B with w8_slack 3 the target's perplexity
    went from +2 % over RTN back to RTN's."""
    group = w.shape[1] // scales.shape[1]

    def for_rows(rows: slice) -> ColumnQuantizer:
        s, hi = column_scales(scales, rows), np.ascontiguousarray(q4[rows].T)

        def lo(values: np.ndarray, col: int) -> tuple:
            step, base = s[col // group] / 16, hi[col] * s[col // group]
            qr = np.clip(np.rint((values[0] - base) / step), np.where(hi[col] == -8, 0, -8), 7)
            return qr, base + qr * step

        return lo

    return sweep(w, h, damp, for_rows, act_order=True)[0]


def _rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class SequentialGPTQ:
    """A `quantize(name, w) -> Planes` callback for `convert.write_package` that runs GPTQ.

    The writer asks for Linears in forward order (layer 0 q, k, v, o, gate, up, down, layer 1 …,
    lm_head), so the first request of layer i triggers its calibration pass over the hidden states
    left by the already quantized layers; lm_head's pass is the final norm over the whole quantized
    stack. (The seed manifest's lm_head is RTN; GPTQ is the same format and, on Qwen2.5-0.5B, cuts
    the draft's W4 lm_head cost.)
    """

    def __init__(
        self,
        weights: dict[str, np.ndarray],
        config: dict,
        tokens: np.ndarray,
        had_k: np.ndarray | None,
        damp: float = 0.01,
        progress: Callable[[int], None] | None = None,
        lo_method: str = "gptq",
        w8_slack: float | None = None,
        method: str = "gptq",
        lambda_draft: float | None = None,
        w8_budget: float = W8_BUDGET,
        norms: dict[str, np.ndarray] | None = None,
    ):
        self.w, self.config, self.had_k, self.damp = weights, config, had_k, damp
        self.gptq_lo, self.w8_slack = lo_method == "gptq", w8_slack
        self.joint, self.lambda_draft, self.w8_budget = method == "joint", lambda_draft, w8_budget
        self.errors: dict[str, dict[str, float]] = {}
        # Smoothing vectors (norm weight name -> d); `weights` must then hold the Linears as W/d.
        self.norms = norms or {}
        self.h = weights["model.embed_tokens.weight"][tokens].astype(np.float64)
        self.layer, self.hessians, self.planes = -1, {}, {}
        self.factors: dict[tuple[int, bool], Factor] = {}
        self.progress = progress
        hd = config["head_dim"]
        self.rope = initialize_rope(
            hd,
            config.get("rope_theta", 10000.0),
            False,
            config.get("rope_scaling"),
            config.get("max_position_embeddings", 4096),
        )

    def __call__(self, name: str, w: np.ndarray) -> Planes:
        layer = self.config["num_hidden_layers"] if name == "lm_head" else int(name.split(".")[2])
        if layer != self.layer:
            self._advance(layer)
        h = self.hessians[name.rsplit(".", 1)[-1]]
        if self.joint and self.lambda_draft is None:
            planes, lam, errors = budgeted_joint_planes(
                w, self._factor(h), self.w8_budget, self.damp
            )
            self.planes[name] = planes
            self.errors[name] = {**errors, "lambda_draft": lam}
            return planes
        if self.joint:
            codes, residual, scales = joint_codes(w, self._factor(h), self.lambda_draft, self.damp)
        else:
            codes, scales = gptq_codes(w, self._factor(h), self.damp, self.w8_slack)
            residual = None
            if self.gptq_lo:
                lo = self._factor(h, act_order=True)
                residual = gptq_residual_codes(w, codes, scales, lo, self.damp)
        planes = planes_from_codes(w, codes, scales, residual)
        self.planes[name] = planes
        self.errors[name] = output_errors_vs_rtn(w, planes, h)
        return planes

    def _factor(self, h: np.ndarray, act_order: bool = False) -> Factor:
        """Each Hessian's factor once (q/k/v and gate/up share theirs)."""
        key = (id(h), act_order)
        if key not in self.factors:
            self.factors[key] = Factor(h, self.damp, act_order)
        return self.factors[key]

    def _norm(self, name: str) -> np.ndarray:
        """RMSNorm of the hidden states, times the norm's smoothing vector if it has one."""
        x = _rms_norm(self.h, self.config["rms_norm_eps"])
        return x * self.norms[name] if name in self.norms else x

    def _rope(self, x: np.ndarray) -> np.ndarray:
        return np.array(self.rope(mx.array(x.astype(np.float32))), dtype=np.float64)

    def _linear(self, x: np.ndarray, name: str, quantized: bool, fused_w: np.ndarray | None = None):
        if quantized:
            p = self.planes[name]
            w = dequantize_planes(p.hi, p.lo, p.scales, draft=True)
        else:
            w = fused_w if fused_w is not None else self.w[f"{name}.weight"]
        y = x @ w.T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def _layer(self, i: int, quantized: bool) -> dict[str, np.ndarray]:
        """One decoder layer over self.h; returns the A8 inputs of each Linear, updates self.h."""
        c, p = self.config, f"model.layers.{i}."
        hd = c["head_dim"]
        n_h, n_kv = c["num_attention_heads"], c["num_key_value_heads"]
        b, t, _ = self.h.shape
        x = a8(self._norm(p + "input_layernorm.weight"))
        q = self._linear(x, p + "self_attn.q_proj", quantized).reshape(b, t, n_h, hd)
        k = self._linear(x, p + "self_attn.k_proj", quantized).reshape(b, t, n_kv, hd)
        v = self._linear(x, p + "self_attn.v_proj", quantized).reshape(b, t, n_kv, hd)
        q, k = (self._rope(a.transpose(0, 2, 1, 3)) for a in (q, k))
        v = v.transpose(0, 2, 1, 3)
        k, v = (np.repeat(a, n_h // n_kv, axis=1) for a in (k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
        scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        o = (probs / probs.sum(-1, keepdims=True)) @ v
        o8 = a8(o.transpose(0, 2, 1, 3).reshape(b, t, n_h * hd), hd)
        self.h = self.h + self._linear(o8, p + "self_attn.o_proj", quantized)
        x2 = a8(self._norm(p + "post_attention_layernorm.weight"))
        g = self._linear(x2, p + "mlp.gate_proj", quantized)
        a = g / (1 + np.exp(-g)) * self._linear(x2, p + "mlp.up_proj", quantized)
        a8_down = a8(r4_transform(a, self.had_k))
        down = p + "mlp.down_proj"
        fused = None if quantized else r4_transform(self.w[f"{down}.weight"], self.had_k)
        self.h = self.h + self._linear(a8_down, down, quantized, fused)
        return {"q_proj": x, "o_proj": o8, "gate_proj": x2, "down_proj": a8_down}

    def _advance(self, layer: int) -> None:
        if self.layer >= 0:
            self._layer(self.layer, quantized=True)  # hidden states through the quantized layer
            if self.progress:
                self.progress(self.layer)
        if layer == self.config["num_hidden_layers"]:
            # lm_head reads the final norm's A8 output of the quantized stack.
            self.factors = {}
            self.hessians = {"lm_head": hessian(a8(self._norm("model.norm.weight")))}
            self.layer = layer
            return
        saved = self.h
        inputs = self._layer(layer, quantized=False)
        self.h = saved
        hs = {key: hessian(x) for key, x in inputs.items()}
        self.factors = {}
        self.hessians = {
            "q_proj": hs["q_proj"],
            "k_proj": hs["q_proj"],
            "v_proj": hs["q_proj"],
            "o_proj": hs["o_proj"],
            "gate_proj": hs["gate_proj"],
            "up_proj": hs["gate_proj"],
            "down_proj": hs["down_proj"],
        }
        self.layer = layer
