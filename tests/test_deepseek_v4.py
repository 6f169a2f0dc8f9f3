"""DeepSeek-V4 model: logits equal transformers' DeepseekV4ForCausalLM (same float weights, fp32).

The tiny config has every feature on: hash layers 0-2, compress ratios 0/4/128, index_topk 4
(smaller than the compressed pool), a window of 8, and T = 300 so both compressors emit entries
(75 at ratio 4, 2 at ratio 128). The model is causal, so every incremental schedule (single steps,
5-token chunks, verify / accept / roll back) must reproduce the full-prefill logits.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import tools
from bitnest_mlx.models.deepseek_v4 import Model
from factory import dsv4_hf_state_dict, dsv4_model

from bitnest_mlx.layers.dsv4_ops import fp4_fake_quant, fp8_fake_quant
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.runtime.demo import TINY_CONFIG, random_weights

T, PREFILL, TOL = 300, 131, 1e-4  # PREFILL is not a multiple of 4: pending rows carry over


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY_CONFIG, seed=0)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(1).integers(2, TINY_CONFIG["vocab_size"], T)


@pytest.fixture(scope="module")
def reference(weights, tokens):
    """transformers' full-prefill logits [T, V] for the same weights."""
    torch = tools.reference("torch", why="transformers' DeepSeek-V4 runs on it")
    # setup.py's test extra pins the transformers that has it (and that parity was measured on).
    hf_mod = tools.reference("transformers.models.deepseek_v4", why="the reference model")
    torch.manual_seed(0)
    hf = hf_mod.DeepseekV4ForCausalLM(hf_mod.DeepseekV4Config(**TINY_CONFIG)).eval().float()
    hf.load_state_dict(dsv4_hf_state_dict(weights), strict=True)
    with torch.no_grad():
        return hf(input_ids=torch.from_numpy(tokens)[None]).logits[0].numpy()


@pytest.fixture(scope="module")
def model(weights):
    return dsv4_model(weights)


def _run_chunks(model: Model, tokens: np.ndarray, sizes: list[int]) -> np.ndarray:
    cache, outs, pos = model.make_cache(), [], 0
    for n in sizes:
        outs.append(np.array(model(mx.array(tokens[pos : pos + n])[None], cache))[0])
        pos += n
    assert pos == len(tokens)
    return np.concatenate(outs)


def test_full_prefill_matches_transformers(model, tokens, reference):
    logits = np.array(model(mx.array(tokens)[None]))[0]
    assert logits.shape == (T, TINY_CONFIG["vocab_size"])
    assert np.abs(logits - reference).max() <= TOL


def test_prefill_then_single_tokens_match_transformers(model, tokens, reference):
    logits = _run_chunks(model, tokens, [PREFILL] + [1] * (T - PREFILL))
    assert np.abs(logits - reference).max() <= TOL


def test_prefill_then_five_token_chunks_match_transformers(model, tokens, reference):
    rest = T - PREFILL
    logits = _run_chunks(model, tokens, [PREFILL] + [5] * (rest // 5) + [rest % 5])
    assert np.abs(logits - reference).max() <= TOL


def test_verify_accept_rollback_sequence_matches_transformers(model, tokens, reference):
    """Random (verify k, accept a, roll back k - a) rounds with wrong drafts after the accepted
    ones: the logits of every accepted position equal the full prefill's."""
    rng = np.random.default_rng(3)
    cache = model.make_cache()
    got = list(np.array(model(mx.array(tokens[:PREFILL])[None], cache))[0])
    pos, rolled_back = PREFILL, 0
    while pos < T:
        k = min(int(rng.integers(1, 7)), T - pos)
        a = int(rng.integers(1, k + 1))
        drafts = np.array(tokens[pos : pos + k])
        drafts[a:] = (drafts[a:] + 1 + rng.integers(0, 200, k - a)) % TINY_CONFIG["vocab_size"]
        logits = np.array(model(mx.array(drafts)[None], cache))[0]
        got.extend(logits[:a])
        for c in cache:
            c.trim(k - a)
        pos, rolled_back = pos + a, rolled_back + k - a
    assert rolled_back > 50  # the schedule really exercised rollback
    assert all(c.offset == T for c in cache)
    assert np.abs(np.stack(got) - reference).max() <= TOL


def test_indexer_top_k_changes_the_logits(weights, tokens, reference):
    """Guards the parity tests: with top-k >= the pool the indexer selects everything, which
    must give different logits, so the tiny config really exercises sparse selection."""
    dense = np.array(dsv4_model(weights, index_topk=1000)(mx.array(tokens)[None]))[0]
    assert np.abs(dense - reference).max() > 1e-2


def test_rollback_past_kept_history_is_refused(model, tokens):
    cache = model.make_cache(max_rollback=4)
    model(mx.array(tokens[:40])[None], cache)
    with pytest.raises(ValueError, match="cannot roll back 5 tokens"):
        cache[0].trim(5)
    cache[0].trim(4)
    assert cache[0].offset == 36


def test_cache_keeps_bounded_history(model, tokens):
    """Window rows: window - 1 + max_rollback; raw compressor rows: at most a few blocks."""
    cache = model.make_cache(max_rollback=6)
    for pos in range(0, 200, 20):
        model(mx.array(tokens[pos : pos + 20])[None], cache)
    window = TINY_CONFIG["sliding_window"]
    for c in cache:
        assert c.keys.shape[2] == window - 1 + 6
        for pool in c.pools.values():
            assert pool.kv.shape[1] <= 2 * pool.ratio + 6
            assert pool.entries.shape[1] == 200 // pool.ratio


def test_fp8_fake_quant_matches_torch_e4m3_with_power_of_two_block_scales():
    torch = tools.reference("torch", why="its float8_e4m3fn is the reference rounding")
    x = np.random.default_rng(0).standard_normal((3, 128)).astype(np.float32) * [[1e-3], [1], [300]]
    blocks = torch.from_numpy(x).reshape(3, 2, 64)
    amax = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.pow(2.0, torch.ceil(torch.log2(amax / 448.0)))
    ref = (blocks / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    got = np.array(fp8_fake_quant(mx.array(x)))
    np.testing.assert_array_equal(got, ref.reshape(3, 128).numpy())
    assert not np.array_equal(got, x)


def test_fp4_fake_quant_rounds_to_nearest_even_on_the_e2m1_grid():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    # One block with amax 6 (scale 1): midpoints go to the even-mantissa neighbour.
    x = np.zeros(32, np.float32)
    x[:10] = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.5, 2.9]
    want = np.zeros(32, np.float32)
    want[:10] = [6, 0, 1, 1, 2, 2, 4, 4, -6, 3]
    np.testing.assert_array_equal(np.array(fp4_fake_quant(mx.array(x))), want)
    # A scaled block stays on scale · grid.
    y = np.random.default_rng(1).standard_normal(32).astype(np.float32) * 0.01
    q = np.array(fp4_fake_quant(mx.array(y)))
    scale = 2.0 ** np.ceil(np.log2(np.abs(y).max() / 6))
    assert np.isin(np.abs(q) / scale, grid).all()


def test_qat_switch_is_off_by_default_and_consistent_across_schedules(weights, tokens):
    model = dsv4_model(weights)
    assert model.options.qat is False
    short = tokens[:160]
    plain = np.array(model(mx.array(short)[None]))[0]
    model.options = RunOptions(qat=True)  # the call defaults, as the loader sets them
    full = np.array(model(mx.array(short)[None]))[0]
    chunked = _run_chunks(model, short, [61] + [3] * 33)
    assert np.abs(full - plain).max() > 1e-2  # the simulation does something
    assert np.abs(chunked - full).max() <= TOL
