"""An independent numpy forward of a bitnest-package-v1 package, written from the spec text.

docs/bitnest-package.md §3-§5: dual-plane weights, A8, weightless RMSNorm, RoPE (HF
rotate-half layout, llama3 scaling), GQA, nested KV (KV4/KV8), R4 on the down_proj input. It
deliberately imports nothing from the runtime (layers, models): tensors are read with the
package reader and everything else - nibble unpacking, dequantization, the Hadamard matrices,
RoPE frequencies - is rebuilt here, so a shared mistake cannot make both sides agree.

Float math is float64; the quantizers (A8, nested KV) run in float32 because the spec defines
them as fp32 maps.

Ties. A8 and the KV rule round x/scale to an integer, and some inputs sit exactly on a .5
boundary by construction: rms_norm of a bf16 embedding row gives x_i/scale = 127 e_i/e_max,
often a half-integer, and at position 0 attention returns one token's KV8 values, so the o_proj
group holds codes 56 and 112 (127*56/112 = 63.5). Which way such a tie goes depends on the last
fp32 bit of the quantizer's input, which the spec does not (and cannot usefully) pin down, and
one flipped A8 code moves the logits by ~1e-2. So `forward` can take a `Trace` of the runtime's
quantizer *inputs*: at each quantizer it first checks that the runtime's input is close to its
own, then applies the spec rule to both; where the codes differ (which, inputs being close,
only happens at a near-tie) it keeps the runtime's side and counts it. The runtime's quantizer
outputs are never used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from bitnest_mlx.formats import bitnest

GROUP = 128  # weight scale group (columns) of a manifest without `group_size` (spec §1.1)
F32 = np.float32


# ---------------------------------------------------------------------------------------------
# Exact integer maps (spec §2, §3, §5)


def unpack_codes(b: np.ndarray) -> np.ndarray:
    """uint8 [..., K/2] -> codes [..., K]: byte j holds column 2j (low nibble), 2j+1 (high)."""
    b = np.asarray(b, dtype=np.uint8)
    return np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], 2 * b.shape[-1])


def dequant(
    hi: np.ndarray, lo: np.ndarray, scales: np.ndarray, draft: bool, group: int = GROUP
) -> np.ndarray:
    """W4 = q4 s (draft) or W8 = (16 q4 + qr) s / 16 (target), float64 [N, K]; one scale per
    `group` columns."""
    q4 = unpack_codes(hi).astype(np.float64) - 8
    s = np.repeat(np.asarray(scales).astype(np.float64), group, axis=-1)
    assert s.shape == q4.shape, f"scales {np.shape(scales)} do not cover {q4.shape} in {group}s"
    if draft:
        return q4 * s
    qr = unpack_codes(lo).astype(np.float64) - 8
    return (16 * q4 + qr) * s / 16


def a8_codes(x: np.ndarray, group: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Spec A8 in fp32: scale = amax/127 (1 if amax == 0), codes = clip(rint(x/scale), -128, 127)
    (np.rint rounds half to even). Returns codes shaped like x and scales [..., groups]."""
    xf = np.asarray(x, dtype=F32)
    g = xf.reshape(*xf.shape[:-1], -1, group) if group > 0 else xf[..., None, :]
    amax = np.abs(g).max(axis=-1, keepdims=True)
    scale = np.where(amax == 0, F32(1), amax / F32(127)).astype(F32)
    return np.clip(np.rint(g / scale), -128, 127).reshape(xf.shape), scale[..., 0]


def kv_codes(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Spec §5 nested KV in fp32: (q4, qr, s) with s = max|x|/7 (1 if 0), q4 and qr in [-8, 7]."""
    xf = np.asarray(x, dtype=F32)
    g = xf.reshape(*xf.shape[:-1], -1, group)
    s = (np.abs(g).max(axis=-1, keepdims=True) / F32(7)).astype(F32)
    s = np.where(s == 0, F32(1), s).astype(F32)
    q4 = np.clip(np.rint(g / s), -8, 7).astype(F32)
    qr = np.clip(np.rint((g - q4 * s) / (s / F32(16))), -8, 7).astype(F32)
    return q4.reshape(xf.shape), qr.reshape(xf.shape), s[..., 0]


# ---------------------------------------------------------------------------------------------
# Float pieces


def sylvester(n: int) -> np.ndarray:
    """Natural-order Walsh-Hadamard: H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    return 1.0 - 2.0 * parity


def r4_matrix(n: int, had_k: np.ndarray | None) -> np.ndarray:
    """H = (hadK ⊗ H_{n/K}) / sqrt(n) as an explicit [n, n] matrix (spec §4)."""
    if had_k is None:
        return sylvester(n) / np.sqrt(n)
    k = had_k.shape[0]
    return np.kron(np.asarray(had_k, dtype=np.float64), sylvester(n // k)) / np.sqrt(n)


def rms_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """Weightless RMSNorm (gammas are folded into the following Linears)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Per-pair angular frequencies; llama3 scaling divides long wavelengths by `factor`
    and interpolates smoothly between `original/low_freq_factor` and `original/high_freq_factor`.
    """
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"reference has no rope_type {kind!r}")
    factor = scaling["factor"]
    lo_f, hi_f = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    ctx = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > ctx / lo_f, inv / factor, inv)
    smooth = (ctx / wavelen - lo_f) / (hi_f - lo_f)
    medium = (wavelen >= ctx / hi_f) & (wavelen <= ctx / lo_f)
    return np.where(medium, (1 - smooth) * inv / factor + smooth * inv, out)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """HF rotate-half RoPE: x [T, H, D]; pairs are (i, i + D/2)."""
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]  # [T, D/2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------------------------
# Quantizer sites with tie decisions taken from the runtime's inputs


@dataclass
class Trace:
    """The runtime's quantizer inputs in call order, shaped like the reference's ([T, ...])."""

    a8: list[np.ndarray] = field(default_factory=list)
    kv: list[np.ndarray] = field(default_factory=list)
    adopted: int = 0  # codes taken from the runtime's input at a near-tie
    total: int = 0  # codes compared
    max_input_err: float = 0.0  # max |x_runtime - x_reference| / max|x| over all sites


class _Sites:
    """Applies A8 / nested KV at each site, optionally resolving near-ties as described above."""

    def __init__(self, trace: Trace | None, rtol: float):
        self.trace, self.rtol = trace, rtol
        self.a8_i = self.kv_i = 0

    def _runtime_input(self, kind: str, x: np.ndarray) -> np.ndarray | None:
        if self.trace is None:
            return None
        seen = getattr(self.trace, kind)
        i = getattr(self, f"{kind}_i")
        setattr(self, f"{kind}_i", i + 1)
        rt = np.asarray(seen[i], dtype=np.float64)
        if rt.shape != x.shape:
            raise AssertionError(f"{kind} site {i}: runtime shape {rt.shape}, reference {x.shape}")
        err = float(np.abs(rt - x).max() / max(np.abs(x).max(), 1e-30))
        self.trace.max_input_err = max(self.trace.max_input_err, err)
        if err > self.rtol:  # a real disagreement, not a tie: fail here, at the site
            raise AssertionError(f"{kind} site {i}: runtime input differs by {err:.2e} (rel)")
        return rt

    def _count(self, differ: np.ndarray) -> None:
        self.trace.adopted += int(differ.sum())
        self.trace.total += differ.size

    def a8(self, x: np.ndarray, group: int = -1) -> np.ndarray:
        rt = self._runtime_input("a8", x)
        codes, scale = a8_codes(x, group)
        if rt is not None:
            theirs = a8_codes(rt, group)[0]
            self._count(codes != theirs)
            codes = np.where(codes != theirs, theirs, codes)
        shape = (*x.shape[:-1], -1, group) if group > 0 else (*x.shape[:-1], 1, x.shape[-1])
        out = codes.reshape(shape) * scale[..., None].astype(np.float64)
        return out.reshape(x.shape)

    def kv(self, x: np.ndarray, group: int, draft: bool) -> np.ndarray:
        rt = self._runtime_input("kv", x)
        q4, qr, s = kv_codes(x, group)
        if rt is not None:
            rq4, rqr, _ = kv_codes(rt, group)
            # One decision per element: the (q4, qr) pair of whichever side is kept.
            keep = (q4 != rq4) | (qr != rqr)
            self._count(keep)
            q4, qr = np.where(keep, rq4, q4), np.where(keep, rqr, qr)
        shape = (*x.shape[:-1], -1, group)
        sg = s[..., None].astype(np.float64)
        q4, qr = q4.reshape(shape).astype(np.float64), qr.reshape(shape).astype(np.float64)
        out = q4 * sg if draft else (16 * q4 + qr) * sg / 16
        return out.reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# The model


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a)


@dataclass
class Reference:
    config: dict
    tensors: dict[str, np.ndarray]
    had: dict[int, np.ndarray | None]  # layer -> R4 matrix (absent layer: no online transform)
    group: int  # weight scale group: the manifest's group_size
    o_group: int
    kv_group: int
    inv_freq: np.ndarray
    r3: bool  # spec §5: per-head normalized Hadamard on q and k after RoPE, only when enabled
    k_bias_offset: bool  # kv.per_channel_offset "k_bias": K is quantized without its bias

    @classmethod
    def load(cls, path: str | Path) -> Reference:
        pkg = bitnest.read(path)
        t = {k: _np(v) for k, v in pkg.tensors.items()}
        cfg, man = pkg.config, pkg.manifest
        online = (man.get("online_hadamard") or {}).get("layers", {})
        had: dict[int, np.ndarray | None] = {}
        for i in range(cfg["num_hidden_layers"]):
            spec = online.get(f"model.layers.{i}.mlp.down_proj")
            if spec is not None:
                k = spec.get("K", 1)
                had[i] = r4_matrix(cfg["intermediate_size"], t[f"aux.had_K.{k}"] if k > 1 else None)
        groups = (man.get("activation") or {}).get("per_layer_group", {})
        kv = man.get("kv") or {}
        return cls(
            config=cfg,
            tensors=t,
            had=had,
            group=man.get("group_size", GROUP),
            o_group=groups.get("model.layers.0.self_attn.o_proj", cfg["head_dim"]),
            kv_group=kv.get("group", cfg["head_dim"]),
            inv_freq=rope_inv_freq(cfg["head_dim"], cfg["rope_theta"], cfg.get("rope_scaling")),
            r3=kv.get("r3") is True or kv.get("r3_enabled") is True,
            k_bias_offset=kv.get("per_channel_offset") == "k_bias",
        )

    def weight(self, name: str, draft: bool) -> np.ndarray:
        t = self.tensors
        return dequant(t[f"{name}.hi"], t[f"{name}.lo"], t[f"{name}.scales"], draft, self.group)

    def linear(self, x: np.ndarray, name: str, draft: bool) -> np.ndarray:
        y = np.asarray(x, dtype=np.float64) @ self.weight(name, draft).T
        bias = self.tensors.get(f"{name}.bias")
        return y if bias is None else y + bias.astype(np.float64)

    def forward(
        self,
        tokens: list[int],
        draft: bool,
        quantize_act: bool = True,
        quantize_kv: bool = True,
        trace: Trace | None = None,
        site_rtol: float = 1e-4,
    ) -> np.ndarray:
        """Logits [T, V] for a whole sequence from position 0 (causal), float64.

        `trace`: the runtime's quantizer inputs, for near-tie decisions (module docstring);
        each must be within `site_rtol` (relative to the site's max) of the reference's input.
        """
        sites = _Sites(trace, site_rtol)
        c = self.config
        eps, hd = c["rms_norm_eps"], c["head_dim"]
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        act = sites.a8 if quantize_act else (lambda x, group=-1: x)
        t_len = len(tokens)
        pos = np.arange(t_len)
        causal = np.tril(np.ones((t_len, t_len), dtype=bool))
        h = self.tensors["model.embed_tokens.weight"][np.asarray(tokens)].astype(np.float64)
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x8 = act(rms_norm(h, eps))
            q = self.linear(x8, p + "self_attn.q_proj", draft).reshape(t_len, nh, hd)
            k = self.linear(x8, p + "self_attn.k_proj", draft).reshape(t_len, nkv, hd)
            v = self.linear(x8, p + "self_attn.v_proj", draft).reshape(t_len, nkv, hd)
            # The k bias as its own term, rotated like K, so it can stay out of the KV planes.
            kb = np.zeros_like(k)
            if self.k_bias_offset:
                b = self.tensors[p + "self_attn.k_proj.bias"].astype(np.float64).reshape(nkv, hd)
                kb = rope(np.broadcast_to(b, k.shape), pos, self.inv_freq)
            q, k = rope(q, pos, self.inv_freq), rope(k, pos, self.inv_freq) - kb
            if self.r3:
                h3 = r4_matrix(hd, None)  # the normalized Sylvester matrix of size head_dim
                q, k, kb = q @ h3.T, k @ h3.T, kb @ h3.T
            if quantize_kv:  # attention reads the stored planes, the current token included
                k, v = sites.kv(k, self.kv_group, draft), sites.kv(v, self.kv_group, draft)
            k = k + kb
            o = np.empty_like(q)
            for head in range(nh):
                kvh = head // (nh // nkv)  # GQA: consecutive q heads share one kv head
                s = q[:, head] @ k[:, kvh].T / np.sqrt(hd)
                s = np.where(causal, s, -np.inf)
                w = np.exp(s - s.max(axis=-1, keepdims=True))
                o[:, head] = (w / w.sum(axis=-1, keepdims=True)) @ v[:, kvh]
            o = o.reshape(t_len, nh * hd)  # head-major, so A8 groups of 128 are per head
            h = h + self.linear(act(o, self.o_group), p + "self_attn.o_proj", draft)
            x8 = act(rms_norm(h, eps))
            g = self.linear(x8, p + "mlp.gate_proj", draft)
            a = g / (1 + np.exp(-g)) * self.linear(x8, p + "mlp.up_proj", draft)
            if i in self.had:
                a = a @ self.had[i].T  # y = H a per token
            h = h + self.linear(act(a), p + "mlp.down_proj", draft)
        return self.linear(act(rms_norm(h, eps)), "lm_head", draft)
