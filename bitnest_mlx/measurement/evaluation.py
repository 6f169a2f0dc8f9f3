"""Perplexity, bits per byte and draft/target agreement of a bitnest model on a text; the
sampling acceptance of speculative decoding and its projected speed on a bandwidth-bound GPU."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from ..layers.draft_vocab import draft_tokens, restrict_logits
from ..layers.options import DRAFT_KV, RunOptions
from ..runtime.draft_kv import model_kv8_limit, resolve_draft_kv
from ..runtime.sampling import Sampler, acceptance_probability
from ..runtime.speculative import SpeculativeStats, speculative_generate_step
from ..runtime.speed_model import DEFAULT_CHIP, DEFAULT_PATH, speed_model, verify_table
from .roofline import roofline
from .step_costs import cost_model
from .workloads import run_prompts, speculate

MODES = ("draft", "target", "float")
# Sampled acceptance and the speculative runs: the settings the issue asks for (a common chat
# default), γ = 2, 3, 4 and 256 generated tokens per prompt.
SAMPLING = Sampler(temp=0.7, top_p=0.95)
GAMMAS = (2, 3, 4)
GEN_TOKENS = 256

# Built-in prompts of three kinds of text; "chat" goes through the tokenizer's chat template.
PROMPTS = {
    "code": "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
    '    """Merge two sorted lists into one sorted list."""\n'
    "    out = []\n    i = j = 0\n",
    "prose": "The old mill had stood by the river for two hundred years. Every spring, when "
    "the snow melted in the hills, the water rose",
    "chat": "Explain in a few sentences why the sky is blue, for a ten-year-old.",
}


def builtin_prompts(tokenizer) -> dict[str, list[int]]:
    """The token ids of `PROMPTS`: code and prose as raw text, chat through the tokenizer's chat
    template when it has one (else as a plain "User: ... Assistant:" exchange)."""
    out = {name: tokenizer.encode(PROMPTS[name]) for name in ("code", "prose")}
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": PROMPTS["chat"]}]
        out["chat"] = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:
        out["chat"] = tokenizer.encode(f"User: {PROMPTS['chat']}\nAssistant:")
    return out


Progress = Callable[[str, int, int], None]  # (stage, units done, units in the stage)


def _silent(stage: str, done: int, total: int) -> None:
    pass


def windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive non-overlapping windows (the last partial one dropped when shorter than 2)."""
    return [tokens[i : i + size] for i in range(0, len(tokens), size) if len(tokens[i:]) > 1]


def window_nll(logits: mx.array, window: list[int]) -> float:
    """Summed NLL (nats) of window[1:] under teacher-forced logits [T, V] of the window."""
    lf = logits[:-1].astype(mx.float32)
    logprobs = lf - mx.logsumexp(lf, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, mx.array(window[1:])[:, None], axis=-1).sum().item()


# Teacher-forced windows are long: a dense matmul on the dequantized planes is much faster on
# CPU and gives the same logits up to float rounding (see RunOptions.dense_min_rows).
_DENSE = RunOptions(dense_min_rows=32)
# The draft reads every lm_head row here: its perplexity is the W4 model's (a reduced draft
# vocabulary leaves it undefined); what speculation sees is `restrict_logits` of it
# at the model's draft vocabulary.
_READINGS = {
    "target": _DENSE,
    "float": replace(_DENSE, quantize_activations=False, quantize_kv=False),  # W8 weights only
    **{
        f"draft_kv{kv}": replace(_DENSE, mode="draft", draft_kv=kv, draft_vocab=False)
        for kv in DRAFT_KV
    },
}


def _against_target(
    d: mx.array, best: mx.array, p: mx.array, sampler: Sampler
) -> tuple[float, float]:
    """(positions where draft logits d pick the target's argmax `best`, Σ over positions of
    Σmin(p, q)), q the draft's distribution under `sampler`."""
    agreement = mx.sum(mx.argmax(d, -1) == best).item()
    return agreement, acceptance_probability(sampler.logprobs(d), p).sum().item()


def _logits(model, window: list[int], reading: str) -> mx.array:
    """Teacher-forced logits [T, V] of one reading (`_READINGS`)."""
    return model(mx.array(window)[None], options=_READINGS[reading])[0]


def sampled_acceptance(
    model,
    prompts: Mapping[str, Sequence[int]],
    gammas: Sequence[int] = GAMMAS,
    gen_tokens: int = GEN_TOKENS,
    sampler: Sampler = SAMPLING,
    seed: int = 0,
    rule: str = "rejection",
    draft_kv: int | str = "auto",
) -> dict:
    """Mean accepted drafts and tokens per round of the real speculative loop at each fixed γ
    (no adaptive controller, no fallback), seeded, over at least `gen_tokens` tokens per prompt
    (fewer where the model's context ends first). Rounds are counted whole: the loop runs
    without a token limit and is stopped after the round that reaches `gen_tokens`."""
    context = model.args.max_position_embeddings
    out = {}
    for gamma in gammas:
        accepted = rounds = drafted = 0
        per_prompt = {}
        for name, ids in prompts.items():
            n = max(min(gen_tokens, context - len(ids) - gamma - 2), 1)
            _, stats = speculate(
                model,
                ids,
                n,
                sampler,
                seed,
                "model",  # the W4 chain at this γ
                num_draft_tokens=gamma,
                adaptive=False,
                fallback=False,
                rule=rule,
                draft_kv=draft_kv,
                options=_DENSE,  # dense only for the prompt prefill: γ+1 rows stay quantized
            )
            per_prompt[name] = stats.mean_accepted
            accepted, rounds, drafted = (
                accepted + stats.accepted,
                rounds + stats.rounds,
                drafted + stats.drafted,
            )
        mean = accepted / rounds if rounds else 0.0
        out[str(gamma)] = {
            "mean_accepted": mean,
            "tokens_per_round": mean + 1,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "rounds": rounds,
            "per_prompt_mean_accepted": per_prompt,
        }
    return out


def evaluate(
    model,
    tokenizer,
    text: str,
    modes: Sequence[str] = ("target",),
    max_tokens: int = 2048,
    window: int = 512,
    gamma: int = 4,
    spec_tokens: int = 64,
    *,
    draft_kv: int | str = "auto",
    sampler: Sampler = SAMPLING,
    gammas: Sequence[int] = GAMMAS,
    gen_tokens: int = GEN_TOKENS,
    prompts: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    rule: str = "rejection",
    draft_source: str = "auto",
    draft_vocab_join: bool = True,
    progress: Progress | None = None,
) -> dict:
    """Scores of a bitnest model on the first `max_tokens` tokens of `text`, in `window`-token
    teacher-forced windows: perplexity and bits/byte of each mode; the draft/target greedy
    argmax agreement and the mean Σ min(p, q) of their `sampler` distributions (the draft
    reading its KV by `draft_kv` at the window length; both KV readings are also reported);
    the mean accepted length of the greedy speculative loop at `gamma` (`spec_tokens` tokens);
    the sampled speculative loop at each of `gammas` (`sampled_acceptance`, over `prompts`,
    default `builtin_prompts`; skipped when `gen_tokens` is 0); and the projected speedup by
    step time on an M4 Max (`speed_model.speed_model`, `step_costs`; i.i.d. only, at the
    windows' context, when `gen_tokens` is 0). The adaptive runs (`adaptive_runs`) follow
    `draft_source` and `draft_vocab_join`. `progress(stage, done, total)` is called as each
    stage's work is done (the CLI's progress bars)."""
    tick = progress or _silent
    # A prefix is enough (no token spans 16 characters) and avoids tokenizing a whole book.
    tokens = tokenizer.encode(text[: 16 * max_tokens], verbose=False)[:max_tokens]
    used_kv = resolve_draft_kv(draft_kv, model, min(window, len(tokens)))
    tally = _score_windows(model, tokenizer, windows(tokens, window), modes, sampler, used_kv, tick)
    mean_accepted = _greedy_accepted(model, tokens, spec_tokens, gamma, draft_kv)
    result = {
        "tokens": tally.n_pred,
        "bytes": tally.n_bytes,
        "modes": {m: tally.scores(m) for m in modes},
        **tally.against_target(used_kv, every_row=False),
        "draft_vocab": draft_tokens(model),
        "full_vocab_draft": tally.against_target(used_kv, every_row=True),  # see _Tally
        "mean_accepted": mean_accepted,
        "gamma": gamma,
        "sampling": {"temp": sampler.temp, "top_p": sampler.top_p, "seed": seed, "rule": rule},
        "draft_kv": _draft_kv(model, tally, draft_kv, used_kv),
    }
    if gen_tokens == 0 and gammas:  # the i.i.d. projection only, at the windows' context
        context = min(window, len(tokens))
        projected = dict.fromkeys(gammas)
        result["speed_model"] = _speed(model, context, draft_kv, result["sum_min_pq"], projected)
    if gen_tokens > 0 and gammas:
        prompts = builtin_prompts(tokenizer) if prompts is None else prompts
        runs, adaptive = (sampler, seed, rule, draft_kv), (draft_source, draft_vocab_join)
        result |= _speculative(model, prompts, gammas, gen_tokens, runs, adaptive, result, tick)
    result["verify_cost"] = verify_table()
    return result


@dataclass
class _Tally:
    """The teacher-forced windows' sums: negative log-likelihood per mode and per draft KV
    reading; per reading, the draft's argmax agreement with the target and its Σ min(p, q),
    over the rows speculation sees and over every lm_head row (`_all`; the same numbers
    without a draft vocabulary)."""

    nll: dict
    agree: dict = field(default_factory=lambda: dict.fromkeys(DRAFT_KV, 0.0))
    overlap: dict = field(default_factory=lambda: dict.fromkeys(DRAFT_KV, 0.0))
    agree_all: dict = field(default_factory=lambda: dict.fromkeys(DRAFT_KV, 0.0))
    overlap_all: dict = field(default_factory=lambda: dict.fromkeys(DRAFT_KV, 0.0))
    n_pred: int = 0
    n_bytes: int = 0
    n_positions: int = 0

    def scores(self, m) -> dict:
        nll = self.nll[m]
        return {
            "ppl": math.exp(nll / self.n_pred),
            "bits_per_byte": nll / math.log(2) / self.n_bytes,
        }

    def against_target(self, kv: int, every_row: bool) -> dict:
        agree, overlap = (
            (self.agree_all, self.overlap_all) if every_row else (self.agree, self.overlap)
        )
        return {
            "argmax_agreement": agree[kv] / self.n_positions,
            "sum_min_pq": overlap[kv] / self.n_positions,
        }


def _score_windows(
    model,
    tokenizer,
    scored: list[list[int]],
    modes: Sequence[str],
    sampler: Sampler,
    used_kv: int,
    tick: Progress,
) -> _Tally:
    """Every window teacher-forced in each reading, summed into a `_Tally` (the draft's
    mode reading its KV as `used_kv`)."""
    tally = _Tally(dict.fromkeys((*modes, *DRAFT_KV), 0.0))
    head = getattr(model, "draft_head", None)  # a reduced draft vocabulary (§2.9), or None
    for i, w in enumerate(scored):
        tick("scoring windows", i, len(scored))
        logits = {r: _logits(model, w, r) for r in ("target", *(f"draft_kv{k}" for k in DRAFT_KV))}
        if "float" in modes:
            logits["float"] = _logits(model, w, "float")
        p = sampler.logprobs(logits["target"])
        for m in modes:
            if m != "draft":
                tally.nll[m] += window_nll(logits[m], w)
        best = mx.argmax(logits["target"], -1)
        for kv in DRAFT_KV:
            d = logits[f"draft_kv{kv}"]
            tally.nll[kv] += window_nll(d, w)
            every_row = _against_target(d, best, p, sampler)
            # Without a draft vocabulary speculation sees every row: the same numbers.
            if head is not None:
                spec = _against_target(restrict_logits(d, head.ids), best, p, sampler)
            else:
                spec = every_row
            tally.agree_all[kv] += every_row[0]
            tally.overlap_all[kv] += every_row[1]
            tally.agree[kv] += spec[0]
            tally.overlap[kv] += spec[1]
        tally.n_positions += len(w)
        tally.n_pred += len(w) - 1
        tally.n_bytes += len(tokenizer.decode(w[1:]).encode("utf-8"))
    tick("scoring windows", len(scored), len(scored))
    tally.nll["draft"] = tally.nll[used_kv]
    return tally


def _draft_kv(model, tally: _Tally, policy: int | str, used_kv: int) -> dict:
    """The draft KV policy, the reading the windows used, and each reading's scores."""
    return {
        "policy": policy,
        "windows": used_kv,
        "kv8_context_limit": model_kv8_limit(model),
        "readings": {
            str(kv): {**tally.scores(kv), **tally.against_target(kv, every_row=False)}
            for kv in DRAFT_KV
        },
    }


def _greedy_accepted(
    model, tokens: list[int], spec_tokens: int, gamma: int, draft_kv: int | str
) -> float | None:
    """Mean accepted drafts of the greedy speculative loop at a fixed γ over `spec_tokens`
    tokens (None for none), from the text's start (at most 256 tokens, half of it) as the
    prompt."""
    if spec_tokens <= 0:
        return None
    stats = SpeculativeStats()
    prompt = mx.array(tokens[: min(len(tokens) // 2, 256)])
    steps = speculative_generate_step(
        prompt,
        model,
        max_tokens=spec_tokens,
        sampler=Sampler(),
        num_draft_tokens=gamma,
        fallback=False,
        stats=stats,
        adaptive=False,
        options=_DENSE,  # dense only for the prompt prefill: γ+1 rows stay quantized
        draft_kv=draft_kv,
    )
    for _ in steps:
        pass
    return stats.mean_accepted


def _speed(model, context: int, draft_kv: int | str, sum_min_pq: float, per_round: dict) -> dict:
    """The projected speedup at `context` tokens by step time on the projections' chip and path
    (`step_costs`: the model's kernels counted from its graph), the draft reading the KV the
    policy picks there (`per_round`: tokens per round measured at each γ, or None for the
    i.i.d. formula)."""
    kv = resolve_draft_kv(draft_kv, model, context)
    roof = roofline(model, context, kv)
    cost = cost_model(model, context, DEFAULT_CHIP, DEFAULT_PATH, draft_kv=kv)
    return {
        "context_tokens": context,
        "draft_kv": roof["draft_kv"],
        "bytes_per_token": roof["bytes_per_token"],
        "kernels_per_token": {"draft": cost.draft_step.kernels, "target": cost.target_step.kernels},
        **speed_model(roof["bytes_per_token"], sum_min_pq, per_round, cost=cost),
    }


def _speculative(
    model,
    prompts: Mapping[str, Sequence[int]],
    gammas: Sequence[int],
    gen_tokens: int,
    runs: tuple,
    adaptive: tuple,
    result: dict,
    tick: Progress,
) -> dict:
    """`speculative_sampling` (the fixed-γ sampled runs, then the adaptive ones) and the
    `speed_model` of the fixed-γ runs. `runs` is (sampler, seed, rule, draft_kv), `adaptive`
    (draft_source, draft_vocab_join)."""
    sampler, seed, rule, draft_kv = runs
    draft_source, draft_vocab_join = adaptive
    tick("speculative runs", 0, 2)
    fixed = sampled_acceptance(model, prompts, gammas, gen_tokens, sampler, seed, rule, draft_kv)
    tick("speculative runs", 1, 2)
    # The roofline at the runs' mean context (prompt + half the generated tokens).
    context = round(sum(len(ids) for ids in prompts.values()) / len(prompts) + gen_tokens / 2)
    per_round = {int(g): r["tokens_per_round"] for g, r in fixed.items()}
    sampling = {
        "gen_tokens": gen_tokens,
        "prompt_tokens": {name: len(ids) for name, ids in prompts.items()},
        "gammas": fixed,
    }
    speed = _speed(model, context, draft_kv, result["sum_min_pq"], per_round)
    sampling["adaptive"] = adaptive_runs(
        model,
        prompts,
        gen_tokens,
        sampler,
        seed,
        rule,
        draft_kv,
        draft_source,
        max(gammas),
        draft_vocab_join,
    )
    tick("speculative runs", 2, 2)
    return {"speculative_sampling": sampling, "speed_model": speed}


def adaptive_runs(
    model,
    prompts: Mapping[str, Sequence[int]],
    gen_tokens: int,
    sampler: Sampler,
    seed: int,
    rule: str,
    draft_kv: int | str,
    draft_source: str,
    num_draft_tokens: int,
    draft_vocab_join: bool = True,
) -> dict:
    """The loop as users run it (adaptive plans from `draft_source`, fallback on, seeded) over
    `prompts`: tokens per round of all rounds (target-only steps count as 1-token rounds), the
    per-source stats and each prompt's projected speedup per chip and v(M) path."""
    merged, per_prompt = run_prompts(
        model,
        prompts,
        gen_tokens,
        sampler,
        seed,
        draft_source,
        num_draft_tokens,
        rule=rule,
        draft_kv=draft_kv,
        options=_DENSE,
        draft_vocab_join=draft_vocab_join,
    )
    rounds = len(merged.round_log)
    return {
        "draft_source": draft_source,
        "draft_vocab_join": draft_vocab_join,
        "num_draft_tokens": num_draft_tokens,
        "tokens_per_round": sum(r.tokens for r in merged.round_log) / max(rounds, 1),
        "rounds": rounds,
        "target_steps": merged.target_steps,
        "sources": merged.sources,
        "projected_speedup": {name: p["projected_speedup"] for name, p in per_prompt.items()},
    }
