"""The run-time join of the context's token ids to a reduced draft vocabulary
(`layers.draft_vocab.DraftVocabJoin`): the joined ids are scored with the W4 lm_head's own rows,
the output stays the target's, and the join is one generation's, never the next one's."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from factory import copy_package, tiny_package

import bitnest_mlx
from bitnest_mlx.formats.bitnest.draft_vocab import add_draft_vocab
from bitnest_mlx.layers import draft_vocab
from bitnest_mlx.layers.draft_vocab import DraftVocabJoin
from bitnest_mlx.layers.dual_plane import keep_dense
from bitnest_mlx.runtime.sampling import make_sampler
from bitnest_mlx.runtime.speculative import SpeculativeStats, speculative_generate_step

VOCAB = 64
KEPT = np.array([i for i in range(VOCAB) if i % 3], dtype=np.int32)  # multiples of 3 left out
PROMPT = [30, 33, 36, 39, 42, 45, 48, 51]  # none of them kept


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """(the full-vocabulary package, the same with every multiple of 3 out of the draft's)."""
    root = tmp_path_factory.mktemp("draft_vocab_join")
    tiny_package(root / "full", seed=11, vocab=VOCAB, layers=2)
    reduced = copy_package(root / "full", root / "reduced")
    add_draft_vocab(reduced, KEPT, {"method": "test"})
    return root / "full", reduced


def _run(model, prompt, gamma, join, temp=0.0, seed=None, stats=None):
    """(token, from_draft) of a fixed-γ run of the W4 chain."""
    steps = speculative_generate_step(
        mx.array(prompt, dtype=mx.uint32),
        model,
        max_tokens=32,
        sampler=make_sampler(temp),
        num_draft_tokens=gamma,
        adaptive=False,
        fallback=False,
        draft_source="model",
        seed=seed,
        stats=stats,
        draft_vocab_join=join,
    )
    return [(t, d) for t, _, d in steps]


@pytest.mark.parametrize("dense", [False, True], ids=["quantized", "keep_dense"])
def test_joined_ids_get_the_full_w4_heads_logits_across_buffer_growth(packages, monkeypatch, dense):
    full, reduced = packages
    model, _ = bitnest_mlx.load(reduced)
    model_full, _ = bitnest_mlx.load(full)
    if dense:  # `bench --dense-weights`: the joined rows come from the float matrices
        keep_dense(model)
        keep_dense(model_full)
    monkeypatch.setattr(draft_vocab, "JOIN_CHUNK", 2)  # grow (and copy) several times
    join = DraftVocabJoin(model, PROMPT[:1])
    for t in PROMPT[1:]:
        join.add([t, 1, t])  # a kept id and a repeat: nothing gathered for them
    assert join.size == len(PROMPT)
    x = mx.array([[5, 9, 2, 7]])
    joined = np.array(model(x, options=bitnest_mlx.RunOptions(mode="draft", draft_join=join)))
    want = np.array(model_full(x, mode="draft"))
    seen = np.union1d(KEPT, PROMPT)
    np.testing.assert_allclose(joined[..., seen], want[..., seen], rtol=1e-5, atol=1e-5)
    assert np.all(np.isneginf(joined[..., np.setdiff1d(np.arange(VOCAB), seen)]))


def test_joined_draft_output_is_target_only_greedy_and_seeded(packages):
    _, reduced = packages
    model, _ = bitnest_mlx.load(reduced)
    want = _run(model, PROMPT, 0, join=False)
    got = _run(model, PROMPT, 3, join=True)
    assert [t for t, _ in got] == [t for t, _ in want]
    # The join let the chain propose (and the target accept) ids outside the kept vocabulary.
    assert any(d and t not in KEPT for t, d in got)
    for seed in (0, 1, 2):
        want = [t for t, _ in _run(model, PROMPT, 0, False, temp=0.7, seed=seed)]
        assert [t for t, _ in _run(model, PROMPT, 3, True, temp=0.7, seed=seed)] == want


def test_the_join_does_not_outlive_its_generation(packages):
    _, reduced = packages
    model, _ = bitnest_mlx.load(reduced)
    fresh, _ = bitnest_mlx.load(reduced)
    _run(model, PROMPT, 3, join=True)
    assert model.options.draft_join is None
    outside = np.setdiff1d(np.arange(VOCAB), KEPT)
    assert np.all(np.isneginf(np.array(model(mx.array([PROMPT]), mode="draft"))[..., outside]))
    # The next generation runs as on a model that never joined anything, with the join off...
    runs = {}
    for name, m in (("used", model), ("fresh", fresh)):
        stats = SpeculativeStats()
        runs[name] = (_run(m, [1, 2, 4], 3, join=False, stats=stats), stats.accepted)
    assert runs["used"] == runs["fresh"]
    assert not any(d and t not in KEPT for t, d in runs["used"][0])
    # ... and with it on: it gathers only its own context's ids.
    joined = {}
    for name, m in (("used", model), ("fresh", fresh)):
        stats = SpeculativeStats()
        _run(m, [1, 2, 4], 3, join=True, stats=stats)
        joined[name] = stats.draft_vocab_joined
    assert joined["used"] == joined["fresh"] > 0


def test_no_join_for_a_full_vocabulary_draft(packages):
    full, _ = packages
    model, _ = bitnest_mlx.load(full)
    assert DraftVocabJoin.for_model(model, PROMPT) is None
    stats = SpeculativeStats()
    _run(model, PROMPT, 3, join=True, stats=stats)
    assert stats.draft_vocab_joined == 0


@pytest.mark.parametrize("command", ["generate", "eval", "bench"])
def test_speculating_commands_take_the_join_flag(command):
    import importlib

    parser = importlib.import_module(f"bitnest_mlx.cli.{command}").build_parser()
    flag = {a.dest: a for a in parser._actions}["draft_vocab_join"]
    assert flag.option_strings == ["--draft-vocab-join"]
    assert (flag.choices, flag.default) == (("on", "off"), "on")
