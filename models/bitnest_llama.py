"""Llama / Qwen2 over dual-plane weights: one module set, W4A8KV4 draft or W8A8KV8 target.

How each step is stored and computed (planes, A8, kernels, the nested KV cache) is decided below
the model, in `bitnest_mlx.layers`; `RunOptions` says which reading a call wants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import BaseModelArgs, create_attention_mask
from mlx_lm.models.rope_utils import initialize_rope

from bitnest_mlx.formats.bitnest import LAYER_LINEARS, PackageSpec, norm_names
from bitnest_mlx.formats.bitnest.draft_vocab import DRAFT_VOCAB
from bitnest_mlx.layers.draft_vocab import DraftVocabHead
from bitnest_mlx.layers.dual_plane import DualPlaneLinear, project, swiglu
from bitnest_mlx.layers.hadamard import OnlineHadamard, r3, rotate_heads
from bitnest_mlx.layers.nested_kv import NestedKVCache
from bitnest_mlx.layers.options import RunOptions

# Positions of Qwen2's rotated k bias computed at a time (Attention._k_offset_rows): the
# cache's own growth step, so the table's extensions are as rare as the cache's.
K_OFFSET_STEP = 256


@dataclass
class ModelArgs(PackageSpec, BaseModelArgs):
    """The package's description (formats.bitnest.PackageSpec) under mlx-lm's args protocol."""

    model_type: str = "bitnest"

    @classmethod
    def from_spec(cls, spec: PackageSpec) -> ModelArgs:
        return cls.from_dict(spec.to_dict())


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
        self._k_offset_table: tuple = (None, None)  # (bias id, dtype), rotated rows

        def lin(name, n_in, n_out):
            biased = f"model.layers.{layer}.self_attn.{name}" in args.biased
            return DualPlaneLinear(n_in, n_out, biased, group_size=args.group_size)

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
        return r3(x) if self.r3 else x

    def _rotate_qk(self, qk: mx.array, offset: int, o: RunOptions) -> tuple[mx.array, mx.array]:
        """`_rotate` of q's and k's heads, qk [B, Hq + Hkv, L, D], as one RoPE and one R3:
        (q, k)."""
        qk = self.rope(qk, offset=offset)
        if self.r3:
            return rotate_heads(qk, self.n_heads, o.use_kernels)
        return qk[:, : self.n_heads], qk[:, self.n_heads :]

    def _k_offset(self, n: int, start: Any, dtype: mx.Dtype) -> mx.array:
        """Qwen2's k bias as it would sit in the cache's n slots, slot 0 at position `start`
        (RoPE and R3 are linear, so K without its bias + this = K): [B, Hkv, n, D]. `start` is
        0 for one sequence, minus each row's left padding [B] for a batch cache.

        The rotated bias depends on the position alone, so it is read from a table that only
        the new positions extend (`_k_offset_rows`): a decode step rotates no rows of the
        context. A batch's slot 0 sits at -left_padding <= 0, so its positions are below n;
        padding slots (negative positions) read position 0, and the mask hides them."""
        if isinstance(start, int):
            return self._k_offset_rows(start + n, dtype)[:, :, start : start + n]
        pos = mx.maximum(start[:, None] + mx.arange(n), 0)  # [B, n]
        table = self._k_offset_rows(n, dtype)[0]  # [Hkv, >= n, D]
        return mx.take(table, pos, axis=1).transpose(1, 0, 2, 3)

    def _k_offset_rows(self, end: int, dtype: mx.Dtype) -> mx.array:
        """The rotated k bias at positions [0, end) and maybe a few more: [1, Hkv, >= end, D].
        Missing positions are rotated K_OFFSET_STEP at a time and appended, so decode rotates
        one step of rows every K_OFFSET_STEP tokens, whatever the context. A new bias array
        (weights loaded) or dtype starts over. The underscore keeps it out of the parameters."""
        key = (id(self.k_proj.bias), dtype)
        have = self._k_offset_table[1] if self._k_offset_table[0] == key else None
        done = 0 if have is None else have.shape[2]
        if done < end:
            upto = -(-end // K_OFFSET_STEP) * K_OFFSET_STEP
            bias = self.k_proj.bias.reshape(1, self.n_kv_heads, 1, -1)
            fresh = mx.broadcast_to(bias, (1, self.n_kv_heads, upto - done, self.head_dim))
            rows = self._rotate(fresh.astype(dtype), done)
            have = rows if have is None else mx.concatenate([have, rows], axis=2)
            self._k_offset_table = (key, have)
        return have

    def __call__(
        self, x: mx.array, mask: Any, cache: NestedKVCache, o: RunOptions, residual: mx.array
    ) -> mx.array:
        """residual + attention(x): the residual joins o_proj's output."""
        B, L, _ = x.shape
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        if self.k_bias_offset:
            q, k, v = project(x, qkv, o)
            # Qwen2's k bias (up to ~145) would set every token's KV scale: cache K without it.
            qk = mx.concatenate([q, k - self.k_proj.bias], axis=-1)
        else:
            qk, v = project(x, qkv, o, groups=(2, 1))  # q and k side by side: one RoPE
        qk = qk.reshape(B, L, self.n_heads + self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self._rotate_qk(qk, cache.offset, o)
        k_offset = None
        if self.k_bias_offset:  # cache.offset - cache.size(): the position of the cache's slot 0
            start = cache.offset - cache.size()
            k_offset = self._k_offset(cache.size() + L, start, k.dtype)
        out = cache.attend(
            q,
            k,
            v,
            scale=self.scale,
            mask=mask,
            draft=o.reads_kv4,  # the KV read: a draft may read KV8 (RunOptions.draft_kv)
            k_offset=k_offset,
            use_kernels=o.use_kernels,
        )
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out, o, a8_group=self.o_proj_group, residual=residual)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        d, n = args.hidden_size, args.intermediate_size
        self.gate_proj = DualPlaneLinear(d, n, group_size=args.group_size)
        self.up_proj = DualPlaneLinear(d, n, group_size=args.group_size)
        self.down_proj = DualPlaneLinear(n, d, group_size=args.group_size)
        r4 = args.r4[layer] if args.r4 else None
        self.r4 = OnlineHadamard(n, r4["K"], r4.get("fp32", False)) if r4 else None

    def __call__(self, x: mx.array, o: RunOptions, residual: mx.array) -> mx.array:
        """residual + MLP(x): the residual joins down_proj's output."""
        a = swiglu(x, self.gate_proj, self.up_proj, o)  # silu(x·gateᵀ) · (x·upᵀ)
        if self.r4 is not None:
            a = self.r4(a)
        return self.down_proj(a, o, residual=residual)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args, layer)
        self.eps = args.rms_norm_eps
        # The gammas are folded into the Linears that read them; a smoothed package's norms carry
        # a smoothing vector instead (its inverse is in those Linears). None: weightless.
        d = args.hidden_size
        self.input_layernorm = mx.ones((d,)) if args.smoothing else None
        self.post_attention_layernorm = mx.ones((d,)) if args.smoothing else None

    def __call__(self, h: mx.array, mask: Any, cache: NestedKVCache, o: RunOptions) -> mx.array:
        x = mx.fast.rms_norm(h, self.input_layernorm, self.eps)
        h = self.self_attn(x, mask, cache, o, residual=h)
        return self.mlp(mx.fast.rms_norm(h, self.post_attention_layernorm, self.eps), o, h)


class Model(nn.Module):
    """mlx-lm style: `model(inputs [B, T], cache) -> logits [B, T, V]`, `make_cache()`, `layers`.

    `options` (RunOptions) are the defaults of every call; `mode` ("draft" | "target") selects
    the planes read by weights and KV, settable here or per call (`model(x, cache, "draft")`).
    """

    supports_draft = True  # one set of weights, two readings: self-speculation is possible

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.lm_head = DualPlaneLinear(
            args.hidden_size, args.vocab_size, group_size=args.group_size
        )
        # The draft's lm_head over the package's reduced vocabulary (§2.9), or None: all rows.
        self.draft_head = None
        if args.draft_vocab:
            self.draft_head = DraftVocabHead(
                args.hidden_size, args.vocab_size, args.draft_vocab, args.group_size
            )
        self.norm = mx.ones((args.hidden_size,)) if args.smoothing else None  # as in the layers
        self.options = RunOptions()

    @property
    def mode(self) -> str:
        return self.options.mode

    @mode.setter
    def mode(self, value: str) -> None:
        self.options = replace(self.options, mode=value)

    def __call__(
        self,
        inputs: mx.array,
        cache: list | None = None,
        mode: str | None = None,
        *,
        options: RunOptions | None = None,
    ) -> mx.array:
        o = options or self.options
        if mode is not None:
            o = replace(o, mode=mode)
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = self.make_cache(o)
        mask = create_attention_mask(h, cache[0])
        skip = o.draft_skip if o.draft else ()
        for i, (layer, c) in enumerate(zip(self.layers, cache)):
            if i in skip:
                c.skip(h.shape[1])
                continue
            h = layer(h, mask, c, o)
        h = mx.fast.rms_norm(h, self.norm, self.args.rms_norm_eps)
        if o.draft and o.draft_vocab and self.draft_head is not None:
            return self.draft_head(h, o)
        return self.lm_head(h, o)

    def make_cache(self, options: RunOptions | None = None) -> list[NestedKVCache]:
        quantized = (options or self.options).quantize_kv
        return [NestedKVCache(self.args.kv_group, quantized=quantized) for _ in self.layers]

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
        if self.args.draft_vocab:
            out.update(DraftVocabHead.prepare(tensors, tensors[DRAFT_VOCAB], "draft_head", dtype))
        if self.args.smoothing:  # norm weights are parameters only in a smoothed package
            for name in norm_names(self.args.num_hidden_layers):
                out[name.removesuffix(".weight")] = tensors[name].astype(dtype)
        return {k.removeprefix("model."): v for k, v in out.items()}
