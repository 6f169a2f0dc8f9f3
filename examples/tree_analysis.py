"""Would token trees pay? An offline analysis over a package's teacher-forced distributions.

    python examples/tree_analysis.py --model PACKAGE --runs 'RESULTS/*.json' [--out tree.json]

RESULTS are `bench --workloads --json` outputs: each prompt's ids are rebuilt from the workload
and its generated tokens are read from the run (the target's own greedy text at T 0, its seeded
sample at T 0.7). Over each generated text, one teacher-forced target pass and one draft pass
give p and q at every position; along the text:

* T 0: a static tree with branching (b_1, ..., b_D) accepts depth d at a position when the
  text's next d tokens each rank below b_j in the draft's logits at their position (greedy
  acceptance along the true path); rounds tile the text.
* T 0.7: SpecInfer's multi-step speculative sampling with b_j candidates drawn from q accepts
  at depth j with probability 1 - Π_k (1 - β_k), β_k = Σ min(p_k, q), p_1 = p,
  p_{k+1} = norm(max(p_k - q, 0)); expected tokens per round from every position.

Each shape is priced by step time on an M4 Max (pure and kernel paths; `speed_model`,
`measurement.step_costs`: the package's bytes and counted kernels): draft calls of (1, level
widths...) rows, a verify pass of nodes + 1 rows (v(M) on its bytes, its kernels launched once)
and the round's sync. Chains are the shapes (1, 1, ...). Approximations: the draft reads its
own teacher-forced KV, not the target-written cache of the real loop, and static shapes only
(dynamic trees such as EAGLE-2's expand where the draft is confident, which this does not
measure).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np

import bitnest_mlx
from bitnest_mlx.layers.dual_plane import keep_dense
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement.workloads import cost_models, load_workload, prompt_ids
from bitnest_mlx.runtime.sampling import Sampler
from bitnest_mlx.runtime.speed_model import Round

BUDGETS = (4, 8, 16)
MAX_BRANCH = 4


def shapes(budget: int) -> list[tuple[int, ...]]:
    """Non-increasing branching vectors whose trees have at most `budget` nodes."""
    out = []

    def grow(prefix: tuple[int, ...]) -> None:
        for k in range(min(prefix[-1] if prefix else MAX_BRANCH, MAX_BRANCH), 0, -1):
            b = (*prefix, k)
            if nodes(b) <= budget:
                out.append(b)
                grow(b)

    grow(())
    return out


def widths(b: tuple[int, ...]) -> list[int]:
    return [math.prod(b[: d + 1]) for d in range(len(b))]


def nodes(b: tuple[int, ...]) -> int:
    return sum(widths(b))


def teacher_forced(model, ids: list[int], start: int, sampler: Sampler):
    """Draft ranks of the true next tokens and, per position, the multi-candidate acceptance
    a_k (k = 1..MAX_BRANCH candidates), over positions start-1 .. len-2."""
    x = mx.array(ids)[None]
    opts = RunOptions(dense_min_rows=1)
    p_logits = model(x, options=opts)[0, start - 1 : -1]
    q_logits = model(x, options=opts.__class__(mode="draft", dense_min_rows=1))[0, start - 1 : -1]
    nxt = mx.array(ids[start:])
    true_q = mx.take_along_axis(q_logits, nxt[:, None], axis=-1)
    ranks = np.array((q_logits > true_q).sum(axis=-1))
    p = np.exp(np.array(sampler.logprobs(p_logits), dtype=np.float64))
    q = np.exp(np.array(sampler.logprobs(q_logits), dtype=np.float64))
    accept = np.zeros((len(p), MAX_BRANCH))
    residual, rejected = p.copy(), np.ones(len(p))
    for k in range(MAX_BRANCH):
        beta = np.minimum(residual, q).sum(-1)
        rejected *= 1 - beta
        accept[:, k] = 1 - rejected
        rest = np.maximum(residual - q, 0)
        mass = rest.sum(-1, keepdims=True)
        residual = np.where(mass > 0, rest / np.maximum(mass, 1e-30), residual)
    return ranks, accept


def greedy_tokens_per_round(ranks: np.ndarray, b: tuple[int, ...]) -> float:
    i = tokens = rounds = 0
    while i < len(ranks):
        d = 0
        while d < len(b) and i + d < len(ranks) and ranks[i + d] < b[d]:
            d += 1
        tokens, rounds, i = tokens + d + 1, rounds + 1, i + d + 1
    return tokens / rounds


def sampled_tokens_per_round(accept: np.ndarray, b: tuple[int, ...]) -> float:
    n = len(accept)
    total = np.ones(n)
    reach = np.ones(n)
    for d, k in enumerate(b):
        a = np.concatenate([accept[d:, k - 1], np.zeros(d)])  # past the end: nothing accepted
        reach = reach * a
        total += reach
    return float(total.mean())


def draft_vocab_size(model) -> int:
    head = getattr(model, "draft_head", None)
    return model.args.vocab_size if head is None else head.ids.size


def draft_vocab_misses(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """(generated tokens, those outside the draft vocabulary, those outside it and not in the
    context before them): what the W4 draft can never propose, and what joining the context's
    tokens to the draft vocabulary at run time would leave."""
    head = getattr(model, "draft_head", None)
    vocab = set(range(model.args.vocab_size)) if head is None else set(head.ids.tolist())
    seen, miss, miss_ctx = set(prompt), 0, 0
    for t in generated:
        if t not in vocab:
            miss += 1
            miss_ctx += t not in seen
        seen.add(t)
    return np.array([len(generated), miss, miss_ctx], dtype=float)


def price(b: tuple[int, ...], tokens: float, cost) -> float:
    """Speed-up of shape `b` over target-only: draft calls of (1, level widths...) rows, a verify
    pass of nodes + 1 rows and the round's sync, by step time (`CostModel.round`)."""
    w = widths(b)
    return tokens / cost.round(Round("tree", nodes(b), 0, (1, *w[:-1])))


def analyse(rows: list[tuple[np.ndarray, np.ndarray]], temp: float, costs: dict) -> dict:
    out = {}
    ranks = np.concatenate([r for r, _ in rows])
    accept = np.concatenate([a for _, a in rows])
    for budget in BUDGETS:
        per_shape = {}
        for b in shapes(budget):
            if temp == 0:
                tpr = greedy_tokens_per_round(ranks, b)
            else:
                tpr = sampled_tokens_per_round(accept, b)
            per_shape[b] = {
                "tokens_per_round": tpr,
                **{path: price(b, tpr, c) for path, c in costs.items()},
            }
        chains = {b: v for b, v in per_shape.items() if max(b) == 1}
        trees = {b: v for b, v in per_shape.items() if max(b) > 1}
        row = {}
        for path in costs:
            best_chain = max(chains, key=lambda b: chains[b][path])
            best_tree = max(trees, key=lambda b: trees[b][path])
            row[path] = {
                "chain": {"shape": list(best_chain), **chains[best_chain]},
                "tree": {"shape": list(best_tree), **trees[best_tree]},
            }
        most = max(trees, key=lambda b: trees[b]["tokens_per_round"])
        longest = max(chains, key=lambda b: chains[b]["tokens_per_round"])
        row["most_tokens"] = {
            "tree": {"shape": list(most), **trees[most]},
            "chain": {"shape": list(longest), **chains[longest]},
        }
        out[str(budget)] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--runs", required=True, help="glob of bench --workloads --json outputs")
    p.add_argument("--config", default="chain", help="whose generated tokens to read")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model, tokenizer = bitnest_mlx.load(args.model)
    keep_dense(model)
    results = {}
    for path in sorted(glob.glob(args.runs)):
        run = json.loads(Path(path).read_text())
        for name, temps in run["workloads"].items():
            prompts = {q["name"]: q["messages"] for q in load_workload(name)}
            for temp, configs in temps.items():
                sampler = Sampler(float(temp), 0.95 if float(temp) else 0.0)
                rows, context, outside = [], [], np.zeros(3)
                for prompt, r in configs[args.config]["prompts"].items():
                    ids = prompt_ids(tokenizer, prompts[prompt])
                    rows.append(teacher_forced(model, ids + r["tokens"], len(ids), sampler))
                    context.append(len(ids) + len(r["tokens"]) // 2)
                    outside += draft_vocab_misses(model, ids, r["tokens"])
                costs = cost_models(model, int(np.mean(context)), ("M4 Max",))["M4 Max"]
                results.setdefault(name, {})[temp] = analyse(rows, float(temp), costs)
                results[name][temp]["draft_vocab"] = {
                    "size": draft_vocab_size(model),
                    "outside": outside[1] / outside[0],
                    "outside_with_context": outside[2] / outside[0],
                }
                print(json.dumps({name: {temp: results[name][temp]}}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
