"""`python -m bitnest_mlx.bench` (`bitnest-bench`): draft, target and speculative speed on a prompt.

Also runs the same shapes through mlx-lm's own Llama quantized with `nn.quantize` (the
package's weight group, 4 and 8 bits, random weights) on the same backend as a peer baseline,
and a bandwidth roofline: bytes read per generated token and the tok/s ceiling they imply on
Apple chips.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from .. import kernels
from ..hub import resolve
from ..measurement import dsv4_bench
from ..measurement.bench_measure import (
    bench_prompt,
    best_of,
    measure_generation,
    measure_prefill,
    mlx_lm_peer,
)
from ..measurement.roofline import CHIPS as CHIPS  # re-exported: the bench's face of the roofline
from ..measurement.roofline import roofline
from ..measurement.workloads import cost_models
from ..runtime import speculative
from ..runtime.chips import achieved_bandwidth, chip_peak
from ..runtime.demo import DEMO, resolve_model
from ..runtime.draft_kv import resolve_draft_kv
from ..runtime.loader import LOAD_ERRORS, load, supports_draft
from ..runtime.sampling import make_sampler
from ..runtime.speed_model import verify_table
from . import bench_modes
from .args import (
    Parser,
    add_draft_kv,
    add_draft_source,
    add_draft_vocab_join,
    add_verify,
    int_at_least,
    non_negative_float,
    non_negative_int,
    positive_int,
    refuse,
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m bitnest_mlx.bench",
        description="Benchmark draft-only, target-only and speculative decoding of a bitnest "
        "package against mlx-lm's Llama at 4 and 8 bits (default model: the demo).",
    )
    p.add_argument(
        "--model",
        default=DEMO,
        help="package directory, Hub id, or 'demo' (the shipped demo package; the default)",
    )
    at_least_2 = int_at_least(2)
    p.add_argument("--prompt-tokens", type=at_least_2, default=128, help="prompt length (>= 2)")
    p.add_argument("--gen-tokens", type=at_least_2, default=64, help="tokens per run (>= 2)")
    p.add_argument(
        "--num-draft-tokens", type=non_negative_int, default=3, help="maximum draft length (>= 0)"
    )
    p.add_argument(
        "--temp", type=non_negative_float, default=0.0, help="temperature (>= 0; 0 = greedy)"
    )
    p.add_argument(
        "--repeats", type=positive_int, default=1, help="runs per measurement, best kept (>= 1)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (>= 0)")
    add_draft_kv(p)
    add_draft_source(p)
    add_draft_vocab_join(p)
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm peer baseline")
    p.add_argument(
        "--max-expert-memory",
        type=non_negative_float,
        metavar="GB",
        help="DeepSeek-V4: keep routed experts on disk with an LRU of this many GB",
    )
    add_verify(p)
    p.add_argument(
        "--peer-experts",
        type=positive_int,
        default=32,
        help="DeepSeek-V4: experts per stack in the MXTQ vs mlx-lm SwitchGLU comparison",
    )
    p.add_argument(
        "--parts", action="store_true", help="DeepSeek-V4: time one decode step by model part"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_counts(p)
    bench_modes.add_arguments(p)
    bench_modes.add_dsv4_price(p)
    return p


def _add_counts(p: argparse.ArgumentParser) -> None:
    """The flags that count instead of running: `--dispatches` and `--kernels`."""
    p.add_argument(
        "--dispatches",
        action="store_true",
        help="instead of running: the kernels a Mac launches per decode token (per layer, "
        "outside the layers, by part; host syncs) for --model's draft and target steps, verify "
        "passes of 2/4/8 rows and a speculative round, on the kernel and the pure path, beside "
        "mlx-lm's Llama at 4 and 8 bits; and for the DeepSeek-V4 demo bundle (or --model's "
        "bundle) beside mlx-lm's deepseek_v3. --model may also name a convert make-checkpoint "
        "preset (llama-3.2-3b). Counted from the graph on the GPU basis (docs/bench.md)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="instead of a model: each Metal kernel's operation counts (CPU emulator; needs g++ "
        "and clang) as estimated cycles per weight against Apple GPUs' bandwidth budgets",
    )


def run(args: argparse.Namespace) -> dict:
    mx.random.seed(args.seed)
    model_path = str(resolve_model(args.model))
    memory = None
    if not supports_draft(resolve(model_path)):
        # Before this process loads anything: a second resident copy would not fit a big bundle.
        memory = dsv4_bench.memory_probe(resolve(model_path), args.max_expert_memory)
    model, tokenizer = load(
        model_path, max_expert_memory=args.max_expert_memory, verify=args.verify
    )
    prompt = bench_prompt(tokenizer, args.prompt_tokens, model.args.vocab_size)
    if not model.supports_draft:
        return run_single_precision(model, str(model_path), prompt, args, memory)
    return run_two_precisions(model, model_path, prompt, args)


def run_two_precisions(model: nn.Module, model_path: str, prompt: mx.array, args) -> dict:
    """Models with a draft and a target: prefill and generation of each mode, the speculative
    loop with and without fallback, the roofline and (unless --no-mlx-lm) mlx-lm's peers."""
    n, rep = args.gen_tokens, args.repeats
    dtype = model.embed_tokens.weight.dtype
    sampler = make_sampler(args.temp)
    context = prompt.size + n
    # Draft-only runs and the roofline read the KV the policy picks at the run's final context;
    # speculative runs decide each round.
    draft_kv = resolve_draft_kv(args.draft_kv, model, context)
    model.options = replace(model.options, draft_kv=draft_kv)
    spec_stats: dict[str, speculative.SpeculativeStats] = {}
    pp = {
        mode: best_of(lambda mode=mode: measure_prefill(model, prompt, mode=mode), rep, "tps")
        for mode in ("draft", "target")
    }
    runs = {
        "draft": _plain(model, prompt, n, args.temp, "draft"),
        "target": _plain(model, prompt, n, args.temp, "target"),
        "speculative": _spec(model, prompt, args, sampler, spec_stats, "speculative", False),
        "speculative_auto": _spec(
            model, prompt, args, sampler, spec_stats, "speculative_auto", True
        ),
    }
    gen = {k: best_of(lambda f=f: measure_generation(f, n), rep, "tps") for k, f in runs.items()}
    specs = {
        name: _spec_summary(
            spec_stats[name], gen[name]["tps"], gen["target"]["tps"], model, context
        )
        for name in ("speculative", "speculative_auto")
    }
    result = {
        **_describe(model, model_path, dtype, prompt, args),
        "verify_cost": verify_table(),
        "prompt_tps": {k: v["tps"] for k, v in pp.items()},
        "generation_tps": {k: v["tps"] for k, v in gen.items()},
        "peak_memory_gb": {
            **{f"prompt_{k}": v["peak_memory_gb"] for k, v in pp.items()},
            **{k: v["peak_memory_gb"] for k, v in gen.items()},
        },
        **specs,
        "roofline": roofline(model, context, draft_kv),
        # Which path served each kernel-capable op (Metal kernel or pure MLX), with call counts.
        "paths": kernels.report(),
    }
    peak = chip_peak()
    if peak is not None:
        per_token = result["roofline"]["bytes_per_token"]
        result["bandwidth"] = achieved_bandwidth(per_token, result["generation_tps"], peak)
    if not args.no_mlx_lm:
        result |= _mlx_lm_peers(model.args, dtype, prompt, n, rep, args.temp, pp, gen)
    return result


def _plain(
    m: nn.Module, prompt: mx.array, n: int, temp: float, mode: str | None = None
) -> Callable[[], Iterator]:
    """mlx-lm's own decoding loop; bitnest models in a fixed mode."""
    s = mlx_lm_make_sampler(temp)

    def steps():
        if mode is not None:
            m.mode = mode
        return generate_step(prompt, m, max_tokens=n, sampler=s)

    return steps


def _spec(
    model: nn.Module, prompt: mx.array, args, sampler, stats: dict, name: str, fallback: bool
) -> Callable[[], Iterator]:
    """The speculative loop as run `name`; each run leaves its counters in `stats[name]` (the
    last run's are kept)."""

    def steps():
        stats[name] = speculative.SpeculativeStats()
        return speculative.speculative_generate_step(
            prompt,
            model,
            max_tokens=args.gen_tokens,
            sampler=sampler,
            num_draft_tokens=args.num_draft_tokens,
            fallback=fallback,
            stats=stats[name],
            draft_kv=args.draft_kv,
            draft_source=args.draft_source,
            ngram_tokens=args.ngram_tokens,
            draft_vocab_join=args.draft_vocab_join == "on",
        )

    return steps


def _spec_summary(
    s: speculative.SpeculativeStats, tps: float, target_tps: float, model, context: int
) -> dict:
    return {
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted": s.mean_accepted,
        "mean_drafted": s.mean_drafted,
        "draft_s": s.draft_s,
        "verify_s": s.verify_s,
        "generation_tps": tps,
        "fallback": s.fallback,
        "speedup_vs_target": tps / target_tps,
        "sources": s.sources,
        "projected_speedup": {
            chip: {path: s.projected_speedup(cost) for path, cost in by_path.items()}
            for chip, by_path in cost_models(model, context).items()
        },
    }


def _describe(model: nn.Module, model_path: str, dtype, prompt: mx.array, args) -> dict:
    """The report's head: the model, backend, dims and the run's settings."""
    a = model.args
    dims = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads")
    dims += ("num_key_value_heads", "head_dim", "vocab_size")
    return {
        "model": str(model_path),
        "backend": "gpu" if mx.metal.is_available() else "cpu",
        "dtype": str(dtype),
        "dims": {key: getattr(a, key) for key in dims},
        "settings": {
            "prompt_tokens": prompt.size,
            "gen_tokens": args.gen_tokens,
            "num_draft_tokens": args.num_draft_tokens,
            "temp": args.temp,
            "repeats": args.repeats,
            "draft_kv": args.draft_kv,
            "draft_source": args.draft_source,
            "ngram_tokens": args.ngram_tokens,
            "draft_vocab_join": args.draft_vocab_join,
        },
    }


def _mlx_lm_peers(
    a, dtype, prompt: mx.array, n: int, rep: int, temp: float, pp: dict, gen: dict
) -> dict:
    """mlx-lm's Llama at 4 and 8 bits with these dims, and the package's speeds against them."""
    peers = {}
    for bits in (4, 8):
        peer = mlx_lm_peer(a, bits, dtype)
        g = best_of(lambda p=peer: measure_generation(_plain(p, prompt, n, temp), n), rep, "tps")
        peers[f"q{bits}"] = {
            "prompt_tps": best_of(lambda p=peer: measure_prefill(p, prompt), rep, "tps")["tps"],
            "generation_tps": g["tps"],
            "peak_memory_gb": g["peak_memory_gb"],
        }
    q4, q8 = peers["q4"], peers["q8"]
    ratios = {
        "draft_prompt_vs_q4": pp["draft"]["tps"] / q4["prompt_tps"],
        "target_prompt_vs_q8": pp["target"]["tps"] / q8["prompt_tps"],
        "draft_generation_vs_q4": gen["draft"]["tps"] / q4["generation_tps"],
        "target_generation_vs_q8": gen["target"]["tps"] / q8["generation_tps"],
        "speculative_generation_vs_q8": gen["speculative"]["tps"] / q8["generation_tps"],
    }
    return {"mlx_lm": peers, "ratios_vs_mlx_lm": ratios}


def run_single_precision(
    model: nn.Module, name: str, prompt: mx.array, args, memory: dict | None = None
) -> dict:
    """Models with one precision (DeepSeek-V4 MXTQ bundles): prefill and decode tok/s, peak
    RSS of load + one decode step (`memory`), weight bytes per token, the expert store's hit
    rate and disk bytes per token, a per-part decode timing and (unless --no-mlx-lm) the
    routed experts beside mlx-lm's SwitchGLU (bitnest_mlx/measurement/dsv4_bench.py)."""
    n, rep = args.gen_tokens, args.repeats
    sampler = mlx_lm_make_sampler(args.temp)
    pp = best_of(lambda: measure_prefill(model, prompt), rep, "tps")
    steps = lambda: generate_step(prompt, model, max_tokens=n, sampler=sampler)
    gen = best_of(lambda: measure_generation(steps, n), rep, "tps")
    return {
        "model": name,
        "model_type": model.model_type,
        "backend": "gpu" if mx.metal.is_available() else "cpu",
        "settings": {
            "prompt_tokens": prompt.size,
            "gen_tokens": n,
            "temp": args.temp,
            "repeats": rep,
        },
        "prompt_tps": pp["tps"],
        "generation_tps": gen["tps"],
        "peak_memory_gb": {"prompt": pp["peak_memory_gb"], "generation": gen["peak_memory_gb"]},
        "memory": memory,
        "decode_bytes_per_token": dsv4_bench.decode_bytes(model),
        "decode": dsv4_bench.decode_run(model, prompt, n),
        "parts": dsv4_bench.part_times(model, context=prompt.size) if args.parts else None,
        "experts_vs_mlx_lm": None
        if args.no_mlx_lm
        else dsv4_bench.expert_peers(model, experts=args.peer_experts),
    }


def report(r: dict) -> str:
    if "speculative" not in r:  # a single-precision model (run_single_precision)
        return (
            f"model: {r['model']} ({r['model_type']}, {r['backend']}), prompt "
            f"{r['settings']['prompt_tokens']} tokens: {r['prompt_tps']:.1f} tok/s | generation "
            f"{r['settings']['gen_tokens']} tokens: {r['generation_tps']:.1f} tok/s | peak memory "
            f"{max(r['peak_memory_gb'].values()):.3f} GB"
        ) + dsv4_bench.report(r)
    s, roof, cfg = r["speculative"], r["roofline"], r["settings"]
    lines = [
        f"model: {r['model']} ({r['backend']}, {r['dtype']}), prompt {cfg['prompt_tokens']}"
        f" tokens, {cfg['gen_tokens']} generated",
        "prompt tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["prompt_tps"].items()),
        "generation tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in r["generation_tps"].items()),
        f"speculative (forced): acceptance {s['acceptance_rate']:.1%}, mean accepted "
        f"{s['mean_accepted']:.2f} of {s['mean_drafted']:.2f}, draft {s['draft_s']:.3f} s, "
        f"verify {s['verify_s']:.3f} s, {s['speedup_vs_target']:.2f}x target-only",
        f"speculative (auto): fallback {'engaged' if r['speculative_auto']['fallback'] else 'off'}"
        f", {r['speculative_auto']['speedup_vs_target']:.2f}x target-only",
        "peak memory GB: " + ", ".join(f"{k} {v:.3f}" for k, v in r["peak_memory_gb"].items()),
    ]
    if "mlx_lm" in r:
        lines.append(
            "vs mlx-lm (ours / mlx-lm): "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["ratios_vs_mlx_lm"].items())
        )
    wb, tb = roof["weight_bytes_per_token"], roof["bytes_per_token"]
    lines.append(
        f"roofline at {roof['context_tokens']} context tokens: MB read per token: draft "
        f"(KV{roof['draft_kv']}) {tb['draft'] / 1e6:.3f} (weights {wb['draft'] / 1e6:.3f}), "
        f"target {tb['target'] / 1e6:.3f} (weights {wb['target'] / 1e6:.3f})"
    )
    for chip, c in roof["ceiling_tps"].items():
        lines.append(f"  {chip}: ceiling draft {c['draft']:.0f} tok/s, target {c['target']:.0f}")
    lines.append(
        "paths: "
        + ", ".join(
            f"{k} {'kernel' if v['kernel'] else 'pure'} ({v['status']})"
            for k, v in r["paths"].items()
        )
    )
    if "bandwidth" in r:
        b = r["bandwidth"]
        lines.append(
            f"achieved bandwidth on {b['chip']} (peak {b['peak_gbs']} GB/s): "
            + ", ".join(
                f"{m} {b[m]['gbs']:.0f} GB/s ({b[m]['fraction_of_peak']:.0%})"
                for m in ("draft", "target")
            )
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kernels:
        return bench_modes.kernels(args.json)
    if args.dispatches:
        return bench_modes.dispatches(args.model, args.json)
    if args.speed_model:
        return bench_modes.speed_model(args.model, args.acceptance, args.json)
    if args.dsv4_price:
        return bench_modes.dsv4_pricing(args.model, args.json)

    if args.workloads is not None:
        return bench_modes.workloads(args)
    try:
        result = run(args)
    except LOAD_ERRORS as e:  # --model could not be fetched or read
        return refuse(e)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
