"""The built-in workloads of speculation (`bench --workloads`): chat prompts of the work people
do, decoded by the real speculative loop, and the speed-up its rounds project on each chip.

Four workloads, three prompts each, in `workload_data/` (OpenAI chat messages): `code_edit`
(rewrite a given Python function with a stated change), `passage_qa` (summarise or answer over a
passage of about 1-2 k tokens), `chat` (multi-turn) and `free` (open generation). A run is
seeded (the Gumbel-max coupling by default: the text is the target-only text whatever is
drafted), adaptive, and its plans follow the fixed costs a seeded run plans with on this machine
(`step_kernels.run_cost`: the projections' default chip off Metal); every round is logged, so
the projection on each chip prices the same rounds by step time there: the model's bytes at the
prompt's context, its kernels counted from its graph, a round's host syncs (`step_costs`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from importlib import resources

import mlx.core as mx
import mlx.nn as nn

from ..runtime.sampling import Sampler
from ..runtime.speculative import SpeculativeStats, speculative_generate_step
from ..runtime.speed_model import PATHS, CostModel
from ..runtime.step_kernels import PathKernels, run_chip
from .step_costs import cost_model

WORKLOADS = ("code_edit", "passage_qa", "chat", "free")
# What drafts, by the names of the report: the W4 chain alone, the per-round choice among
# chains, n-gram copies and copies extended by the chain, and copies alone.
CONFIGS = {"chain": "model", "chain+ngram": "auto", "ngram": "ngram"}
PROJECT_CHIPS = ("M1", "M3 Max", "M4 Max")


def load_workload(name: str) -> list[dict]:
    """The prompts of workload `name`: [{"name", "messages"}], messages in OpenAI chat form."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    data = resources.files("bitnest_mlx") / "workload_data" / f"{name}.json"
    return json.loads(data.read_text(encoding="utf-8"))


def prompt_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a conversation through the tokenizer's chat template, ready for the
    assistant's turn; without a template, "Role: content" lines and "Assistant:"."""
    if getattr(tokenizer, "has_chat_template", False):
        return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True))
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages)
    return tokenizer.encode(text + "Assistant:")


def speculate(
    model: nn.Module,
    ids: Sequence[int],
    gen_tokens: int,
    sampler: Sampler,
    seed: int,
    draft_source: str,
    **kwargs,
) -> tuple[list[int], SpeculativeStats]:
    """(the tokens, the stats) of one seeded adaptive run of the real loop: whole rounds until at
    least `gen_tokens` tokens or an end-of-sequence token (`eos_token_ids`; other kwargs go to
    `speculative_generate_step`)."""
    stats, tokens = SpeculativeStats(), []
    eos = set(kwargs.pop("eos_token_ids", ()))
    steps = speculative_generate_step(
        mx.array(ids, dtype=mx.uint32),
        model,
        max_tokens=-1,
        sampler=sampler,
        stats=stats,
        seed=seed,
        draft_source=draft_source,
        **kwargs,
    )
    end = None  # just after the first end-of-sequence token: the text ends there
    for token, _, _ in steps:
        tokens.append(token)
        if end is None and token in eos:
            end = len(tokens)
        # Stop after the round that reaches the budget or the end (an accepted draft may be
        # the end-of-sequence token): rounds stay whole in the stats, as in stream_generate's.
        if (end or len(tokens) >= gen_tokens) and len(tokens) == _emitted(stats):
            break
    steps.close()
    return tokens[:end], stats


def _emitted(stats: SpeculativeStats) -> int:
    return sum(r.tokens for r in stats.round_log)


def cost_models(
    model: nn.Module,
    context: int,
    chips: Sequence[str] = PROJECT_CHIPS,
    counts: Mapping[str, PathKernels] | None = None,
) -> dict[str, dict[str, CostModel]]:
    """{chip: {path: CostModel}} at `context` tokens, priced by step time (`step_costs`: the
    model's kernels counted once a process unless `counts` are given)."""
    return {
        chip: {p: cost_model(model, context, chip, p, counts=counts) for p in PATHS}
        for chip in chips
    }


def projection(stats: SpeculativeStats, costs: dict[str, dict[str, CostModel]]) -> dict:
    """{chip: {path: projected speedup over target-only}} of the logged rounds."""
    return {
        chip: {path: stats.projected_speedup(cost) for path, cost in by_path.items()}
        for chip, by_path in costs.items()
    }


def run_prompts(
    model: nn.Module,
    prompts: Mapping[str, Sequence[int]],
    gen_tokens: int,
    sampler: Sampler,
    seed: int,
    draft_source: str,
    num_draft_tokens: int = 3,
    ngram_tokens: int = 8,
    done: Callable[[str, dict], None] | None = None,
    plan: Callable[[int], CostModel] | None = None,
    **kwargs,
) -> tuple[SpeculativeStats, dict]:
    """`speculate` on each prompt: (every round pooled, {name: {prompt_tokens, generated,
    tokens_per_round, projected_speedup (`projection` at the prompt's mean context), sources,
    tokens}}); `done(name, entry)` after each (kwargs go to `speculate`). `plan`: the fixed
    costs each prompt's run plans with, from its expected mean context (None: the loop's own,
    `step_kernels.run_cost`)."""
    merged, per_prompt = SpeculativeStats(), {}
    for name, ids in prompts.items():
        # A round may overrun the budget by a copy extended by a chain: keep it in the context.
        room = model.args.max_position_embeddings - len(ids) - ngram_tokens - num_draft_tokens - 2
        if plan is not None:
            kwargs["cost_model"] = plan(len(ids) + gen_tokens // 2)
        tokens, stats = speculate(
            model,
            ids,
            max(min(gen_tokens, room), 1),
            sampler,
            seed,
            draft_source,
            num_draft_tokens=num_draft_tokens,
            ngram_tokens=ngram_tokens,
            **kwargs,
        )
        costs = cost_models(model, len(ids) + len(tokens) // 2)
        per_prompt[name] = {
            "prompt_tokens": len(ids),
            "generated": len(tokens),
            "tokens_per_round": len(tokens) / len(stats.round_log),
            "projected_speedup": projection(stats, costs),
            "sources": stats.sources,
            "draft_vocab_joined": stats.draft_vocab_joined,  # lm_head rows the join gathered
            "tokens": tokens,
        }
        for r in stats.round_log:
            merged.record(r)
        if done is not None:
            done(name, per_prompt[name])
    return merged, per_prompt


def run_workloads(
    model: nn.Module,
    tokenizer,
    workloads: Sequence[str] = WORKLOADS,
    configs: Sequence[str] = tuple(CONFIGS),
    temps: Sequence[float] = (0.0, 0.7),
    gen_tokens: int = 256,
    seed: int = 0,
    num_draft_tokens: int = 3,
    ngram_tokens: int = 8,
    progress: Callable[[str], None] | None = None,
    draft_vocab_join: bool = True,
    plan: Callable[[int], CostModel] | None = None,
) -> dict:
    """Per workload, temperature and draft configuration: tokens per round, per-source stats
    and the projected speedup on `PROJECT_CHIPS` (both v(M) paths), over all its prompts.
    `plan`: see `run_prompts`."""
    eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
    out: dict = {}
    for name in workloads:
        prompts = {p["name"]: prompt_ids(tokenizer, p["messages"]) for p in load_workload(name)}
        for temp in temps:
            sampler = Sampler(temp=temp, top_p=0.95 if temp else 0.0)
            for config in configs:

                def done(prompt: str, r: dict, label=f"{name} T={temp} {config}") -> None:
                    if progress is not None:
                        progress(f"{label} {prompt}: {_line(r)}")

                merged, per_prompt = run_prompts(
                    model,
                    prompts,
                    gen_tokens,
                    sampler,
                    seed,
                    CONFIGS[config],
                    num_draft_tokens,
                    ngram_tokens,
                    done,
                    plan=plan,
                    eos_token_ids=eos,
                    draft_vocab_join=draft_vocab_join,
                )
                out.setdefault(name, {}).setdefault(str(temp), {})[config] = _summary(
                    merged, per_prompt
                )
    return {
        "settings": {
            "gen_tokens": gen_tokens,
            "seed": seed,
            "num_draft_tokens": num_draft_tokens,
            "ngram_tokens": ngram_tokens,
            "draft_vocab_join": draft_vocab_join,
            "controller_chip": run_chip(),
            "top_p": 0.95,
        },
        "workloads": out,
    }


def _line(r: dict) -> str:
    speed = r["projected_speedup"].get("M4 Max", {})
    return f"{r['tokens_per_round']:.2f} tokens/round, " + ", ".join(
        f"M4 Max {p} {s:.2f}x" for p, s in speed.items()
    )


def _summary(merged: SpeculativeStats, per_prompt: dict) -> dict:
    """Pooled over the prompts: tokens per round of all rounds, and each prompt's projected
    speedup averaged as a harmonic mean (time per token averaged, as a session would)."""
    chips = next(iter(per_prompt.values()))["projected_speedup"]
    projected = {
        chip: {
            path: len(per_prompt)
            / sum(1 / p["projected_speedup"][chip][path] for p in per_prompt.values())
            for path in chips[chip]
        }
        for chip in chips
    }
    rounds = len(merged.round_log)
    return {
        "tokens_per_round": sum(r.tokens for r in merged.round_log) / rounds,
        "rounds": rounds,
        "target_steps": merged.target_steps,
        "sources": merged.sources,
        "projected_speedup": projected,
        "prompts": per_prompt,
    }
