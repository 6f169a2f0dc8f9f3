"""BatchNestedKVCache: mlx-lm's BatchGenerator decodes bitnest models in a batch, each row exactly
as it decodes alone (greedy, target mode), through merge / extend / filter / extract."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step

sys.path.insert(0, str(Path(__file__).parent))
from factory import make_package  # noqa: E402

from bitnest_mlx.layers.batch_nested_kv import BatchNestedKVCache  # noqa: E402
from bitnest_mlx.layers.nested_kv import NestedKVCache  # noqa: E402
from bitnest_mlx.runtime.demo import demo_path  # noqa: E402
from bitnest_mlx.runtime.loader import load_model  # noqa: E402

PROMPTS = ([1, 5, 9, 33, 12], [7, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11], [2] * 20)
MAX_TOKENS = (16, 9, 16, 12)  # rows leave the batch at different steps (filter)


@pytest.fixture(scope="module", params=["llama demo", "qwen2 (k bias offset)"])
def model(request, tmp_path_factory):
    if request.param == "llama demo":
        path = demo_path()
    else:
        path, _, _ = make_package(tmp_path_factory.mktemp("qwen2") / "pkg", "qwen2")
    m = load_model(path)
    m.mode = "target"
    return m


def alone(model, prompt: list[int], n: int) -> list[int]:
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for t, _ in steps]


def test_batched_rows_equal_each_sequence_decoded_alone(model):
    want = [alone(model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=2)
    uids = gen.insert(list(PROMPTS[:3]), max_tokens=list(MAX_TOKENS[:3]))
    got: dict[int, list[int]] = {u: [] for u in uids}
    steps = 0
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
        steps += 1
        if steps == 4:  # a late joiner: its prefill batch is extended into the running one
            uids += gen.insert([PROMPTS[3]], max_tokens=[MAX_TOKENS[3]])
            got[uids[-1]] = []
    assert [got[u] for u in uids] == want


def test_a_finished_rows_cache_is_the_sequence_alone(model):
    """The cache BatchGenerator hands back (extract) holds the row's tokens, no padding: the
    same planes as the cache of that sequence prefilled alone."""
    prompt = PROMPTS[2]
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    gen.insert([PROMPTS[1], prompt], max_tokens=[3, 3])
    finished = {}
    while responses := gen.next_generated():
        finished.update({r.uid: r for r in responses if r.finish_reason})
    row = finished[1]
    assert all(isinstance(c, NestedKVCache) for c in row.prompt_cache)
    single = model.make_cache()
    model(mx.array([row.all_tokens]), cache=single)
    for got, want in zip(row.prompt_cache, single):
        assert got.offset == want.offset == len(row.all_tokens)
        for a, b in zip(got.state, want.state):
            assert mx.array_equal(a, b)


def test_merge_pads_on_the_left_and_empty_caches_merge_to_no_planes(model):
    empty = BatchNestedKVCache.merge(model.make_cache()[:1] * 3)
    assert empty.keys is None and empty.offset.tolist() == [0, 0, 0]
    short, long = model.make_cache(), model.make_cache()
    model(mx.array([[1, 2]]), cache=short)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=long)
    batch = BatchNestedKVCache.merge([short[0], long[0]])
    assert batch.left_padding.tolist() == [3, 0] and batch.offset.tolist() == [2, 5]
    back = batch.extract(0)
    for a, b in zip(back.state, short[0].state):
        assert mx.array_equal(a, b)
