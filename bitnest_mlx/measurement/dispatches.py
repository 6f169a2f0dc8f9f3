"""Kernels per decode token on the GPU basis (`bench --dispatches`): bitnest steps and rounds,
a DeepSeek-V4 step, and mlx-lm's own models on the same configs, counted the same way.

Each count builds one step after a short prefill, in float16 (the dtype the loader picks on
Metal), under `dispatch_graph.gpu_basis` (each `mx.fast` op and Metal kernel launch one
kernel). Per layer is the model at `hi` layers minus the model at `lo` layers over `hi - lo`;
outside is the rest. The kernel path is counted as a Mac runs it after every self-test passed
(`kernels.use` answers yes); the pure path is the fallback. Nothing is read from a table.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from .. import kernels
from ..layers import dual_plane
from ..layers.hadamard import OnlineHadamard
from ..layers.nested_kv import NestedKVCache
from ..layers.options import RunOptions
from ..runtime.rounds import SpeculationPolicy, SpeculativeRun
from ..runtime.sampling import Sampler
from ..runtime.speed_model import CostModel
from . import dispatch_graph as dg

DTYPE = mx.float16
PREFILL = 8  # tokens in the cache before the counted step
BASIS = (
    "GPU basis: every non-view MLX primitive of the step's graph is one kernel, each mx.fast op "
    "and each mx.fast.metal_kernel launch one kernel (stand-ins of the right shapes, counted "
    "on this machine's CPU backend); float16; per layer = (model at hi layers - at lo) / "
    "(hi - lo); syncs = host reads (mx.eval, item, tolist) of unevaluated work"
)
VERIFY_ROWS = (2, 4, 8)
ROUND_GAMMA = 3


@dataclass(frozen=True)
class Count:
    """One step's kernels: per layer, outside the layers, each by part; host syncs."""

    per_layer: float
    outside: float
    per_layer_parts: dict[str, float]
    outside_parts: dict[str, float]
    syncs: int = 0

    def per_token(self, layers: int) -> float:
        """Kernels of the whole step at `layers` layers (step_time.Step's kernels)."""
        return self.per_layer * layers + self.outside

    def as_dict(self) -> dict:
        return {
            "per_layer": self.per_layer,
            "outside": self.outside,
            "per_layer_parts": self.per_layer_parts,
            "outside_parts": self.outside_parts,
            "syncs": self.syncs,
        }


def difference(hi: Counter, lo: Counter, layers: tuple[int, int], syncs: int = 0) -> Count:
    """Per layer and outside from the counts of the same step at `layers` = (hi, lo) layers."""
    n_hi, n_lo = layers
    span = n_hi - n_lo
    parts = sorted(set(hi) | set(lo))
    per = {p: (hi[p] - lo[p]) / span for p in parts}
    out = {p: lo[p] - per[p] * n_lo for p in parts}
    return Count(
        per_layer=sum(per.values()),
        outside=sum(out.values()),
        per_layer_parts={p: v for p, v in per.items() if v},
        outside_parts={p: v for p, v in out.items() if v},
        syncs=syncs,
    )


# ---------------------------------------------------------------------------------------------
# bitnest


def _store_result(cache, *args, **kwargs):
    return [*cache.keys, *cache.values]


def bitnest_parts() -> list[tuple]:
    """The functions whose calls make up each part of a bitnest forward (dispatch_graph.part)."""
    from ..models.bitnest_llama import Attention as attention

    return [
        (dual_plane, "a8", "a8"),
        (dual_plane, "_finish", lambda lins, y, path, up, *_: "mlp" if up else "projection"),
        (dual_plane, "_through", "projection"),
        (attention, "_rotate", "rope"),
        (attention, "_rotate_qk", "rope"),
        (attention, "_k_offset", "rope"),
        (OnlineHadamard, "__call__", "mlp"),
        (NestedKVCache, "_store", "kv_write", _store_result),
        (NestedKVCache, "attend", "attention"),
    ]


def bitnest_at(args, layers: int) -> nn.Module:
    """A bitnest Model of `args` cut to its first `layers` layers (weights all zero)."""
    from ..models import bitnest_llama

    prefixes = tuple(f"model.layers.{i}." for i in range(layers))
    cut = bitnest_llama.ModelArgs.from_dict(
        {
            **args.to_dict(),
            "num_hidden_layers": layers,
            "r4": list(args.r4[:layers]),
            "biased": [b for b in args.biased if b.startswith(prefixes)],
        }
    )
    model = bitnest_llama.Model(cut)
    model.set_dtype(DTYPE)
    mx.eval(model.parameters())
    return model


def _prompt(model: nn.Module, n: int = PREFILL) -> mx.array:
    return mx.arange(1, n + 1, dtype=mx.uint32) % model.args.vocab_size


def _prefilled(model: nn.Module, options: RunOptions | None) -> list:
    """A cache (the model's own kind, as mlx-lm makes it) holding PREFILL tokens, written on the
    pure path; `options` None: an mlx-lm model, which takes none."""
    cache = make_prompt_cache(model)
    kw = {} if options is None else {"options": replace(options, use_kernels=False)}
    model(_prompt(model)[None], cache, **kw)
    mx.eval([c.state for c in cache])
    return cache


Run = Callable[[nn.Module, list, RunOptions, dg.Ledger], list]


def _held_arrays(model: nn.Module) -> list[mx.array]:
    """Every array the model's modules hold: parameters and what calls cache on them."""
    held = []
    for m in model.modules():
        held += dg.arrays_in(list(m.values())) + dg.arrays_in(list(vars(m).values()))
    return held


def measure(
    model: nn.Module, run: Run, *, kernel: bool, parts: list, prefilled: list | None = None
) -> tuple[Counter, int]:
    """(kernels by part, host syncs) of `run(model, cache, options, ledger)` after a prefill:
    what it launched plus what its returned arrays and the cache still need. A first call,
    not counted, does the once-per-model work (the kernel path's plane stacks). `prefilled`:
    the model's `_prefilled` cache, made once for several steps (each runs on a copy of it:
    at a 3B's dims the pure prefill is most of a count's time)."""
    options = replace(model.options, use_kernels=kernel) if hasattr(model, "options") else None
    with mock.patch.object(kernels, "use", lambda name, test: kernel):
        prefilled = prefilled or _prefilled(model, options)
        cache = copy.deepcopy(prefilled)
        with dg.gpu_basis(parts=parts) as warm:
            run(model, cache, options, warm)
            # What the first call left on the model (plane stacks, rotated-bias tables) is made
            # real, its outputs are not: at a 3B's dims computing them takes minutes of CPU.
            mx.eval(_held_arrays(model))
        cache = copy.deepcopy(prefilled)
        with dg.gpu_basis(parts=parts) as ledger:
            pending = run(model, cache, options, ledger)
            states = [a for c in cache for a in c.state]
            return ledger.by_part([*dg.arrays_in(pending), *states]), len(ledger.syncs)


def sampled(ledger: dg.Ledger, sampler: Sampler, logits: mx.array) -> list[mx.array]:
    """The step's sampling as mlx-lm's generate_step does it: log-probabilities, a token."""
    lp = sampler.logprobs(logits)
    token = sampler.sample(lp[-1:])
    ledger.claim("sampling", [logits], [lp, token])
    return [lp, token]


def bitnest_step(mode: str, rows: int = 1) -> Run:
    """A decode step (rows = 1) or a verify pass (rows > 1) with its sampling."""

    def run(model, cache, options, ledger):
        tokens = mx.zeros((1, rows), dtype=mx.uint32)
        logits = model(tokens, cache, options=replace(options, mode=mode))[0]
        return sampled(ledger, Sampler(), logits)

    return run


def bitnest_round(gamma: int = ROUND_GAMMA) -> Run:
    """One speculative round as the loop runs it: γ W4 drafts, the W8 verify pass of γ + 1
    rows, acceptance and commit (greedy, fixed γ, the model's chain, planned costs; a run that
    times its draft and verify apart syncs once more a round)."""

    def run(model, cache, options, ledger):
        policy = SpeculationPolicy(
            num_draft_tokens=gamma,
            adaptive=False,
            fallback=False,
            draft_source="model",
            cost_model=CostModel(0.5),  # planned costs: no round is timed apart
        )
        prompt = _prompt(model, PREFILL + 1)
        dg._EVAL(prompt)  # the harness's input, not a read of the round's: no sync counted
        loop = SpeculativeRun.start(model, prompt, policy, prompt_cache=cache, options=options)
        _, logprobs, _ = loop.round(prompt[-1:], 0, -1)
        return [logprobs]

    return run


def count_bitnest(args, layers: tuple[int, int] = (2, 1)) -> dict:
    """Every bitnest step on both paths: {path: {step: Count}}."""
    steps = {
        "draft": bitnest_step("draft"),
        "target": bitnest_step("target"),
        **{f"verify_{m}": bitnest_step("target", m) for m in VERIFY_ROWS},
        f"round_gamma_{ROUND_GAMMA}": bitnest_round(),
    }
    built = {n: bitnest_at(args, n) for n in layers}
    prefilled = {n: _prefilled(m, m.options) for n, m in built.items()}  # pure: either path's
    out = {}
    for path, kernel in (("kernel", True), ("pure", False)):
        out[path] = {}
        for name, run in steps.items():
            # A round's calls write the cache several times over: its parts would overlap.
            parts = [] if name.startswith("round") else bitnest_parts()
            (hi, syncs), (lo, _) = (
                measure(built[n], run, kernel=kernel, parts=parts, prefilled=prefilled[n])
                for n in layers
            )
            out[path][name] = difference(hi, lo, layers, syncs)
    return out


# ---------------------------------------------------------------------------------------------
# mlx-lm's models on the same configs, and DeepSeek-V4


def mlx_lm_parts() -> list[tuple]:
    return [
        (nn.QuantizedLinear, "__call__", "projection"),
        (KVCache, "update_and_fetch", "kv_write"),
    ]


def mlx_lm_step(model, cache, options, ledger):
    """mlx-lm's generate_step: one token, its log-probabilities and argmax."""
    logits = model(mx.zeros((1, 1), dtype=mx.uint32), cache)[0]
    return sampled(ledger, Sampler(), logits)


def llama_peer_at(args, layers: int, bits: int) -> nn.Module:
    """mlx-lm's Llama on a bitnest package's dims, `layers` layers, nn.quantize at `bits`."""
    from .bench_measure import mlx_lm_peer

    return mlx_lm_peer(replace(args, num_hidden_layers=layers), bits, DTYPE)


def count_mlx_lm_llama(args, bits: int, layers: tuple[int, int] = (2, 1)) -> Count:
    (hi, _), (lo, _) = (
        measure(llama_peer_at(args, n, bits), mlx_lm_step, kernel=False, parts=mlx_lm_parts())
        for n in layers
    )
    return difference(hi, lo, layers)


def cut_dsv4(model: nn.Module, layers: int) -> nn.Module:
    """A DeepSeek-V4 model cut to its first `layers` layers (in place)."""
    from ..layers.pipeline import PipelineStage

    model.layers = model.layers[:layers]
    model.stage = PipelineStage.whole(layers)
    return model


def dsv4_step(model, cache, options, ledger):
    logits = model(mx.zeros((1, 1), dtype=mx.uint32), cache, options=options)[0]
    return sampled(ledger, Sampler(), logits)


def count_dsv4(path, layers: tuple[int, int] = (6, 3)) -> dict:
    """A DeepSeek-V4 decode step on both paths: {path: Count}. The bundle is read once and
    cut to `layers[0]`, then to `layers[1]` layers."""
    from ..runtime.loader import load_model

    model = load_model(path, dtype=DTYPE)
    paths = (("kernel", True), ("pure", False))
    counts = {}  # (layers, path) -> (kernels by part, syncs)
    for n in sorted(layers, reverse=True):
        cut_dsv4(model, n)
        for name, kernel in paths:
            counts[n, name] = measure(model, dsv4_step, kernel=kernel, parts=[])
    out = {}
    for name, _ in paths:
        (hi, syncs), (lo, _) = (counts[n, name] for n in layers)
        out[name] = difference(hi, lo, layers, syncs)
    return out


def deepseek_v3_peer_at(config: dict, layers: int) -> nn.Module:
    """mlx-lm's `deepseek_v3` on a DeepSeek-V4 config's dims (every layer MoE), 4-bit."""
    from mlx_lm.models import deepseek_v3

    c = config
    model = deepseek_v3.Model(
        deepseek_v3.ModelArgs(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["moe_intermediate_size"] * c.get("n_shared_experts", 1),
            moe_intermediate_size=c["moe_intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_attention_heads"],
            n_shared_experts=c.get("n_shared_experts", 1),
            n_routed_experts=c["n_routed_experts"],
            num_experts_per_tok=c["num_experts_per_tok"],
            kv_lora_rank=c["q_lora_rank"],
            q_lora_rank=c["q_lora_rank"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            qk_nope_head_dim=c["head_dim"] - c["qk_rope_head_dim"],
            v_head_dim=c["head_dim"],
            rms_norm_eps=c["rms_norm_eps"],
            first_k_dense_replace=0,
        )
    )
    model.set_dtype(DTYPE)
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def count_deepseek_v3(config: dict, layers: tuple[int, int] = (6, 3)) -> Count:
    (hi, _), (lo, _) = (
        measure(deepseek_v3_peer_at(config, n), mlx_lm_step, kernel=False, parts=mlx_lm_parts())
        for n in layers
    )
    return difference(hi, lo, layers)


# ---------------------------------------------------------------------------------------------
# mlx-lm's qwen3 at a published model's dims: the kernel count the step-time fit reads
# (measurement/step_fit.py, docs/step-time.md).

# mlx-lm >= 0.30.4 (its PR #753): one compiled SwiGLU; before: silu(gate) * up, two kernels
QWEN3_MLP = ("swiglu", "silu_mul")


def _silu_mul(self, x):
    # mlx-lm < 0.30.4's qwen3 MLP: nn.silu (compiled, one kernel) times up (one more)
    return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def qwen3_peer_at(config: dict, layers: int, bits: int | None, group_size: int = 64) -> nn.Module:
    """mlx-lm's `qwen3` on `config`'s dims (a Hugging Face config), `layers` layers, zero
    weights in bfloat16 (the published checkpoints' dtype), nn.quantize at `bits` (None: bf16)."""
    from mlx.utils import tree_map
    from mlx_lm.models import qwen3

    fields = set(qwen3.ModelArgs.__dataclass_fields__)
    args = qwen3.ModelArgs(**{k: v for k, v in config.items() if k in fields})
    args.num_hidden_layers = layers
    model = qwen3.Model(args)
    # Zeros, not random: the count reads shapes only, and drawing 4e8 weights takes seconds.
    model.update(tree_map(lambda a: mx.zeros(a.shape, mx.bfloat16), model.parameters()))
    if bits is not None:
        nn.quantize(model, group_size=group_size, bits=bits)
    mx.eval(model.parameters())
    return model


def mlx_lm_generate_step(model, cache, options, ledger):
    """One token of mlx-lm's generate_step at temperature 0: the model on last step's token (an
    evaluated array, as mlx-lm's pipelined loop feeds it), log-probabilities, argmax."""
    token = mx.array([[0]], dtype=mx.uint32)
    logits = model(token, cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    y = mx.argmax(logprobs, axis=-1)
    ledger.claim("sampling", [logits], [logprobs, y])
    return [y, logprobs]


def qwen3_parts() -> list[tuple]:
    return [
        *mlx_lm_parts(),
        (nn.Linear, "__call__", "projection"),  # bf16
        (nn.QuantizedEmbedding, "__call__", "embedding"),
        (nn.QuantizedEmbedding, "as_linear", "head"),
        (nn.Embedding, "__call__", "embedding"),
        (nn.Embedding, "as_linear", "head"),
    ]


def count_mlx_lm_qwen3(
    config: dict,
    bits: int | None,
    group_size: int = 64,
    layers: tuple[int, int] = (2, 1),
    mlp: str = "swiglu",
) -> Count:
    """Kernels of one mlx-lm decode token of `qwen3` at `config`'s dims (per layer, outside):
    nn.quantize at `bits` (None: bf16); `mlp` picks mlx-lm's MLP form (QWEN3_MLP)."""
    from mlx_lm.models import qwen3

    if mlp not in QWEN3_MLP:
        raise ValueError(f"mlp must be one of {QWEN3_MLP}, got {mlp!r}")
    call = _silu_mul if mlp == "silu_mul" else qwen3.MLP.__call__
    counts = []
    for n in layers:
        model = qwen3_peer_at(config, n, bits, group_size)
        with mock.patch.object(qwen3.MLP, "__call__", call):
            counts.append(measure(model, mlx_lm_generate_step, kernel=False, parts=qwen3_parts()))
        del model  # a real-dims model: free it before building the next
    (hi, _), (lo, _) = counts
    return difference(hi, lo, layers)
