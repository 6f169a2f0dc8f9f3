"""DeepSeek-V4 (model_type `deepseek_v4`): mHC streams, sliding-window + compressed attention, MoE.

Spec: docs/deepseek-v4-spec.md §1-§9 (cache: §13). Parameter names are
the official checkpoint names (`layers.L.attn.wq_a.weight`, ...) with routed experts stacked under
`layers.L.ffn.switch_mlp.{gate,up,down}_proj`, so a loader only renames and stacks.

Every call continues from the cache: a full prefill, a chunk, one decode token or a γ+1-token
verification are the same code path, and `DSV4Cache.trim(k)` rolls back exactly
(bitnest_mlx/layers/dsv4_cache.py). This file is the architecture; the compressed-attention
branch is models/deepseek_v4_attention.py; the hyper-connections and the MoE routing, with their
Metal kernels and pure paths, are bitnest_mlx/layers/dsv4_hc.py and dsv4_route.py; the QAT
roundings and partial RoPE, which are not specific to it, are bitnest_mlx/layers/dsv4_ops.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.base import BaseModelArgs
from mlx_lm.models.switch_layers import SwitchLinear

from bitnest_mlx.formats.dsv4_config import DSV4Config
from bitnest_mlx.formats.dsv4_schedule import schedule
from bitnest_mlx.layers import dsv4_hc, dsv4_route
from bitnest_mlx.layers.dsv4_cache import DSV4Cache
from bitnest_mlx.layers.dsv4_ops import PartialRoPE, fp8_fake_quant, swiglu_clamped, unrolled_sum
from bitnest_mlx.layers.mxtq_linear import MXTQSwitchLinear, routed_glu
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.layers.pipeline import PipelineStage

from .deepseek_v4_attention import Compressor, Indexer, Slots, linear, norm, tensor
from .deepseek_v4_weights import BundleWeights


@dataclass
class ModelArgs(DSV4Config, BaseModelArgs):
    """config.json's fields as formats.dsv4_config.DSV4Config lists and validates them (the one
    list of names, types, ranges and defaults), under mlx-lm's args protocol."""


# ---------------------------------------------------------------- small pieces


def _yarn_config(args: ModelArgs) -> dict | None:
    params = args.rope_parameters or args.rope_scaling or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return params if kind == "yarn" else None


# ---------------------------------------------------------------- attention


class Attention(nn.Module):
    """One shared K=V head with sinks over window rows ∪ (selected) compressed entries."""

    def __init__(self, args: ModelArgs, layer: int, slots: Slots):
        super().__init__()
        self.n_heads, self.head_dim = args.num_attention_heads, args.head_dim
        self.rope_dims = args.qk_rope_head_dim
        self.o_groups = args.o_groups
        self.window, self.eps = args.sliding_window, args.rms_norm_eps
        self.ratio = args.compress_ratios[layer]
        self.scale = self.head_dim**-0.5
        p = f"layers.{layer}.attn"
        self.wq_a = linear(slots, f"{p}.wq_a")
        self.q_norm = norm(slots, f"{p}.q_norm", self.eps)
        self.wq_b = linear(slots, f"{p}.wq_b")
        self.wkv = linear(slots, f"{p}.wkv")
        self.kv_norm = norm(slots, f"{p}.kv_norm", self.eps)
        # wo_a is block-diagonal: rows g·o_lora.. of the 2-D matrix act on head group g only.
        self.wo_a = linear(slots, f"{p}.wo_a")
        self.wo_b = linear(slots, f"{p}.wo_b")
        self.attn_sink = tensor(slots, f"{p}.attn_sink")
        # Sliding-only layers use rope_theta without YaRN; compressed layers share one YaRN table
        # across q/kv, their compressor and their indexer.
        if self.ratio:
            self.rope = PartialRoPE(self.rope_dims, args.compress_rope_theta, _yarn_config(args))
            self.compressor = Compressor(slots, f"{p}.compressor", self.ratio, self.eps, self.rope)
        else:
            self.rope = PartialRoPE(self.rope_dims, args.rope_theta, None)
        if self.ratio == 4:
            self.indexer = Indexer(
                slots, f"{p}.indexer", args.index_n_heads, args.index_topk, self.eps, self.rope
            )

    def _fp8_kv(self, kv: mx.array) -> mx.array:
        nope = kv[..., : -self.rope_dims]
        return mx.concatenate([fp8_fake_quant(nope), kv[..., -self.rope_dims :]], axis=-1)

    def _entry_keys(self, qat: bool, dtype: mx.Dtype, entries: mx.array) -> mx.array:
        """New compressed entries as the attention reads them (made once, kept in the cache)."""
        return (self._fp8_kv(entries) if qat else entries).astype(dtype)

    def __call__(self, x: mx.array, cache: DSV4Cache, qat: bool = False) -> mx.array:
        B, L, _ = x.shape
        p = cache.offset
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        q = self.rope(mx.fast.rms_norm(q, None, self.eps), offset=p)
        kv = self.rope(self.kv_norm(self.wkv(x))[:, None], offset=p)
        if qat:
            kv = self._fp8_kv(kv)
        keys = cache.append_keys(kv)

        # The masks are made on the host from positions alone: no kernels.
        qpos = p + np.arange(L)[:, None]
        kpos = cache.keys_start + np.arange(keys.shape[2])[None]
        mask = (kpos <= qpos) & (kpos > qpos - self.window)
        if self.ratio:
            pool = cache.pools["compressor"]
            entries = self.compressor(x, pool, p, partial(self._entry_keys, qat, keys.dtype))
            # Query t sees entry j once its block is complete: (j + 1) · ratio <= t + 1.
            visible = np.arange(entries.shape[1])[None] < (qpos + 1) // self.ratio
            if self.ratio == 4:
                visible = self.indexer(x, qr, cache.pools["indexer"], p, visible, qat)
            if entries.shape[1]:
                keys = mx.concatenate([keys, entries[:, None]], axis=2)
            if isinstance(visible, np.ndarray):
                mask = np.concatenate([mask, visible], axis=-1)
            else:
                mask = mx.broadcast_to(mx.array(mask), (visible.shape[0], *mask.shape))
                mask = mx.concatenate([mask, visible], axis=-1)
        mask = mx.array(mask).reshape(-1, 1, L, keys.shape[2])
        cache.advance(L)

        o = mx.fast.scaled_dot_product_attention(
            q, keys, keys, scale=self.scale, mask=mask, sinks=self.attn_sink.astype(q.dtype)
        )
        # V = K carries RoPE; rotating the output back makes each value's share relative.
        o = self.rope(o, offset=p, inverse=True)
        o = o.transpose(0, 2, 1, 3).reshape(B, L, self.o_groups, -1)
        return self.wo_b(self._grouped_wo_a(o).reshape(B, L, -1))

    def _grouped_wo_a(self, o: mx.array) -> mx.array:
        """[B, L, G, in_g] -> [B, L, G, o_lora] with group g using rows g·o_lora.. of wo_a."""
        G, lin = self.o_groups, self.wo_a
        xg = o.transpose(2, 0, 1, 3)  # [G, B, L, in_g]
        if isinstance(lin, nn.QuantizedLinear):
            w, s, b = (a.reshape(G, -1, a.shape[-1]) for a in (lin.weight, lin.scales, lin.biases))
            y = mx.quantized_matmul(
                xg, w[:, None], s[:, None], b[:, None], True, lin.group_size, lin.bits
            )
        else:
            y = xg @ lin.weight.reshape(G, 1, -1, lin.weight.shape[-1]).swapaxes(-1, -2)
        return y.transpose(1, 2, 0, 3)


# ---------------------------------------------------------------- MoE


class Gate(nn.Module):
    """sqrt(softplus) scores; experts by top-k of score + bias, or by tid2eid on hash layers."""

    def __init__(self, args: ModelArgs, slots: Slots, prefix: str):
        super().__init__()
        self.top_k, self.route_scale = args.num_experts_per_tok, args.routed_scaling_factor
        self.weight = tensor(slots, f"{prefix}.weight")
        if f"{prefix}.tid2eid" in slots:  # a hash layer (the first num_hash_layers)
            self.tid2eid = tensor(slots, f"{prefix}.tid2eid")
        else:
            self.bias = tensor(slots, f"{prefix}.bias")

    def __call__(
        self, x: mx.array, ids: mx.array, use_kernels: bool = True
    ) -> tuple[mx.array, mx.array]:
        """(experts [..., top_k] uint32, weights [..., top_k] float32); both routing paths
        (layers/dsv4_route.py) read nothing back to the host."""
        logits = x.astype(mx.float32) @ self.weight.T.astype(mx.float32)
        if "tid2eid" in self:
            by = {"table": self.tid2eid, "ids": ids}
        else:
            by = {"bias": self.bias}
        return dsv4_route.route(logits, self.top_k, self.route_scale, **by, use_kernels=use_kernels)


class SharedExpert(nn.Module):
    def __init__(self, slots: Slots, prefix: str, limit: float):
        super().__init__()
        self.w1 = linear(slots, f"{prefix}.w1")  # gate
        self.w2 = linear(slots, f"{prefix}.w2")  # down
        self.w3 = linear(slots, f"{prefix}.w3")  # up
        self.limit = limit

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(swiglu_clamped(self.w1(x), self.w3(x), self.limit))


class SwitchMLP(nn.Module):
    """Routed experts; the projections may be float SwitchLinear or MXTQSwitchLinear."""

    def __init__(self, slots: Slots, prefix: str):
        super().__init__()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            e, out_features, in_features = slots[f"{prefix}.{proj}"].shape
            setattr(self, proj, SwitchLinear(in_features, out_features, e, bias=False))

    def __call__(
        self, x: mx.array, idx: mx.array, w: mx.array, limit: float, use_kernels: bool = True
    ) -> mx.array:
        """down(w · swiglu_clamped(gate(x), up(x))) per routed slot: x [..., 1, 1, D] float32,
        idx and route weights w [..., K] -> [..., K, 1, D] float32. `use_kernels`: the call's
        RunOptions.use_kernels (MXTQ experts only; float experts have no kernel)."""
        projs = (self.gate_proj, self.up_proj, self.down_proj)
        if all(isinstance(p, MXTQSwitchLinear) for p in projs):
            return routed_glu(*projs, x, idx, w, limit, use_kernels)

        def proj(p: nn.Module, x: mx.array) -> mx.array:
            if isinstance(p, MXTQSwitchLinear):  # a bundle may store some projections float
                return p(x, idx, use_kernels=use_kernels)
            return p(x, idx)

        h = swiglu_clamped(proj(self.gate_proj, x), proj(self.up_proj, x), limit)
        # The route weight scales the activation before down_proj, as in the reference.
        return proj(self.down_proj, h * w[..., None, None])


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, slots: Slots):
        super().__init__()
        self.limit, p = args.swiglu_limit, f"layers.{layer}.ffn"
        self.gate = Gate(args, slots, f"{p}.gate")
        self.switch_mlp = SwitchMLP(slots, f"{p}.switch_mlp")
        self.shared_experts = SharedExpert(slots, f"{p}.shared_experts", self.limit)

    def __call__(self, x: mx.array, ids: mx.array, use_kernels: bool = True) -> mx.array:
        x32 = x.astype(mx.float32)  # the router's and the routed experts' input
        idx, w = self.gate(x32, ids, use_kernels)
        y = self.switch_mlp(x32[..., None, None, :], idx, w, self.limit, use_kernels)
        return _moe_sum(y, self.shared_experts(x), x)


@mx.compile
def _moe_sum(routed: mx.array, shared: mx.array, x: mx.array) -> mx.array:
    """Σ over the routed slots [..., K, 1, D] plus the shared expert, rounded to x's dtype, as
    one kernel (the slot sum unrolled in the order `.sum` adds)."""
    slots = [routed[..., k, 0, :] for k in range(routed.shape[-3])]
    return (unrolled_sum(slots) + shared.astype(mx.float32)).astype(x.dtype)


# ---------------------------------------------------------------- hyper-connections
# The mixing, the Sinkhorn normalisation and both paths are bitnest_mlx/layers/dsv4_hc.py.


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, slots: Slots):
        super().__init__()
        self.args, p = args, f"layers.{layer}"
        self.attn_norm = norm(slots, f"{p}.attn_norm", args.rms_norm_eps)
        self.ffn_norm = norm(slots, f"{p}.ffn_norm", args.rms_norm_eps)
        self.attn = Attention(args, layer, slots)
        self.ffn = MoE(args, layer, slots)
        self.hc = dsv4_hc.HCShape(
            args.hc_mult, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps
        )
        for site in ("attn", "ffn"):
            for part, fill in (("fn", 0.0), ("base", 0.0), ("scale", 1.0)):
                name = f"hc_{site}_{part}"
                setattr(self, name, tensor(slots, f"{p}.{name}", fill))

    def _hc_pre(self, streams: mx.array, site: str, use_kernels: bool = True):
        """(the sublayer's normed input, post, comb) of hyper-connection `site` ("attn" or
        "ffn")."""
        fn, base, scale = (getattr(self, f"hc_{site}_{n}") for n in ("fn", "base", "scale"))
        norm = getattr(self, f"{site}_norm")
        return dsv4_hc.before(streams, fn, scale, base, self.hc, norm, use_kernels)

    def _hc_post(
        self, y: mx.array, streams: mx.array, post: mx.array, comb: mx.array, use_kernels: bool
    ) -> mx.array:
        return dsv4_hc.after(y, streams, post, comb, use_kernels)

    def __call__(self, streams: mx.array, ids: mx.array, cache: DSV4Cache, o: RunOptions):
        use = o.use_kernels
        x, post, comb = self._hc_pre(streams, "attn", use)
        streams = self._hc_post(self.attn(x, cache, o.qat), streams, post, comb, use)
        x, post, comb = self._hc_pre(streams, "ffn", use)
        return self._hc_post(self.ffn(x, ids, use), streams, post, comb, use)


class Model(BundleWeights, nn.Module):
    """mlx-lm style: `model(inputs [B, T], cache) -> logits [B, T, V]` for every position.

    The call convention is the bitnest model's: `options` (RunOptions) are the defaults of every
    call (the loader sets them), a call may pass its own. This model reads `use_kernels` (the
    Metal kernels of the hyper-connections, the routing and the MXTQ experts, or the pure path)
    and `qat` (the reference's QAT simulation: FP8
    KV, Hadamard + FP4 indexer); it has one precision, so every `mode` reads the same weights.
    `pipeline(group)` keeps one rank's share of the layers (bitnest_mlx/layers/pipeline.py).
    A bundle's tensors become parameters through `quantize_as` and `sanitize`
    (models/deepseek_v4_weights.py), as mlx-lm models map checkpoints in `sanitize`.
    """

    # One set of weights at one precision: there is no cheaper plane to draft with.
    supports_draft = False

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        # The bundle schedule is the one list of tensor names and shapes: every module below
        # reads its parameters' shapes from it (the reader and writer check bundles against it).
        slots = schedule(args)
        self.embed = nn.Embedding(*slots["embed"].shape)
        self.layers = [Block(args, i, slots) for i in range(args.num_hidden_layers)]
        self.norm = norm(slots, "norm", args.rms_norm_eps)
        self.head = linear(slots, "head")
        self.hc_head_fn = tensor(slots, "hc_head_fn")
        self.hc_head_base = tensor(slots, "hc_head_base")
        self.hc_head_scale = tensor(slots, "hc_head_scale", 1.0)
        self.check_declared(slots)
        self.options = RunOptions()
        self.expert_store = None  # routed experts read from disk: `quantize_as`
        self.stage = PipelineStage.whole(args.num_hidden_layers)

    def pipeline(self, group: mx.distributed.Group, split: list[int] | None = None) -> None:
        """Keep this rank's layers only (and the embedding if it runs layer 0); every rank keeps
        the final collapse, norm and head, so all ranks return the same logits."""
        self.stage = stage = PipelineStage.of(group, self.args.num_hidden_layers, split)
        # None in front keeps the parameter names `layers.L.…` the bundle uses.
        self.layers = [None] * stage.start + self.layers[stage.start : stage.end]
        if not stage.first:
            del self.embed

    def __call__(
        self,
        inputs: mx.array,
        cache: list[DSV4Cache] | None = None,
        mode: str | None = None,
        *,
        options: RunOptions | None = None,
    ) -> mx.array:
        """`cache`: `make_cache()`'s list, one cache per layer this rank runs. `mode` is
        accepted as the bitnest model takes it and changes nothing (one precision)."""
        o = options or self.options
        if cache is None:
            cache = self.make_cache()
        a, stage = self.args, self.stage
        if stage.first:
            h = self.embed(inputs)
            streams = mx.broadcast_to(h[:, :, None], (*h.shape[:2], a.hc_mult, h.shape[-1]))
        else:  # a later pipeline stage continues the previous stage's streams
            streams = stage.receive(
                (*inputs.shape, a.hc_mult, a.hidden_size), self.norm.weight.dtype
            )
        for layer, c in zip(self.layers[stage.start :], cache):
            streams = layer(streams, inputs, c, o)
        streams = stage.hand_on(streams, cache[-1])
        # Final collapse: sigmoid weights only, no Sinkhorn.
        scale, base = self.hc_head_scale, self.hc_head_base
        y = dsv4_hc.head(streams, self.hc_head_fn, scale, base, a.hc_eps, a.rms_norm_eps)
        return self.head(self.norm(y)).astype(mx.float32)

    def make_cache(self, max_rollback: int = 32) -> list[DSV4Cache]:
        a, s = self.args, self.stage
        ratios = a.compress_ratios[s.start : s.end]
        return [DSV4Cache(a.sliding_window, r, max_rollback) for r in ratios]


__all__ = ["ModelArgs", "Model"]
