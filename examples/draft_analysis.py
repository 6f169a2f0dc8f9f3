"""Cheaper drafts than the W4 chain, analysed offline (issue 52): layer skipping.

    python examples/draft_analysis.py --model PACKAGE [--tokens 96] [--calib-tokens 1024]
        [--out analysis.json]

1. Texts: each built-in workload prompt (`measurement.workloads`) and the target's own greedy
   continuation of `--tokens` tokens (target-only decoding, the text the real loop emits at T 0).
2. The skip order, from the calibration corpus only (the converter's, `convert.calib`, never the
   texts scored below): for each layer, the W4 draft with that one layer skipped (its residual
   passes through) is teacher-forced over `--calib-tokens` corpus tokens, and its greedy
   agreement with the target measured; layers are skipped in decreasing order of that agreement
   (the layer whose absence the draft notices least first).
3. For each draft (the W4 chain, then the first s layers of the order skipped), teacher-forced
   over every workload text: agreement with the target's greedy token (T 0), Σ min(p, q) at
   T 0.7 (top-p 0.95, as the workloads sample), and tokens per round of a chain of γ along the
   text (T 0: greedy acceptance along the true path; T 0.7: each draft accepted with probability
   Σ min(p, q) at its position).
4. Each draft priced by step time on an M4 Max (`measurement.step_costs`: bytes and the
   counted kernels of the package's own structure): a skipped layer saves its weights' and KV4's
   bytes and its kernels; the speed-up over target-only is the best chain γ in 1..8, and
   beside it the ratio to mlx-lm's 4-bit Llama of the same dims (`step_costs.peer_step`).
   `--price-at llama-3.2-3b` prices the same acceptance at that preset's dims as well (the
   mission's size; the same fraction of its layers skipped, the runtime's stored kernels a
   layer): a small model's step is mostly kernels, so its own prices flatter a shallower draft.

Approximations: the draft reads its own teacher-forced KV (the real loop's draft reads the
target-written cache), acceptance along the text is the chain's alone (no copies), and the
T 0.7 statistic is taken along the greedy text. Runs on the pure path with dense weights
(`keep_dense`): the same planes, another rounding than the quantized matmul.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

import bitnest_mlx
from bitnest_mlx.convert.calib import builtin_corpus
from bitnest_mlx.layers.dual_plane import keep_dense
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement import step_costs
from bitnest_mlx.measurement.speed_projection import skeleton, spec_of
from bitnest_mlx.measurement.workloads import WORKLOADS, cost_models, load_workload, prompt_ids
from bitnest_mlx.runtime.sampling import Sampler
from bitnest_mlx.runtime.step_kernels import STORED
from bitnest_mlx.runtime.step_time import Step, step_seconds
from bitnest_mlx.runtime.token_bytes import head_bytes, kv_bytes, weight_bytes

sys.path.insert(0, str(Path(__file__).parent))
from tree_analysis import greedy_tokens_per_round, sampled_tokens_per_round  # noqa: E402

CHIP = "M4 Max"
GAMMAS = range(1, 9)
TEMP, TOP_P = 0.7, 0.95
SAMPLER = Sampler(TEMP, TOP_P)  # what the T 0.7 workloads sample with
DENSE = RunOptions(dense_min_rows=1, use_kernels=False)


def greedy_text(model, ids: list[int], n: int) -> list[int]:
    """The target's greedy continuation of `ids`, n tokens (target-only decoding)."""
    cache = model.make_cache()
    logits = model(mx.array(ids)[None], cache, options=DENSE)[0, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache, options=DENSE)[0, -1]
    return out


def logits_over(model, ids: list[int], start: int, skip: frozenset[int] | None) -> mx.array:
    """Teacher-forced logits predicting ids[start:], float32: the target's (skip None) or the
    W4 draft's with the layers `skip` passed through."""
    o = DENSE if skip is None else replace(DENSE, mode="draft", draft_skip=skip)
    return model(mx.array(ids)[None], options=o)[0, start - 1 : -1].astype(mx.float32)


def compare(p_logits: mx.array, q_logits: mx.array) -> dict[str, np.ndarray]:
    """Per position: whether the draft's greedy token is the target's (rank 0 of the target's
    token among the draft's logits), and Σ min(p, q) at TEMP / TOP_P."""
    target = mx.argmax(p_logits, axis=-1)
    true_q = mx.take_along_axis(q_logits, target[:, None], axis=-1)
    ranks = np.array((q_logits > true_q).sum(axis=-1))
    p, q = (np.exp(np.array(SAMPLER.logprobs(x), dtype=np.float64)) for x in (p_logits, q_logits))
    beta = np.minimum(p, q).sum(-1)
    return {"ranks": ranks, "beta": beta}


def layer_order(model, tokenizer, calib_tokens: int) -> tuple[list[int], list[float]]:
    """Layers in the order to skip them, and each one's greedy agreement when skipped alone,
    over the calibration corpus's first `calib_tokens` tokens."""
    ids = tokenizer.encode(builtin_corpus())[: calib_tokens + 1]
    p = logits_over(model, ids, 1, None)
    agreement = []
    for i in range(model.args.num_hidden_layers):
        r = compare(p, logits_over(model, ids, 1, frozenset({i})))["ranks"]
        agreement.append(float((r == 0).mean()))
        print(f"calibration: layer {i} skipped alone, agreement {agreement[-1]:.3f}", flush=True)
    return sorted(range(len(agreement)), key=lambda i: -agreement[i]), agreement


def skipped_cost(cost, model, skipped: int, context: int, counts=None):
    """The CostModel with a draft that skips `skipped` layers: their weights' and KV4's bytes
    and their kernels (the draft's per layer, as counted) come off its step."""
    layers = model.args.num_hidden_layers
    w, head = weight_bytes(model), head_bytes(model)
    layer_bytes = (w["draft"] - head["draft"] - model.args.hidden_size * 2) / layers
    kv_layer = kv_bytes(model.args)[4] / layers * context
    per_layer = (counts or step_costs.counted(model.args))[cost.path].draft.per_layer
    d = cost.draft_step
    step = Step(
        d.nbytes - skipped * (layer_bytes + kv_layer),
        d.kernels - skipped * per_layer,
        d.syncs,
    )
    return replace(cost, draft_step=step, cost_ratio=step.nbytes / cost.target_step.nbytes)


def chain_tokens(stats: dict, gamma: int, temp: float) -> float:
    """Tokens per round of a chain of γ along the texts: greedy acceptance at T 0, each draft
    accepted with probability Σ min(p, q) at its position at T 0.7."""
    if temp == 0:
        return greedy_tokens_per_round(stats["ranks"], (1,) * gamma)
    return sampled_tokens_per_round(stats["beta"][:, None], (1,) * gamma)


def priced(stats: dict, cost, temp: float) -> dict:
    best = max(
        (chain_tokens(stats, g, temp) / cost.chain(g), g, chain_tokens(stats, g, temp))
        for g in GAMMAS
    )
    return {"speedup": best[0], "gamma": best[1], "tokens_per_round": best[2]}


def pricing(model, context: int, counts=None) -> dict:
    """{path: CostModel} on CHIP, for `model`'s dims at `context`."""
    return {"costs": cost_models(model, context, (CHIP,), counts)[CHIP]}


def priced_entry(model, price: dict, stats: dict, skipped: int, context: int, counts=None):
    """Per path: the draft's cost ratio and step time over a target step, and per temperature
    the best chain's speed-up over target-only and its ratio to mlx-lm 4-bit."""
    out = {}
    for path, cost in price["costs"].items():
        c = skipped_cost(cost, model, skipped, context, counts)
        over_peer4 = step_costs.over_peer(c, model.args, context)
        out[path] = {
            "cost_ratio": c.draft_step.nbytes / c.target_step.nbytes,
            "draft_step_over_target": step_seconds(c.draft_step, CHIP)
            / step_seconds(c.target_step, CHIP),
        }
        for temp in (0, TEMP):
            r = priced(stats, c, temp)
            out[path][f"T{temp}"] = {
                **r,
                "vs_mlx_lm_4bit": r["speedup"] * over_peer4,
            }
    return out


def table(result: dict) -> str:
    """The analysis as Markdown: acceptance by draft, then each draft priced (kernel path, the
    package's own dims and `price_at`'s): speed-up over target-only at T 0 / T 0.7 (best γ)."""
    names = list(result["rows"][0]["workloads"])
    big = result["price_at"]
    head = " | ".join(f"{n} T0 / T0.7" for n in names)
    lines = [
        f"| layers skipped | {head} |",
        "|---|" + "---|" * len(names),
    ]
    for r in result["rows"]:
        cells = [f"{w['agreement']:.3f} / {w['sum_min_pq']:.3f}" for w in r["workloads"].values()]
        lines.append(f"| {r['skipped']} {r['layers']} | " + " | ".join(cells) + " |")
    for where in ("own", big):
        lines += ["", f"priced at {where} dims, kernel path, {result['chip']}:", ""]
        lines.append(f"| layers skipped | draft step / target step | {head} | vs mlx-lm 4-bit |")
        lines.append("|---|---|" + "---|" * len(names) + "---|")
        for r in result["rows"]:
            ws = list(r["workloads"].values())
            k = [w[where]["kernel"] for w in ws]
            cells = [
                f"{x['T0']['speedup']:.2f}x (γ {x['T0']['gamma']}) / "
                f"{x['T0.7']['speedup']:.2f}x (γ {x['T0.7']['gamma']})"
                for x in k
            ]
            vs = "/".join(f"{x['T0.7']['vs_mlx_lm_4bit']:.2f}" for x in k)
            skipped = ws[0][where].get("skipped", r["skipped"])
            lines.append(
                f"| {skipped} | {k[0]['draft_step_over_target']:.2f} | "
                + " | ".join(cells)
                + f" | {vs} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--table", type=Path, help="print a finished --out file as Markdown and stop")
    p.add_argument("--tokens", type=int, default=96, help="generated tokens a prompt")
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--skips", default="1,2,3,4,6,8", help="numbers of layers skipped")
    p.add_argument("--price-at", default="llama-3.2-3b", help="also price at this preset's dims")
    p.add_argument("--context", type=int, default=2048, help="context of the preset's pricing")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return
    if not args.model:
        p.error("--model is required (or --table FILE)")
    model, tokenizer = bitnest_mlx.load(args.model)
    model.set_dtype(mx.float32)
    keep_dense(model)
    result = json.loads(args.out.read_text()) if args.out and args.out.exists() else {}
    texts = result.setdefault("texts", {})
    for name in WORKLOADS:
        for q in load_workload(name):
            key = f"{name}/{q['name']}"
            if key not in texts:
                ids = prompt_ids(tokenizer, q["messages"])
                texts[key] = {"prompt": ids, "generated": greedy_text(model, ids, args.tokens)}
                print(f"text {key}: {len(ids)} + {args.tokens} tokens", flush=True)
    if "order" not in result:
        result["order"], result["calibration_agreement"] = layer_order(
            model, tokenizer, args.calib_tokens
        )
    if args.out:
        args.out.write_text(json.dumps(result))
    targets = {
        k: logits_over(model, t["prompt"] + t["generated"], len(t["prompt"]), None)
        for k, t in texts.items()
    }
    context = int(np.mean([len(t["prompt"]) + len(t["generated"]) / 2 for t in texts.values()]))
    own = pricing(model, context)
    big = skeleton(spec_of(args.price_at))
    at_big = pricing(big, args.context, STORED)
    layers, big_layers = model.args.num_hidden_layers, big.args.num_hidden_layers
    rows = []
    for skipped in [0, *map(int, args.skips.split(","))]:
        skip = frozenset(result["order"][:skipped])
        per_workload: dict[str, dict] = {}
        for k, t in texts.items():
            ids = t["prompt"] + t["generated"]
            s = compare(targets[k], logits_over(model, ids, len(t["prompt"]), skip))
            w = per_workload.setdefault(k.split("/")[0], {"ranks": [], "beta": []})
            w["ranks"].append(s["ranks"])
            w["beta"].append(s["beta"])
        row = {"skipped": skipped, "layers": sorted(skip), "workloads": {}}
        for name, w in per_workload.items():
            stats = {k: np.concatenate(v) for k, v in w.items()}
            big_skipped = round(skipped * big_layers / layers)
            row["workloads"][name] = {
                "agreement": float((stats["ranks"] == 0).mean()),
                "sum_min_pq": float(stats["beta"].mean()),
                "own": priced_entry(model, own, stats, skipped, context),
                args.price_at: {
                    "skipped": big_skipped,
                    **priced_entry(big, at_big, stats, big_skipped, args.context, STORED),
                },
            }
        rows.append(row)
        print(json.dumps(row), flush=True)
    result.update(rows=rows, context=context, chip=CHIP, price_at=args.price_at)
    if args.out:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
