"""Scoring a package's reduced draft vocabulary: the converter's one call into the runtime
(`score_draft_vocabulary`; docs/bitnest-package.md §2.9, docs/convert.md).

Tokens are ranked by two frequencies, each weighted 1 (so a large calibration set does not drown
what the model itself writes): how often they occur in the calibration text, and the target's
own next-token distribution averaged over held-out calibration sequences (teacher-forced: what
the model would write at each of their positions); ties go to the lower id, since BPE
vocabularies number tokens in merge order, roughly by frequency in the tokenizer's own corpus.
Teacher forcing costs two batched passes over those sequences; sampling the model's own text
would cost one decode step per token, which on a CPU is most of a conversion's time.

The size K comes from the step-time model (`roofline` bytes, `step_kernels.STORED` kernels, the
projections' chip and path): a draft over K ids reads fewer lm_head bytes per token (cost ratio
c_K) but cannot propose a token outside them. Its acceptance α_K is measured directly: the mean
Σ min(p, q_K) over the held-out positions, with q_K the draft restricted to the top K of the
ranking built without those sequences. K maximises the projected speedup tokens(α_K, γ) /
(chain of γ at the step-time costs) at the best γ, among powers of two from 8192 below the
vocabulary and the full vocabulary; no constant is fitted here. The kernels are the runtime's
stored counts (a decision, like the controller's at run time: counting the package's graph
would add minutes to a conversion); a reduced vocabulary's few gathers are not among them.

The converter (`convert/draft_vocab.py`) writes what this chooses; it imports nothing else from
above its rank (tests/test_architecture.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.bitnest.files import read_json
from ..layers.draft_vocab import DraftVocabHead
from ..layers.options import RunOptions
from ..runtime.loader import load
from ..runtime.speed_model import DEFAULT_CHIP, DEFAULT_PATH, best_iid_speedup
from ..runtime.step_kernels import STORED
from .evaluation import SAMPLING
from .step_costs import cost_model

SMALLEST_K = 8192
HELD_OUT_TOKENS = 1024  # calibration positions teacher-forced for α_K and the model's own text
# Whole sequences at once: the dense path (RunOptions.dense_min_rows), as eval's teacher forcing.
TEACHER_FORCED = RunOptions(dense_min_rows=32)
# Positions per teacher-forced call: its sequences share one dequantization of the weights, and
# its [positions, V] float32 logits (several alive at once) stay ~150 MB each at V = 152k.
TEACHER_ROWS = 256
METHOD = (
    "frequency in the calibration text + the target's next-token distribution on held-out "
    "calibration sequences (teacher-forced), each weighted 1; ties to the lower id"
)


def candidate_sizes(vocab_size: int) -> list[int]:
    """8192, 16384, ... below the vocabulary, then the vocabulary itself (no reduction)."""
    sizes = [k for k in (SMALLEST_K << i for i in range(32)) if k < vocab_size]
    return [*sizes, vocab_size]


def token_frequencies(ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """Each id's share of `ids` [vocab_size] (zeros when there are none)."""
    if not ids.size:
        return np.zeros(vocab_size)
    return np.bincount(ids.ravel(), minlength=vocab_size)[:vocab_size] / ids.size


def rank_tokens(frequencies: list[np.ndarray]) -> np.ndarray:
    """Every token id, most frequent first by the summed frequencies ([V] each, summing to 1:
    each source weighs 1 whatever its length), ties to the lower id."""
    score = np.sum(frequencies, axis=0)
    return np.lexsort((np.arange(len(score)), -score))


def split_held_out(calibration: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ranking part, held-out sequences) of calibration tokens [n_seq, seq_len]: the last
    ⌈HELD_OUT_TOKENS / seq_len⌉ sequences, at most half of them, are held out. A single
    sequence is both (nothing can be held out)."""
    n, length = calibration.shape
    if n == 1:
        return calibration, calibration
    m = min(-(-HELD_OUT_TOKENS // length), n // 2)
    return calibration[:-m], calibration[-m:]


def _batches(texts: list[tuple[list[int], int]]) -> list[list[tuple[list[int], int]]]:
    """Consecutive texts of one length and start, up to TEACHER_ROWS positions a batch."""
    out: list[list] = []
    for text in texts:
        last = out[-1] if out else None
        fits = last and (len(last) + 1) * len(text[0]) <= TEACHER_ROWS
        if last and fits and (len(last[0][0]), last[0][1]) == (len(text[0]), text[1]):
            last.append(text)
        else:
            out.append([text])
    return out


def _scaled_logits(model, x: mx.array, start: int, options: RunOptions) -> mx.array:
    """float32 logits / T [rows × positions from `start` on, V] of token batch `x`, each
    position's for the token after it."""
    logits = model(x, options=options)[:, start - 1 : -1].astype(mx.float32)
    return logits.reshape(-1, logits.shape[-1]) / SAMPLING.temp


def acceptance_by_size(
    model, texts: list[tuple[list[int], int]], ranked: np.ndarray
) -> tuple[dict[int, float], np.ndarray]:
    """(α_K for each candidate K, the target's mean next-token distribution [V]) over the
    positions of `texts` (ids, start) from `start` on, teacher-forced: α_K is the mean
    Σ min(p, q_K), q_K the W4 draft restricted to the first K ids of `ranked`, both at the
    eval's temperature. Without its nucleus (top-p): that is a sort of every row per K, which
    costs more than the forward passes, and it changes α_K alike at every K."""
    vocab = model.args.vocab_size
    sizes = candidate_sizes(vocab)
    total, n = dict.fromkeys(sizes, 0.0), 0
    own = mx.zeros((vocab,))
    every_row = replace(TEACHER_FORCED, mode="draft", draft_vocab=False)
    for batch in _batches(texts):
        x, start = mx.array([ids for ids, _ in batch]), batch[0][1]
        p = mx.softmax(_scaled_logits(model, x, start, TEACHER_FORCED), axis=-1)
        own = own + p.sum(axis=0)
        mx.eval(p, own)  # the target's logits are freed before the draft's are made
        draft = _scaled_logits(model, x, start, every_row)
        for k in sizes:  # q_K is zero outside its ids: Σ min(p, q_K) over those columns only
            ids = mx.array(ranked[:k])
            q = mx.softmax(mx.take(draft, ids, axis=-1), axis=-1)
            total[k] += mx.minimum(q, mx.take(p, ids, axis=-1)).sum().item()
        n += len(p)
    return {k: total[k] / max(n, 1) for k in sizes}, np.array(own) / max(n, 1)


def choose_draft_vocab(model, alphas: dict[int, float], context: int) -> tuple[int, dict]:
    """K by the step-time model (module docstring) from the measured α_K, and the table behind
    it."""
    vocab = model.args.vocab_size
    rows = {}
    for k, alpha in alphas.items():
        if k < vocab:
            ids = mx.array(np.arange(k, dtype=np.int32))  # which ids does not change the bytes
            model.draft_head = DraftVocabHead.from_lm_head(model.lm_head, ids)
        cost = cost_model(model, context, DEFAULT_CHIP, DEFAULT_PATH, counts=STORED)
        model.draft_head = None
        speedup, gamma = best_iid_speedup(alpha, cost)
        rows[str(k)] = {
            "acceptance": round(alpha, 4),
            "cost_ratio": round(cost.cost_ratio, 4),
            "speedup": round(speedup, 4),
            "gamma": gamma,
        }
    # The largest K within float noise of the best: fewer ids only when they pay.
    top = max(r["speedup"] for r in rows.values())
    k = max(int(k) for k, r in rows.items() if r["speedup"] >= top - 1e-9)
    return k, rows


def rank_package_tokens(model, calibration: np.ndarray) -> tuple[np.ndarray, dict[int, float]]:
    """(the ranking of every id, α_K per candidate K) for a loaded package and its calibration
    tokens [n_seq, seq_len]: α_K measured on the held-out sequences with the ranking of the
    rest, the returned ranking from all of the calibration text and the target's own
    distribution on the held-out sequences."""
    vocab = model.args.vocab_size
    rest, held = split_held_out(calibration)
    texts = [([int(t) for t in seq], 1) for seq in held]
    alphas, own = acceptance_by_size(model, texts, rank_tokens([token_frequencies(rest, vocab)]))
    return rank_tokens([token_frequencies(calibration, vocab), own]), alphas


@dataclass(frozen=True)
class DraftVocabulary:
    """What `score_draft_vocabulary` chose for a package."""

    vocab_size: int  # the kept ids' count; the full vocabulary's size when none is dropped
    ids: np.ndarray | None  # the kept ids, sorted; None: the full vocabulary (no draft block)
    record: dict  # the manifest's `draft.ranking` record ({} when nothing was loaded)


def score_draft_vocabulary(
    package: str | Path, calibration: np.ndarray, size: int | str = "auto"
) -> DraftVocabulary:
    """Load a written package and choose its draft vocabulary: rank the tokens of its
    vocabulary and keep the top K, K = `size` or, for "auto", `choose_draft_vocab`'s; "full" or
    a K of at least the vocabulary keeps all (nothing is loaded when that is known from the
    config). `calibration` is [n_seq, seq_len]."""
    tic = time.perf_counter()
    # The writer's config.json: nothing to load when every row stays.
    vocab = read_json(Path(package) / "config.json")["vocab_size"]
    full = size == "full" or (isinstance(size, int) and size >= vocab)
    if full or (size == "auto" and candidate_sizes(vocab) == [vocab]):
        return DraftVocabulary(vocab, None, {})
    calibration = np.atleast_2d(calibration)
    model, _ = load(package)
    ranked, alphas = rank_package_tokens(model, calibration)
    k, table = choose_draft_vocab(model, alphas, context=calibration.shape[1])
    del model
    k = k if size == "auto" else int(size)
    record = {
        "method": METHOD,
        "calibration_tokens": int(calibration.size),
        "held_out_tokens": int(split_held_out(calibration)[1].size),
        "chosen_by": "step-time model" if size == "auto" else "--draft-vocab",
        "candidates": table,
        "seconds": round(time.perf_counter() - tic, 1),
    }
    if k >= vocab:
        return DraftVocabulary(vocab, None, record)
    return DraftVocabulary(k, np.sort(ranked[:k]), record)
