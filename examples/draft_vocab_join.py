"""What the reduced draft vocabulary costs on each workload, and what joining the context's ids
to it at run time (`DraftVocabJoin`) gives back: a teacher-forced proxy.

    python examples/draft_vocab_join.py --model PACKAGE [--workloads NAME ...] [--tokens 128]
    python examples/draft_vocab_join.py --model PACKAGE --loop T [--workloads ...] [--tokens 256]

For each workload prompt (`bitnest_mlx.measurement.workloads`), the target's greedy continuation of
`--tokens` tokens (the speculative loop, seeded: its text is target-only decoding's), then one
teacher-forced target pass and one full-vocabulary draft pass (W4, KV8 as `--draft-kv auto`
reads at these lengths; dense weights) over prompt + continuation. At each generated position
the draft is scored three ways from the same W4 logits: over every id (`full`), over the
package's K kept ids (`K`, what the draft head computes), and over K plus every id of the prompt
and of the continuation before that position (`K+join`, what the join scores there):

* agreement: the draft's argmax equals the target's (greedy acceptance per position);
* Σmin(p, q) at T 0.7, top-p 0.95 (the acceptance of one sampled draft);
* outside: the target's argmax is not in the draft's set at all (it can never be drafted).

Approximations: the draft reads its own teacher-forced KV, not the target-written cache of the
real loop, and the text is the greedy one (at T 0.7 the loop's text is sampled).

`--loop T`: the real loop instead (`workloads.run_prompts`, as `bench --workloads` at
temperature T, `chain+ngram`, seed 0, dense weights), with the join off and on, on one text:
verification runs one row per call (`parity=True`), so every target row is computed exactly as
target-only decoding computes it and both runs emit the seeded target-only text token for token.
Without it the two runs part at near ties: with OpenBLAS preloaded a verify pass's attention
rounds a row differently from a one-row pass (docs/speculative.md, "Greedy parity and
multi-row numerics"), and the join changes how many rows each pass verifies.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

import bitnest_mlx
from bitnest_mlx.layers.dual_plane import keep_dense
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.measurement.workloads import (
    PROJECT_CHIPS,
    WORKLOADS,
    load_workload,
    prompt_ids,
    run_prompts,
    speculate,
)
from bitnest_mlx.runtime.sampling import Sampler

VARIANTS = ("full", "K", "K+join")
SAMPLED = Sampler(temp=0.7, top_p=0.95)
TARGET = RunOptions(dense_min_rows=1)
DRAFT = RunOptions(mode="draft", draft_kv=8, draft_vocab=False, dense_min_rows=1)


def continuation(model, ids: list[int], tokens: int, eos: tuple[int, ...]) -> list[int]:
    """The target's greedy continuation (seeded speculative loop: the target-only text)."""
    out, _ = speculate(
        model, ids, tokens, Sampler(), 0, "auto", eos_token_ids=eos, draft_vocab_join=False
    )
    return out[:tokens]


def allowed(model, ids: list[int], generated: list[int]) -> dict[str, np.ndarray]:
    """Per variant, the ids the draft scores at each generated position: bool [G, V]."""
    vocab, g = model.args.vocab_size, len(generated)
    kept = np.zeros(vocab, dtype=bool)
    kept[np.array(model.draft_head.ids)] = True
    first = np.full(vocab, g + 1)  # the first position whose context holds the id
    first[np.array(ids)] = 0
    for j, t in enumerate(generated):
        first[t] = min(first[t], j + 1)
    joined = kept[None] | (first[None] <= np.arange(g)[:, None])
    everything = np.ones((g, vocab), dtype=bool)
    return {"full": everything, "K": everything & kept, "K+join": joined}


def score(model, ids: list[int], generated: list[int]) -> dict:
    """Sums over the generated positions, per variant: agreement, Σmin at T 0.7, outside."""
    x = mx.array(ids + generated)[None]
    start = len(ids)
    p = model(x, options=TARGET)[0, start - 1 : -1].astype(mx.float32)
    mx.eval(p)
    q = model(x, options=DRAFT)[0, start - 1 : -1].astype(mx.float32)
    mx.eval(q)
    want = np.array(p.argmax(axis=-1))
    p_sampled = mx.exp(SAMPLED.logprobs(p))
    out = {"positions": len(generated)}
    for name, mask in allowed(model, ids, generated).items():
        qm = mx.where(mx.array(mask), q, -mx.inf)
        q_sampled = mx.exp(SAMPLED.logprobs(qm))
        out[name] = {
            "agree": int((np.array(qm.argmax(axis=-1)) == want).sum()),
            "sum_min": float(mx.minimum(p_sampled, q_sampled).sum(axis=-1).sum().item()),
            "outside": int((~mask[np.arange(len(want)), want]).sum()),
        }
    kept = set(np.array(model.draft_head.ids).tolist())
    out["joined_rows"] = len(set(ids + generated) - kept)
    return out


def workload(model, tokenizer, name: str, tokens: int) -> dict:
    """`score` summed over the workload's prompts (and the joined rows of each prompt)."""
    eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    total: dict = {"positions": 0, "joined_rows": [], **{v: {} for v in VARIANTS}}
    for prompt in load_workload(name):
        ids = prompt_ids(tokenizer, prompt["messages"])
        r = score(model, ids, continuation(model, ids, tokens, eos))
        total["positions"] += r["positions"]
        total["joined_rows"].append(r["joined_rows"])
        for v in VARIANTS:
            for k, n in r[v].items():
                total[v][k] = total[v].get(k, 0) + n
        print(json.dumps({name: {prompt["name"]: r}}), flush=True)
    return total


def table(results: dict, kept: int) -> str:
    """A markdown table: per workload, each variant's agreement, Σmin and misses (rates)."""
    head = "| workload | positions | joined rows (per prompt) |"
    head += "".join(f" agree {v} |" for v in VARIANTS)
    head += "".join(f" Σmin T0.7 {v} |" for v in VARIANTS)
    head += f" outside K ({kept:,}) | outside K+join |"
    lines = [head, "|" + "---|" * (3 + 2 * len(VARIANTS) + 2)]
    for name, r in results.items():
        n = r["positions"]
        cells = [name, str(n), ", ".join(map(str, r["joined_rows"]))]
        cells += [f"{r[v]['agree'] / n:.3f}" for v in VARIANTS]
        cells += [f"{r[v]['sum_min'] / n:.3f}" for v in VARIANTS]
        cells += [f"{r['K']['outside'] / n:.1%}", f"{r['K+join']['outside'] / n:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def harmonic(xs: list[float]) -> float:
    """Speed-ups averaged as time per token is: the harmonic mean (as `bench --workloads`)."""
    return len(xs) / sum(1 / x for x in xs)


def loop(model, tokenizer, name: str, temp: float, tokens: int) -> dict:
    """The real loop on workload `name` with the join off and on: pooled tokens per round,
    sources, joined rows per prompt and the harmonic-mean projection per chip (pure, kernel)."""
    prompts = {p["name"]: prompt_ids(tokenizer, p["messages"]) for p in load_workload(name)}
    eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    sampler = Sampler(temp=temp, top_p=0.95 if temp else 0.0)
    out, texts = {}, {}
    for join in (False, True):
        key = "on" if join else "off"
        merged, per = run_prompts(
            model, prompts, tokens, sampler, 0, "auto", eos_token_ids=eos, options=TARGET,
            draft_vocab_join=join, parity=True,
        )  # fmt: skip
        texts[key] = [per[p]["tokens"] for p in prompts]
        rounds = merged.round_log
        out[key] = {
            "tokens_per_round": sum(r.tokens for r in rounds) / len(rounds),
            "rounds": len(rounds),
            "sources": merged.sources,
            "joined_rows": [per[p]["draft_vocab_joined"] for p in prompts],
            "generated": [per[p]["generated"] for p in prompts],
            "projected_speedup": {
                chip: {
                    path: harmonic([r["projected_speedup"][chip][path] for r in per.values()])
                    for path in ("pure", "kernel")
                }
                for chip in PROJECT_CHIPS
            },
        }
        print(json.dumps({name: {str(temp): {key: out[key]}}}), flush=True)
    # A run ends at the round that reaches the budget: compare the texts as far as both go.
    out["same_text"] = all(a[: len(b)] == b[: len(a)] for a, b in zip(texts["off"], texts["on"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--tokens", type=int, default=128, help="generated tokens per prompt")
    p.add_argument("--out", type=Path, help="write the sums as JSON")
    p.add_argument("--loop", type=float, metavar="T", help="the real loop at temperature T")
    args = p.parse_args()
    model, tokenizer = bitnest_mlx.load(args.model)
    if model.draft_head is None:
        raise SystemExit(f"{args.model}: the draft scores every id; nothing to join")
    keep_dense(model)  # a CPU multiplies every row of a pass for about the cost of one
    if args.loop is not None:
        results = {n: loop(model, tokenizer, n, args.loop, args.tokens) for n in args.workloads}
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
        return
    results = {name: workload(model, tokenizer, name, args.tokens) for name in args.workloads}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(table(results, model.draft_head.ids.size))


if __name__ == "__main__":
    main()
