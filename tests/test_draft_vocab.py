"""The reduced draft vocabulary (docs/bitnest-package.md §2.9): the package extension, the
draft's head over the kept ids, and speculative output that stays the target's."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from factory import copy_package, edit_json, load_tensors, reseal, save_tensors, tiny_package

import bitnest_mlx
from bitnest_mlx.formats.bitnest import PackageError
from bitnest_mlx.formats.bitnest.draft_vocab import DRAFT_VOCAB, add_draft_vocab
from bitnest_mlx.runtime.sampling import make_sampler
from bitnest_mlx.runtime.speculative import SpeculativeStats, speculative_generate_step
from bitnest_mlx.runtime.token_bytes import head_bytes, weight_bytes

# The reports' kernels from the stored table (conftest.stored_kernels): not what these test.
pytestmark = pytest.mark.usefixtures("stored_kernels")

VOCAB = 64


def _generate(model, prompt, n, gamma, temp=0.0, seed=None, stats=None):
    steps = speculative_generate_step(
        mx.array(prompt, dtype=mx.uint32),
        model,
        max_tokens=n,
        sampler=make_sampler(temp),
        num_draft_tokens=gamma,
        adaptive=False,
        fallback=False,
        seed=seed,
        stats=stats,
    )
    return [t for t, _, _ in steps]


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """(full-vocabulary package, the same package with every third id dropped from the draft
    vocabulary except those the target-only greedy run emits first, and that run's tokens)."""
    root = tmp_path_factory.mktemp("draft_vocab")
    full = root / "full"
    model = tiny_package(full, seed=11, vocab=VOCAB, layers=2)
    target_only = _generate(model, [1, 2, 3], 24, gamma=0)
    reduced = copy_package(full, root / "reduced")
    # Keep 2/3 of the ids, never the target's second emitted token: the draft cannot propose it.
    missing = target_only[1]
    ids = np.array([i for i in range(VOCAB) if i % 3 and i != missing], dtype=np.int32)
    add_draft_vocab(reduced, ids, {"method": "test"})
    return full, reduced, ids, target_only


def test_package_with_draft_vocab_loads_and_draft_puts_no_mass_outside_it(packages):
    full, reduced, ids, _ = packages
    model_full, _ = bitnest_mlx.load(full)
    model, _ = bitnest_mlx.load(reduced)
    assert model.args.draft_vocab == ids.size
    x = mx.array([[5, 9, 2, 7]])
    draft = np.array(model(x, mode="draft"))
    draft_all = np.array(model_full(x, mode="draft"))
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    assert np.all(np.isneginf(draft[..., outside]))
    # The kept rows are the W4 lm_head's own rows: the same logits as the full draft there.
    np.testing.assert_allclose(draft[..., ids], draft_all[..., ids], rtol=1e-5, atol=1e-5)
    # The target, and the draft asked for every row, are unchanged by the extension.
    np.testing.assert_array_equal(np.array(model(x, mode="target")), np.array(model_full(x)))
    every_row = bitnest_mlx.RunOptions(mode="draft", draft_vocab=False)
    np.testing.assert_array_equal(np.array(model(x, options=every_row)), draft_all)


@pytest.mark.parametrize("gamma", [1, 3])
def test_reduced_draft_greedy_speculative_output_is_target_only_and_emits_unkept_token(
    packages, gamma
):
    _, reduced, ids, target_only = packages
    model, _ = bitnest_mlx.load(reduced)
    stats = SpeculativeStats()
    assert _generate(model, [1, 2, 3], 24, gamma, stats=stats) == target_only
    assert target_only[1] not in ids  # produced by the target although the draft cannot draft it
    assert stats.drafted > 0


def test_reduced_draft_seeded_gumbel_output_is_seeded_target_only(packages):
    _, reduced, _, _ = packages
    model, _ = bitnest_mlx.load(reduced)
    for seed in (0, 1, 2):
        want = _generate(model, [4, 5], 20, gamma=0, temp=1.0, seed=seed)
        assert _generate(model, [4, 5], 20, gamma=3, temp=1.0, seed=seed) == want


def test_reduced_draft_reads_fewer_lm_head_bytes(packages):
    full, reduced, ids, _ = packages
    model_full, _ = bitnest_mlx.load(full)
    model, _ = bitnest_mlx.load(reduced)
    d = model.args.hidden_size
    row = d // 2 + 2 * (d // model.args.group_size)  # hi nibbles, fp16 scales
    dropped = VOCAB - ids.size
    assert (
        head_bytes(model)["draft"] == head_bytes(model_full)["draft"] - dropped * row + 4 * ids.size
    )
    assert weight_bytes(model)["target"] == weight_bytes(model_full)["target"]


SHARD = "model-00002-of-00002.safetensors"  # where add_draft_vocab puts the ids


def _edit_ids(pkg, edit):
    tensors = load_tensors(pkg, SHARD)
    tensors[DRAFT_VOCAB] = edit(tensors[DRAFT_VOCAB])
    save_tensors(pkg, tensors, SHARD)
    reseal(pkg)


def _refused(pkg, match):
    with pytest.raises(PackageError, match=match):
        bitnest_mlx.load(pkg)


def test_reader_refuses_a_broken_draft_vocabulary(packages, tmp_path):
    _, reduced, ids, _ = packages
    cases = {
        "unsorted": (
            lambda p: _edit_ids(p, lambda ids: ids[::-1]),
            "expected strictly increasing ids",
        ),
        "out of range": (
            lambda p: _edit_ids(p, lambda ids: ids + VOCAB),
            rf"id {int(ids[0]) + VOCAB} at index 0, expected a token id in \[0, {VOCAB}\)",
        ),
        "wrong dtype": (
            lambda p: _edit_ids(p, lambda ids: ids.astype(mx.int64)),
            "draft.vocab: dtype int64 but expected int32",
        ),
        "size disagrees": (
            lambda p: edit_json(p, "bitnest.json", lambda m: m["draft"].update(vocab_size=3)),
            r"draft.vocab: shape \[\d+\] but expected int32 \[3\]",
        ),
        "larger than vocab": (
            lambda p: edit_json(p, "bitnest.json", lambda m: m["draft"].update(vocab_size=999)),
            "draft.vocab_size = 999, expected at most the vocabulary",
        ),
        "unknown key": (
            lambda p: edit_json(p, "bitnest.json", lambda m: m["draft"].update(top_p=0.9)),
            "draft.top_p: unknown key",
        ),
        "tensor without block": (
            lambda p: edit_json(p, "bitnest.json", lambda m: m.pop("draft")),
            "a draft vocabulary, but bitnest.json has no draft block",
        ),
    }
    for name, (breakage, match) in cases.items():
        pkg = copy_package(reduced, tmp_path / name.replace(" ", "_"))
        breakage(pkg)
        _refused(pkg, match)


def test_block_without_tensor_is_refused_and_adding_twice_is_refused(packages, tmp_path):
    full, reduced, ids, _ = packages
    pkg = copy_package(full, tmp_path / "block_only")
    edit_json(pkg, "bitnest.json", lambda m: m.update(draft={"vocab_size": 4}))
    _refused(pkg, "missing tensor draft.vocab")
    again = copy_package(reduced, tmp_path / "twice")
    with pytest.raises(PackageError, match="already has a draft block"):
        add_draft_vocab(again, ids)
    index = json.loads((reduced / "model.safetensors.index.json").read_text())
    assert index["weight_map"][DRAFT_VOCAB] == SHARD


# ---------------------------------------------------------------------------------------------
# The converter's choice (bitnest_mlx.measurement.draft_vocab_score, written by
# bitnest_mlx.convert.draft_vocab)


def test_ranking_weighs_each_source_once_and_breaks_ties_by_lower_id():
    from bitnest_mlx.measurement.draft_vocab_score import (
        candidate_sizes,
        rank_tokens,
        token_frequencies,
    )

    calibration = np.array([7] * 90 + [3] * 10)  # 7 most frequent there
    own = np.zeros(10)
    own[[5, 3]] = [2 / 3, 1 / 3]  # the model's own distribution: mostly 5
    order = rank_tokens([token_frequencies(calibration, 10), own])
    # scores: 7 → 0.9, 5 → 0.667, 3 → 0.1 + 0.333; the unseen ids follow in id order
    assert order.tolist() == [7, 5, 3, 0, 1, 2, 4, 6, 8, 9]
    assert candidate_sizes(8192) == [8192]
    assert candidate_sizes(49152) == [8192, 16384, 32768, 49152]


def test_held_out_sequences_are_the_last_ones_and_never_more_than_half():
    from bitnest_mlx.measurement.draft_vocab_score import HELD_OUT_TOKENS, split_held_out

    calibration = np.arange(40 * 256).reshape(40, 256)
    rest, held = split_held_out(calibration)
    assert held.size == HELD_OUT_TOKENS == 1024
    np.testing.assert_array_equal(held, calibration[-4:])
    np.testing.assert_array_equal(rest, calibration[:-4])
    assert split_held_out(np.zeros((3, 64)))[1].shape == (1, 64)  # 16 wanted, 1 allowed
    one = np.zeros((1, 8))
    assert all(part is one for part in split_held_out(one))


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory):
    """A one-layer package with a 20k vocabulary: lm_head dominates its draft's bytes."""
    return tiny_package(tmp_path_factory.mktemp("wide") / "pkg", seed=5, vocab=20000)


def test_bytes_model_drops_rows_only_when_the_acceptance_pays_for_them(wide_vocab_model):
    from bitnest_mlx.measurement import draft_vocab_score as draft_vocab

    model = wide_vocab_model
    sizes = draft_vocab.candidate_sizes(20000)
    assert sizes == [8192, 16384, 20000]
    # The same acceptance at every K: the fewest rows are the cheapest draft.
    k, table = draft_vocab.choose_draft_vocab(model, dict.fromkeys(sizes, 0.8), context=64)
    assert k == 8192 and table["8192"]["speedup"] > table["20000"]["speedup"]
    assert table["8192"]["cost_ratio"] < table["16384"]["cost_ratio"] < table["20000"]["cost_ratio"]
    assert model.draft_head is None  # the trial heads are gone
    # Acceptance collapsing without the last rows: the full vocabulary wins.
    alphas = {8192: 0.3, 16384: 0.5, 20000: 0.8}
    k, table = draft_vocab.choose_draft_vocab(model, alphas, context=64)
    assert k == 20000 and table["20000"]["acceptance"] == 0.8


def test_acceptance_is_the_drafts_sum_min_and_the_own_text_the_targets_mean_distribution(
    wide_vocab_model,
):
    from bitnest_mlx.measurement.draft_vocab_score import acceptance_by_size
    from bitnest_mlx.measurement.evaluation import SAMPLING
    from bitnest_mlx.runtime.sampling import Sampler, acceptance_probability

    model = wide_vocab_model
    ids, start = [5, 17, 300, 9, 12000, 4], 2
    alphas, own = acceptance_by_size(model, [(ids, start)], np.arange(20000))
    x = mx.array(ids)[None]
    temp = Sampler(temp=SAMPLING.temp)  # the eval's temperature, no nucleus
    p = temp.logprobs(model(x, mode="target")[0, start - 1 : -1])
    q = temp.logprobs(model(x, mode="draft")[0, start - 1 : -1])
    want = acceptance_probability(q, p).mean().item()
    assert alphas[20000] == pytest.approx(want, rel=1e-4)
    assert 0 < alphas[8192] < 1
    np.testing.assert_allclose(own, np.array(mx.exp(p).mean(axis=0)), rtol=1e-4, atol=1e-9)
    assert own.sum() == pytest.approx(1.0, rel=1e-4)


def test_build_draft_vocab_stores_the_top_k_of_both_sources_in_the_package(tmp_path):
    from bitnest_mlx.convert.draft_vocab import build_draft_vocab

    tiny_package(tmp_path / "pkg", seed=2, vocab=300)  # the byte tokenizer's 257 ids fit
    rng = np.random.default_rng(0)
    calibration = rng.choice([9, 40, 263, 7, 70], size=(6, 32))  # 6 sequences of 32
    record = build_draft_vocab(tmp_path / "pkg", calibration, size=16)
    model, _ = bitnest_mlx.load(tmp_path / "pkg")
    kept = np.array(model.draft_head.ids).tolist()
    assert record["vocab_size"] == 16 == len(kept) and {9, 40, 263, 7, 70} <= set(kept)
    assert record["held_out_tokens"] == 3 * 32  # half of the sequences at most
    assert all(0 < r["acceptance"] <= 1 for r in record["candidates"].values())
    assert record["chosen_by"] == "--draft-vocab"
    full = build_draft_vocab(
        copy_package(tmp_path / "pkg", tmp_path / "again"), calibration, "full"
    )
    assert full == {"vocab_size": 300, "kept": "full"}


def test_evaluation_scores_the_w4_model_and_the_reduced_draft_separately(packages):
    from bitnest_mlx.measurement.evaluation import evaluate

    full, reduced, ids, _ = packages
    text = "12 + 34 = 46; 7 * 8 = 56, (9 - 3) / 2 = 3. " * 8  # bytes < 64: ids in the vocabulary
    scores = {}
    for name, pkg in (("full", full), ("reduced", reduced)):
        model, tokenizer = bitnest_mlx.load(pkg)
        scores[name] = evaluate(
            model, tokenizer, text, ("target", "draft"), 128, 64, spec_tokens=0, gen_tokens=0
        )
    a, b = scores["full"], scores["reduced"]
    # The W4 model's perplexity does not depend on the draft vocabulary (finite, the same).
    assert a["modes"]["draft"]["ppl"] == pytest.approx(b["modes"]["draft"]["ppl"], rel=1e-6)
    assert b["draft_vocab"] == ids.size and a["draft_vocab"] == VOCAB
    assert b["full_vocab_draft"]["sum_min_pq"] == pytest.approx(a["sum_min_pq"], rel=1e-6)
    assert b["sum_min_pq"] < a["sum_min_pq"]  # a third of the ids gone costs acceptance
    assert b["speed_model"]["cost_ratio"] < a["speed_model"]["cost_ratio"]


def test_mlx_lm_speculation_with_a_reduced_draft_is_lossless(packages):
    bitnest_mlx.register_mlx_lm()  # a no-op when the installed hook already did it
    import mlx_lm

    _, reduced, ids, _ = packages
    model, tokenizer = mlx_lm.load(str(reduced))
    draft, _ = mlx_lm.load(f"{reduced}#draft")
    prompt = [int(b) for b in b"12 + 34 = "]  # bytes < 64: ids inside the package's vocabulary
    plain = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=16)]
    spec = list(
        mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens=16, draft_model=draft, num_draft_tokens=3
        )
    )
    assert [r.token for r in spec] == plain
    # A drafted token is a kept id, or one of the text before it: the run-time join scores the
    # context's ids too, and an n-gram copy takes its tokens from that text.
    kept, before = set(ids.tolist()), list(prompt)
    for r in spec:
        assert not r.from_draft or r.token in kept or r.token in before, r.token
        before.append(r.token)
