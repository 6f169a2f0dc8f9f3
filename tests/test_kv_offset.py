"""Qwen2's large k bias stays out of the nested KV planes (kv.per_channel_offset = "k_bias")."""

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")

from factory import VOCAB, config_dict, state, tiny_hf  # noqa: E402

import bitnest_mlx  # noqa: E402
from bitnest_mlx.convert import write_package  # noqa: E402
from bitnest_mlx.formats import bitnest  # noqa: E402
from bitnest_mlx.layers.options import RunOptions  # noqa: E402


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    model = tiny_hf("qwen2")
    weights = state(model)
    for i in range(2):  # a Qwen-like k bias: a few channels far larger than k itself
        b = weights[f"model.layers.{i}.self_attn.k_proj.bias"]
        b[[3, 70, 100]] = [60.0, -80.0, 100.0]
    out = tmp_path_factory.mktemp("qwen")
    write_package(out, weights, config_dict(model))
    return out


def test_writer_declares_k_bias_offset_only_for_biased_k(package, tmp_path):
    assert (
        json.loads((package / "bitnest.json").read_text())["kv"]["per_channel_offset"] == "k_bias"
    )
    llama = tiny_hf("llama")
    write_package(tmp_path, state(llama), config_dict(llama))
    assert json.loads((tmp_path / "bitnest.json").read_text())["kv"]["per_channel_offset"] == "none"


def test_reader_refuses_k_bias_offset_without_k_bias(tmp_path):
    llama = tiny_hf("llama")
    write_package(tmp_path, state(llama), config_dict(llama))
    manifest = json.loads((tmp_path / "bitnest.json").read_text())
    manifest["kv"]["per_channel_offset"] = "k_bias"
    (tmp_path / "bitnest.json").write_text(json.dumps(manifest))
    with pytest.raises(bitnest.PackageError, match="k_proj has no bias"):
        bitnest.read(tmp_path)


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_k_bias_offset_shrinks_kv_quantization_error(package, mode):
    with pytest.warns(UserWarning, match="no tokenizer"):
        model, _ = bitnest_mlx.load(package, dtype=mx.float32)
    tokens = mx.array(np.random.default_rng(0).integers(0, VOCAB, (1, 48)))

    def logits(kv: bool, offset: bool) -> np.ndarray:
        # A8 off: its code flips would blur the comparison.
        options = RunOptions(mode, quantize_activations=False, quantize_kv=kv)
        for layer in model.layers:
            layer.self_attn.k_bias_offset = offset
        return np.array(model(tokens, options=options))

    exact = logits(kv=False, offset=True)
    np.testing.assert_allclose(logits(kv=False, offset=False), exact, atol=1e-4)
    rms = lambda a: float(np.sqrt(np.mean((a - exact) ** 2)))
    with_offset, without = rms(logits(kv=True, offset=True)), rms(logits(kv=True, offset=False))
    # Measured: target 0.0027 vs 0.017, draft 0.039 vs 0.064 (KV4's own error dominates there).
    assert with_offset < 0.75 * without


def _whole_context_offset(attn, n: int, start, dtype) -> mx.array:
    """The offset as first written: the bias broadcast over all n slots and rotated whole."""
    bias = attn.k_proj.bias.reshape(1, attn.n_kv_heads, 1, -1)
    rows = 1 if isinstance(start, int) else start.shape[0]
    shape = (rows, attn.n_kv_heads, n, attn.head_dim)
    return attn._rotate(mx.broadcast_to(bias, shape).astype(dtype), start)


def test_a_decode_step_rotates_no_context_rows_and_reads_the_same_offset(package):
    """Each decode step used to rotate the k bias over offset + L rows in every layer; the
    table grows by K_OFFSET_STEP new positions at a time, so steps at context 40 and 700
    rotate the same (none), and the rows read are bit-identical to the whole-context rotation
    (one sequence and a left-padded batch)."""
    from bitnest_mlx.models.bitnest_llama import K_OFFSET_STEP

    with pytest.warns(UserWarning, match="no tokenizer"):
        model, _ = bitnest_mlx.load(package, dtype=mx.float32)
    attn = model.layers[0].self_attn
    rotated = []
    rotate = attn._rotate
    attn._rotate = lambda x, offset: rotated.append(x.shape[2]) or rotate(x, offset)
    cache = model.make_cache()
    rows = {}
    for context in (40, 700):
        tokens = mx.array(np.random.default_rng(1).integers(0, VOCAB, (1, context)))
        cache = model.make_cache()
        model(tokens, cache=cache)  # prefill: extends the table to the context once
        rotated.clear()
        for t in range(3):
            model(tokens[:, t : t + 1], cache=cache)
        rows[context] = [n for n in rotated if n != 1]  # q and k: one row each
    assert rows[40] == rows[700] == []
    for n, start in ((700, 0), (701, 5), (9, mx.array([0, -3, -8]))):
        want = _whole_context_offset(attn, n, start, mx.float32)
        got = attn._k_offset(n, start, mx.float32)
        if not isinstance(start, int):  # padding slots are masked: only positions >= 0 count
            valid = (start[:, None] + mx.arange(n) >= 0)[:, None, :, None]
            got, want = mx.where(valid, got, 0), mx.where(valid, want, 0)
        assert mx.array_equal(got, want).item(), (n, start)
    assert attn._k_offset_table[1].shape[2] % K_OFFSET_STEP == 0
