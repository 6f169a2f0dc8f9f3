"""Choosing a package's reduced draft vocabulary (docs/bitnest-package.md §2.9, docs/convert.md).

Tokens are ranked by how often they occur in the calibration text and in the target's own
generations on the built-in prompts (each source weighted 1, so a large calibration set does not
drown what the model itself writes); ties go to the lower id, since BPE vocabularies number
tokens in merge order, roughly by frequency in the tokenizer's own corpus.

The size K comes from the bytes model (`roofline`): a draft over K ids reads fewer lm_head bytes
per token (cost ratio c_K) but cannot propose a token outside them. Its acceptance α_K is
measured directly: the mean Σ min(p, q_K) over the generated positions, teacher-forced, with q_K
the draft restricted to the top K of the ranking built without those generations (held out).
K maximises the projected speedup tokens(α_K, γ) / (γ·c_K + 1) at the best γ, among powers of
two from 8192 below the vocabulary and the full vocabulary; no constant is fitted.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..evaluation import SAMPLING, builtin_prompts
from ..formats.bitnest.draft_vocab import add_draft_vocab
from ..formats.bitnest.files import read_json
from ..layers.draft_vocab import DraftVocabHead, restrict_logits
from ..layers.options import RunOptions
from ..roofline import best_iid_speedup, roofline
from ..sampling import acceptance_probability
from ..speculative import speculative_generate_step

SMALLEST_K = 8192
GEN_TOKENS = 128  # per built-in prompt: the target's own text, beside the calibration text
# Whole texts at once: the dense path (RunOptions.dense_min_rows), as eval's teacher forcing.
TEACHER_FORCED = RunOptions(dense_min_rows=32)


def candidate_sizes(vocab_size: int) -> list[int]:
    """8192, 16384, ... below the vocabulary, then the vocabulary itself (no reduction)."""
    sizes = [k for k in (SMALLEST_K << i for i in range(32)) if k < vocab_size]
    return [*sizes, vocab_size]


def rank_tokens(sources: list[np.ndarray], vocab_size: int) -> np.ndarray:
    """Every token id, most frequent first: each source's relative frequencies summed (a source
    weighs 1 whatever its length), ties to the lower id."""
    score = np.zeros(vocab_size)
    for ids in sources:
        if ids.size:
            score += np.bincount(ids.ravel(), minlength=vocab_size)[:vocab_size] / ids.size
    return np.lexsort((np.arange(vocab_size), -score))


def generate_with_target(model, tokenizer, seed: int = 0) -> list[tuple[list[int], int]]:
    """The target's own text on the built-in prompts: (prompt + GEN_TOKENS sampled tokens,
    prompt length) per prompt, seeded, target-only (`SAMPLING`, the eval's settings)."""
    out = []
    for ids in builtin_prompts(tokenizer).values():
        steps = speculative_generate_step(
            mx.array(ids, dtype=mx.uint32),
            model,
            max_tokens=GEN_TOKENS,
            sampler=SAMPLING,
            num_draft_tokens=0,
            seed=seed,
        )
        out.append((list(ids) + [t for t, _, _ in steps], len(ids)))
    return out


def generated_tokens(texts: list[tuple[list[int], int]]) -> np.ndarray:
    """The generated part of `generate_with_target`'s texts, as one array of ids."""
    return np.array([t for ids, start in texts for t in ids[start:]], dtype=np.int64)


def acceptance_by_size(model, texts: list[tuple[list[int], int]], ranked: np.ndarray) -> dict:
    """α_K for each candidate K: mean Σ min(p, q_K) over the generated positions of `texts`
    (teacher-forced), q_K the W4 draft restricted to the first K ids of `ranked`."""
    vocab = model.args.vocab_size
    sizes = candidate_sizes(vocab)
    total, n = dict.fromkeys(sizes, 0.0), 0
    for ids, start in texts:
        x = mx.array(ids)[None]
        p = SAMPLING.logprobs(model(x, options=TEACHER_FORCED)[0, start - 1 : -1])
        every_row = replace(TEACHER_FORCED, mode="draft", draft_vocab=False)
        draft = model(x, options=every_row)[0, start - 1 : -1]
        for k in sizes:
            q = SAMPLING.logprobs(restrict_logits(draft, mx.array(ranked[:k])))
            total[k] += acceptance_probability(q, p).sum().item()
        n += len(ids) - start
    return {k: total[k] / max(n, 1) for k in sizes}


def choose_draft_vocab(
    model, calibration: np.ndarray, texts: list[tuple[list[int], int]], context: int
) -> tuple[int, dict]:
    """K by the bytes model (module docstring) and the table behind the choice."""
    vocab = model.args.vocab_size
    held_out = rank_tokens([calibration], vocab)
    alphas = acceptance_by_size(model, texts, held_out)
    rows = {}
    for k, alpha in alphas.items():
        if k < vocab:
            ids = mx.array(np.sort(held_out[:k]).astype(np.int32))
            model.draft_head = DraftVocabHead.from_lm_head(model.lm_head, ids)
        roof = roofline(model, context)["bytes_per_token"]
        model.draft_head = None
        c = roof["draft"] / roof["target"]
        speedup, gamma = best_iid_speedup(alpha, c)
        rows[str(k)] = {
            "acceptance": round(alpha, 4),
            "cost_ratio": round(c, 4),
            "speedup": round(speedup, 4),
            "gamma": gamma,
        }
    # The largest K within float noise of the best: fewer ids only when they pay.
    top = max(r["speedup"] for r in rows.values())
    k = max(int(k) for k, r in rows.items() if r["speedup"] >= top - 1e-9)
    return k, rows


def build_draft_vocab(
    package: str | Path, calibration: np.ndarray, size: int | str = "auto", seed: int = 0
) -> dict:
    """Rank the tokens of a written package's vocabulary and store the top K as its draft
    vocabulary (`add_draft_vocab`), K = `size` or, for "auto", `choose_draft_vocab`'s; "full"
    or a K of at least the vocabulary stores none. Returns the record kept in the manifest's
    `draft.ranking` (the same without a draft block)."""
    from ..loader import load

    tic = time.perf_counter()
    # The writer's config.json: nothing to load when every row stays.
    vocab = read_json(Path(package) / "config.json")["vocab_size"]
    full = size == "full" or (isinstance(size, int) and size >= vocab)
    if full or (size == "auto" and candidate_sizes(vocab) == [vocab]):
        return {"vocab_size": vocab, "kept": "full"}
    model, tokenizer = load(package)
    texts = generate_with_target(model, tokenizer, seed)
    generated = generated_tokens(texts)
    context = math.ceil(np.mean([len(ids) for ids, _ in texts]))
    k, table = choose_draft_vocab(model, calibration, texts, context)
    k = k if size == "auto" else int(size)
    record = {
        "method": "frequency in the calibration text + the target's generations on the "
        "built-in prompts, each weighted 1; ties to the lower id",
        "calibration_tokens": int(calibration.size),
        "generated_tokens": int(generated.size),
        "chosen_by": "bytes model" if size == "auto" else "--draft-vocab",
        "candidates": table,
        "seconds": round(time.perf_counter() - tic, 1),
    }
    del model
    if k >= vocab:
        return {"vocab_size": vocab, "kept": "full", **record}
    ranked = rank_tokens([calibration, generated], vocab)
    add_draft_vocab(package, np.sort(ranked[:k]), record)
    return {"vocab_size": k, **record}
