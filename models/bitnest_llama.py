"""Llama / Qwen2 over dual-plane weights: one module set, W4A8KV4 draft or W8A8KV8 target."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from bitnest_mlx import kernels
from bitnest_mlx.formats.bitnest import LAYER_LINEARS
from bitnest_mlx.layers.dual_plane import DualPlaneLinear, a8, a8_deferred
from bitnest_mlx.layers.hadamard import OnlineHadamard
from bitnest_mlx.layers.nested_kv import NestedKVCache

MODES = ("draft", "target")


def a8_input(x: mx.array, group: int = -1):
    """A8 for a DualPlaneLinear input: `a8(x, group)`, or on the Metal kernel path the deferred
    form the fused A8 matmul kernel takes (same result within float rounding)."""
    deferred = a8_deferred(x, group)
    return a8(x, group) if deferred is None else deferred


@dataclass
class ModelArgs(BaseModelArgs):
    arch: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float
    model_type: str = "bitnest"
    head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    # From the manifest: which Linears carry a bias, the R4 (K, fp32) of each down_proj (None:
    # no online transform), the A8 group of o_proj, the KV group and whether R3 is on.
    biased: list[str] = field(default_factory=list)
    r4: list[dict | None] = field(default_factory=list)
    o_proj_group: int = 128
    kv_group: int = 128
    r3: bool = False
    k_bias_offset: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            hd,
        )
        self.scale = hd**-0.5
        self.o_proj_group = args.o_proj_group
        self.r3 = args.r3
        self.k_bias_offset = args.k_bias_offset

        def lin(name, n_in, n_out):
            return DualPlaneLinear(
                n_in, n_out, f"model.layers.{layer}.self_attn.{name}" in args.biased
            )

        self.q_proj = lin("q_proj", d, self.n_heads * hd)
        self.k_proj = lin("k_proj", d, self.n_kv_heads * hd)
        self.v_proj = lin("v_proj", d, self.n_kv_heads * hd)
        self.o_proj = lin("o_proj", self.n_heads * hd, d)
        self.rope = initialize_rope(
            hd, args.rope_theta, False, args.rope_scaling, args.max_position_embeddings
        )

    def _rotate(self, x: mx.array, offset: int) -> mx.array:
        """RoPE from position `offset`, then R3 (per-head Hadamard, fp32) when enabled."""
        x = self.rope(x, offset=offset)
        if self.r3:
            x = mx.hadamard_transform(x.astype(mx.float32)).astype(x.dtype)
        return x

    def __call__(
        self, x8: mx.array, mask: Any, cache: NestedKVCache, draft: bool, quantize_act: bool
    ) -> mx.array:
        B, L, _ = x8.shape
        q = self.q_proj(x8, draft).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x8, draft)
        if self.k_bias_offset:
            # Qwen2's k bias (up to ~145) would set every token's 4-bit KV scale; K is cached
            # without it and its rotated value added back at read time (RoPE and R3 are linear).
            k = k - self.k_proj.bias
        k = k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x8, draft).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self._rotate(q, cache.offset), self._rotate(k, cache.offset)
        if (
            not self.k_bias_offset
            and cache.quantized
            and kernels.nested_kv_supported(q, mask, self.head_dim, cache.group_size)
            and kernels.use("nested_kv")
        ):
            # Metal: scores and P·V straight from the 4-bit planes, no dequantized copy.
            kernels.record("nested_kv", "kernel")
            cache.write(k, v)
            o = kernels.nested_kv_attention(
                q,
                cache.keys,
                cache.values,
                draft=draft,
                scale=self.scale,
                group=cache.group_size,
                n_kv=cache.offset,
            )
        else:
            k, v = cache.update_and_fetch(k, v, draft)
            if self.k_bias_offset:
                bias = self.k_proj.bias.reshape(1, self.n_kv_heads, 1, -1)
                k = k + self._rotate(mx.broadcast_to(bias, k.shape).astype(k.dtype), 0)
            o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if quantize_act:
            o = a8_input(o, self.o_proj_group)
        return self.o_proj(o, draft)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        d, n = args.hidden_size, args.intermediate_size
        self.gate_proj = DualPlaneLinear(d, n)
        self.up_proj = DualPlaneLinear(d, n)
        self.down_proj = DualPlaneLinear(n, d)
        r4 = args.r4[layer] if args.r4 else None
        self.r4 = OnlineHadamard(n, r4["K"], r4.get("fp32", False)) if r4 else None

    def __call__(self, x8: mx.array, draft: bool, quantize_act: bool) -> mx.array:
        a = nn.silu(self.gate_proj(x8, draft)) * self.up_proj(x8, draft)
        if self.r4 is not None:
            a = self.r4(a)
        if quantize_act:
            a = a8_input(a)
        return self.down_proj(a, draft)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args, layer)
        self.eps = args.rms_norm_eps

    def _norm(self, h: mx.array, quantize_act: bool) -> mx.array:
        # Weightless: the gammas are fused into the Linears that read this.
        x = mx.fast.rms_norm(h, None, self.eps)
        return a8_input(x) if quantize_act else x

    def __call__(self, h, mask, cache, draft: bool, quantize_act: bool) -> mx.array:
        h = h + self.self_attn(self._norm(h, quantize_act), mask, cache, draft, quantize_act)
        return h + self.mlp(self._norm(h, quantize_act), draft, quantize_act)


class Model(nn.Module):
    """mlx-lm style: `model(inputs [B, T], cache) -> logits [B, T, V]`, `make_cache()`, `layers`.

    `mode` ("draft" | "target") selects the planes read by weights and KV; it can be switched
    between calls or overridden per call. `quantize_activations` / `quantize_kv` switch A8 and the
    nested KV quantization off for parity checks.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.lm_head = DualPlaneLinear(args.hidden_size, args.vocab_size)
        self._mode = "target"
        self.quantize_activations = True
        self.quantize_kv = True

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {value!r}")
        self._mode = value

    def __call__(
        self, inputs: mx.array, cache: list | None = None, mode: str | None = None
    ) -> mx.array:
        draft = (mode or self._mode) == "draft"
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        qa = self.quantize_activations
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = self.make_cache()
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c, draft, qa)
        x = mx.fast.rms_norm(h, None, self.args.rms_norm_eps)
        return self.lm_head(a8_input(x) if qa else x, draft)

    def make_cache(self) -> list[NestedKVCache]:
        return [NestedKVCache(self.args.kv_group, quantized=self.quantize_kv) for _ in self.layers]

    def sanitize(self, tensors: dict) -> dict:
        """Package tensors -> parameters: zero-copy uint32 plane views, R4 matrices per layer."""
        dtype = self.embed_tokens.weight.dtype
        out = {"embed_tokens.weight": tensors["model.embed_tokens.weight"].astype(dtype)}
        for i, layer in enumerate(self.layers):
            for name in LAYER_LINEARS:
                out.update(DualPlaneLinear.prepare(tensors, f"model.layers.{i}.{name}", dtype))
            r4 = layer.mlp.r4
            if r4 is not None and r4.k > 1:
                out[f"model.layers.{i}.mlp.r4.had_k"] = tensors[f"aux.had_K.{r4.k}"]
        out.update(DualPlaneLinear.prepare(tensors, "lm_head", dtype))
        return {k.removeprefix("model."): v for k, v in out.items()}


def args_from_package(manifest: dict, config: dict) -> ModelArgs:
    """ModelArgs from a validated package's manifest and config."""
    layers = range(config["num_hidden_layers"])
    online = (manifest.get("online_hadamard") or {}).get("layers", {})
    groups = (manifest.get("activation") or {}).get("per_layer_group", {})
    kv = manifest.get("kv") or {}
    head_dim = config["head_dim"]
    return ModelArgs.from_dict(
        {
            **config,
            "biased": [n for n, e in manifest["layers"].items() if e.get("has_bias")],
            "r4": [online.get(f"model.layers.{i}.mlp.down_proj") for i in layers],
            "o_proj_group": groups.get("model.layers.0.self_attn.o_proj", head_dim),
            "kv_group": kv.get("group", head_dim),
            "r3": kv.get("r3") is True or kv.get("r3_enabled") is True,
            "k_bias_offset": kv.get("per_channel_offset") == "k_bias",
        }
    )
