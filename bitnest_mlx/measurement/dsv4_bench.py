"""DeepSeek-V4 measurements behind `bench --json` (bitnest_mlx/cli/bench.py).

* `memory_probe`: peak RSS (ru_maxrss) of a fresh process that loads a bundle and runs one
  decode step, beside the bundle's bytes on disk, its routed-expert code bytes and the budget.
* `decode_bytes`: bytes of weights one decode token reads (routed experts: top-k per layer).
* `part_times`: one decode step split by part (router, indexer, compressor, routed experts,
  shared expert, hyper-connections, attention, the rest).
* `expert_peers`: the MXTQ routed experts of one layer at the bundle's shapes beside mlx-lm's
  affine 2- and 4-bit SwitchGLU, random weights, same routing.

Numbers from these go to docs/deepseek-v4.md, with the commands that made them.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..formats import dsv4_bundle
from ..layers.expert_store import tensor_ranges
from ..layers.mxtq_linear import MXTQSwitchLinear, routed_glu
from ..models import deepseek_v4 as dsv4_model
from ..models import deepseek_v4_attention as dsv4_attention


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


_ITEMSIZE = {"U8": 1, "I8": 1, "BOOL": 1, "F16": 2, "BF16": 2, "U16": 2, "I16": 2, "U32": 4,
             "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}  # fmt: skip


def bundle_bytes(path: str | Path) -> dict:
    """Tensor bytes of a bundle: all, routed-expert codes (`tq_packed`, what a budget caches),
    and the rest; plus the safetensors files' size on disk."""
    ranges = tensor_ranges(path)
    total = experts = 0
    for key, (_, _, dtype, shape) in ranges.items():
        n = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE[dtype]
        total += n
        experts += n if key.endswith(".tq_packed") else 0
    files = {f for f, *_ in ranges.values()}
    return {
        "tensor_bytes": total,
        "file_bytes": sum(f.stat().st_size for f in files),
        "expert_code_bytes": experts,
        "non_expert_bytes": total - experts,
    }


def _probe(path: str, max_expert_memory: float | None) -> None:
    """The child of `memory_probe`: load, one decode step, print peak RSS as JSON."""
    from ..runtime.loader import load

    before = peak_rss_bytes()
    model, _ = load(path, max_expert_memory=max_expert_memory)
    loaded = peak_rss_bytes()
    cache = model.make_cache()
    mx.eval(model(mx.array([[2]]), cache))
    print(
        json.dumps(
            {"rss_after_imports": before, "rss_after_load": loaded, "peak": peak_rss_bytes()}
        )
    )


def memory_probe(path: str | Path, max_expert_memory: float | None = None) -> dict:
    """Peak RSS of a fresh process after load + one decode step, against the bundle's bytes.

    A subprocess, so the number is that of a load and nothing else this process did before.
    The bundle is validated here first (lazily: no tensor data is read), so a broken one is
    this process's one-line BundleError rather than a failed child."""
    dsv4_bundle.read(path)
    code = (
        "from bitnest_mlx.measurement.dsv4_bench import _probe; "
        f"_probe({str(path)!r}, {max_expert_memory!r})"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    rss = json.loads(out.strip().splitlines()[-1])
    sizes = bundle_bytes(path)
    result = {
        **sizes,
        "max_expert_memory_gb": max_expert_memory,
        **{f"{k}_bytes": v for k, v in rss.items()},
    }
    result["peak_over_tensor_bytes"] = rss["peak"] / sizes["tensor_bytes"]
    if max_expert_memory is not None:
        allowed = sizes["non_expert_bytes"] + max_expert_memory * 1e9
        result["peak_over_non_expert_plus_budget"] = rss["peak"] / allowed
    return result


def decode_bytes(model: nn.Module) -> dict:
    """Weight bytes one decode token reads: every resident weight but the embedding (one row)
    and the routed experts (top-k of them per layer), plus those k experts' codes and norms."""
    k = model.args.num_experts_per_tok
    params = dict(tree_flatten(model.parameters()))
    dense = embed = 0
    for name, a in params.items():
        if name.startswith("embed."):
            embed += a.nbytes // a.shape[0]  # one row of each embedding part
        elif ".switch_mlp." not in name:
            dense += a.nbytes
    routed = 0
    for layer in model.layers:
        if layer is None:
            continue
        for proj in ("gate_proj", "up_proj", "down_proj"):
            sw = getattr(layer.ffn.switch_mlp, proj)
            if isinstance(sw, MXTQSwitchLinear):
                codes = sw.out_features * sw.in_features * sw.bits // 8
                routed += k * (codes + 2 * sw.out_features)
            else:
                routed += k * sw.weight[0].nbytes
    return {"non_expert": dense + embed, "routed_experts": routed, "total": dense + embed + routed}


# ---------------------------------------------------------------- per-part timing

PARTS = {  # part: the methods whose time (exclusive of nested parts) it gets
    "router": [(dsv4_model.Gate, "__call__")],
    "indexer": [(dsv4_attention.Indexer, "__call__")],
    "compressor": [(dsv4_attention.Compressor, "__call__")],
    "routed_experts": [(dsv4_model.SwitchMLP, "__call__")],
    "shared_expert": [(dsv4_model.SharedExpert, "__call__")],
    "hyper_connections": [(dsv4_model.Block, "_hc_pre"), (dsv4_model.Block, "_hc_post")],
    "attention": [(dsv4_model.Attention, "__call__")],
}


@contextmanager
def _timed(totals: dict[str, float]) -> Iterator[None]:
    """Time the PARTS methods while inside: each call evaluates its inputs first and its output
    before the clock stops; nested parts are subtracted from their parent. The model code has
    no timers of its own, so this patches the classes for the duration and restores them."""
    stack: list[float] = []
    saved = []

    def wrap(part, fn):
        def timed(*args, **kwargs):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            stack.append(0.0)
            tic = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(out)
            spent = time.perf_counter() - tic
            totals[part] += spent - stack.pop()
            if stack:
                stack[-1] += spent
            return out

        return timed

    try:
        for part, targets in PARTS.items():
            for cls, attr in targets:
                raw = cls.__dict__[attr]
                saved.append((cls, attr, raw))
                if isinstance(raw, staticmethod):
                    setattr(cls, attr, staticmethod(wrap(part, raw.__func__)))
                else:
                    setattr(cls, attr, wrap(part, raw))
        yield
    finally:
        for cls, attr, raw in reversed(saved):
            setattr(cls, attr, raw)


def part_times(model: nn.Module, context: int = 16, steps: int = 3, seed: int = 0) -> dict:
    """Milliseconds per decode step by part, after a `context`-token prefill (mean of `steps`
    steps). `other` is the step's wall time minus the parts: embedding, final collapse, norms,
    head, the MoE's SwiGLU and sums. `unsplit_ms`: the same step without the per-part syncs."""
    rng = np.random.default_rng(seed)
    vocab = model.args.vocab_size
    tokens = mx.array(rng.integers(2, vocab, (1, context + 2 * steps + 1)))
    cache = model.make_cache()
    mx.eval(model(tokens[:, :context], cache))
    mx.eval(model(tokens[:, context : context + 1], cache))  # warm-up step
    totals: dict[str, float] = defaultdict(float)
    wall = 0.0
    with _timed(totals):
        for i in range(steps):
            tic = time.perf_counter()
            mx.eval(model(tokens[:, context + 1 + i : context + 2 + i], cache))
            wall += time.perf_counter() - tic
    plain = 0.0
    for i in range(steps):
        tic = time.perf_counter()
        mx.eval(model(tokens[:, context + 1 + steps + i : context + 2 + steps + i], cache))
        plain += time.perf_counter() - tic
    ms = {part: 1e3 * totals[part] / steps for part in PARTS}
    ms["other"] = 1e3 * wall / steps - sum(ms.values())
    return {
        "context": context,
        "steps": steps,
        "ms": ms,
        "split_ms": 1e3 * wall / steps,
        "unsplit_ms": 1e3 * plain / steps,
    }


# ---------------------------------------------------------------- routed experts vs mlx-lm


def _random_mxtq(d: int, h: int, e: int, bits: tuple[int, int, int], seed: int):
    """gate, up, down MXTQ stacks with random codes and unit-ish norms."""
    keys = mx.random.split(mx.random.key(seed), 6)
    layers = []
    for i, (fin, fout, b) in enumerate(((d, h, bits[0]), (d, h, bits[1]), (h, d, bits[2]))):
        sw = MXTQSwitchLinear(fin, fout, e, b)
        sw.tq_packed = mx.random.randint(0, 2**31, sw.tq_packed.shape, key=keys[2 * i]).astype(
            mx.uint32
        )
        sw.tq_norms = mx.random.uniform(0.9, 1.1, sw.tq_norms.shape, key=keys[2 * i + 1]).astype(
            mx.float16
        )
        layers.append(sw)
    mx.eval([(s.tq_packed, s.tq_norms) for s in layers])
    return layers


def _random_switch_glu(d: int, h: int, e: int, bits: int, seed: int):
    """mlx-lm's SwitchGLU quantized (affine, group 64, or 32 where a tiny width needs it) with
    random codes, never float weights."""
    from mlx_lm.models.switch_layers import SwitchGLU

    glu = SwitchGLU(d, h, e)
    group = 64 if d % 64 == 0 and h % 64 == 0 else 32
    nn.quantize(glu, group_size=group, bits=bits)  # lazy: the float init is never evaluated
    keys = mx.random.split(mx.random.key(seed), 3)
    for key, proj in zip(keys, (glu.gate_proj, glu.up_proj, glu.down_proj)):
        proj.weight = mx.random.randint(0, 2**31, proj.weight.shape, key=key).astype(mx.uint32)
        scale = 2 * np.sqrt(3) / np.sqrt(proj.input_dims) / (2**bits - 1)
        proj.scales = mx.full(proj.scales.shape, scale, mx.float32)
        proj.biases = mx.full(proj.biases.shape, -scale * (2**bits - 1) / 2, mx.float32)
    mx.eval(glu.parameters())
    return glu


def _time_calls(fn, xs, idxs) -> float:
    """Seconds per call, after one warm-up call."""
    mx.eval(fn(xs[0], idxs[0]))
    tic = time.perf_counter()
    for x, idx in zip(xs[1:], idxs[1:]):
        mx.eval(fn(x, idx))
    return (time.perf_counter() - tic) / (len(xs) - 1)


def expert_peers(model: nn.Module, experts: int = 32, calls: int = 20, seed: int = 0) -> dict:
    """One layer's routed experts for one decode token (gate, up, SwiGLU, down, sum over top-k)
    at the model's shapes: MXTQ at the bit plan of the model's last layer, all-2 and all-4 bit,
    beside mlx-lm's SwitchGLU at affine 2 and 4 bits. Random weights and routing; `experts`
    experts per stack (per-token work does not depend on it; the stacks stay far larger than
    the CPU caches), built one at a time so at most one is resident."""
    a = model.args
    d, h, k = a.hidden_size, a.moe_intermediate_size, a.num_experts_per_tok
    e = min(experts, a.n_routed_experts)
    rng = np.random.default_rng(seed)
    idxs = [mx.array(rng.permutation(e)[:k][None, None].astype(np.uint32)) for _ in range(calls)]
    xs = [mx.array(rng.standard_normal((1, 1, d)).astype(np.float32)) for _ in range(calls)]
    last = next(layer for layer in reversed(model.layers) if layer is not None)
    plan = tuple(
        getattr(getattr(last.ffn.switch_mlp, p), "bits", 4)
        for p in ("gate_proj", "up_proj", "down_proj")
    )

    def mxtq_call(layers):
        g, u, dn = layers

        def call(x, idx):
            # The model's path (one rotation of x, fused gate/up on Metal), without clamp or
            # route weight like the mlx-lm peer.
            y = routed_glu(g, u, dn, x[..., None, None, :], idx, mx.ones(idx.shape), 0.0)
            return y.squeeze(-2).sum(-2)

        return call

    def glu_call(glu):
        return lambda x, idx: glu(x, idx).sum(-2)

    ms = {}
    for name, bits in (
        (f"mxtq_{'/'.join(map(str, plan))}", plan),
        ("mxtq_2", (2, 2, 2)),
        ("mxtq_4", (4, 4, 4)),
    ):
        layers = _random_mxtq(d, h, e, bits, seed)
        ms[name] = 1e3 * _time_calls(mxtq_call(layers), xs, idxs)
        del layers
    for bits in (2, 4):
        glu = _random_switch_glu(d, h, e, bits, seed)
        ms[f"mlx_lm_affine_{bits}"] = 1e3 * _time_calls(glu_call(glu), xs, idxs)
        del glu
    plan_name = f"mxtq_{'/'.join(map(str, plan))}"
    return {
        "shapes": {"hidden": d, "intermediate": h, "top_k": k, "experts_built": e},
        "ms_per_layer_token": ms,
        "tps_per_layer": {n: 1e3 / v for n, v in ms.items()},
        "speed_vs_mlx_lm_affine_4": {n: ms["mlx_lm_affine_4"] / v for n, v in ms.items()},
        "plan": plan_name,
    }


def decode_run(model: nn.Module, prompt: mx.array, n: int) -> dict:
    """Greedy decode of `n` tokens after a prefill of `prompt`: tok/s and, with an expert
    budget, the store's hit rate and disk bytes per decoded token (prefill not counted)."""
    cache = model.make_cache()
    logits = model(prompt[None], cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    store = getattr(model, "expert_store", None)
    if store is not None:
        store.reset_stats()
    tic = time.perf_counter()
    for _ in range(n):
        token = mx.argmax(model(token[:, None], cache)[:, -1], axis=-1)
        mx.eval(token)
    out = {"tokens": n, "tps": n / (time.perf_counter() - tic)}
    if store is not None:
        s = store.stats()
        out["expert_store"] = {
            **s,
            "bytes_read_per_token": s["bytes_read"] / n,
            "misses_per_token": s["misses"] / n,
        }
    return out


def report(r: dict) -> str:
    """The DeepSeek-V4 lines of `bench`'s text report (after its one-line summary)."""
    lines = [""]
    m, d = r.get("memory"), r["decode"]
    if m:
        lines.append(
            f"peak RSS load + 1 decode step {m['peak_bytes'] / 1e9:.3f} GB = "
            f"{m['peak_over_tensor_bytes']:.3f}x tensor bytes {m['tensor_bytes'] / 1e9:.3f} GB"
            + (
                f", {m['peak_over_non_expert_plus_budget']:.3f}x non-expert + budget"
                if "peak_over_non_expert_plus_budget" in m
                else ""
            )
        )
    lines.append(
        f"decode {d['tps']:.2f} tok/s; weights per token "
        f"{r['decode_bytes_per_token']['total'] / 1e6:.1f} MB"
    )
    if "expert_store" in d:
        s = d["expert_store"]
        lines.append(
            f"expert store: hit rate {s['hit_rate']:.1%}, "
            f"{s['bytes_read_per_token'] / 1e6:.1f} MB read per token"
        )
    if r.get("parts"):
        lines.append(
            "decode ms by part: " + ", ".join(f"{k} {v:.1f}" for k, v in r["parts"]["ms"].items())
        )
    if r.get("experts_vs_mlx_lm"):
        e = r["experts_vs_mlx_lm"]
        lines.append(
            "routed experts ms per layer-token: "
            + ", ".join(f"{k} {v:.2f}" for k, v in e["ms_per_layer_token"].items())
        )
    return "\n".join(lines)


__all__ = [
    "bundle_bytes",
    "decode_bytes",
    "decode_run",
    "expert_peers",
    "memory_probe",
    "part_times",
    "report",
]
