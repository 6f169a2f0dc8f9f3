"""MXTQ codec and layers: bit-compatibility with jang 2.5.50 and the pure-MLX runtime math.

jang (test extra) is the oracle for codes, norms, codebooks, signs and dense decode; its tests skip
without it. The rest checks against values published in docs/mxtq.md (§2, §3.2, §4.2, §6) and
against our own dense decode.
"""

import hashlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from bitnest_mlx.formats import mxtq
from bitnest_mlx.layers.mxtq_linear import MXTQLinear, MXTQSwitchLinear

LINEAR_SHAPES = [(64, 256), (48, 384)]  # 384 = 256 + 128: two Hadamard blocks
EXPERT_SHAPES = [(4, 32, 256), (3, 16, 384)]
BITS = [2, 4]


def _weights(shape, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)


def _rel_err(y, ref):
    return float(np.abs(np.asarray(y, np.float64) - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def jang_linear():
    pytest.importorskip("jang_tools")
    from jang_tools.turboquant import linear

    return linear


# ---------------------------------------------------------------- codec, no oracle needed

# Negative half of each codebook as float32 bit patterns (research file §2.3); the rest mirrors.
PUBLISHED_CODEBOOKS = {
    (4096, 2): [0xBCC3B402, 0xBBEBA9FC],
    (2048, 2): [0xBD0A0982, 0xBC262852],
    (4096, 4): [
        *(0xBD3AC2C1, 0xBD113BD3, 0xBCE8E4A9, 0xBCB8F27C),
        *(0xBC8D577B, 0xBC47F5C5, 0xBBF0C17E, 0xBB229171),
    ],
    (2048, 4): [
        *(0xBD80EFED, 0xBD46BEF6, 0xBD1E140C, 0xBCF9FEC1),
        *(0xBCBF0490, 0xBC87DDBD, 0xBC24573A, 0xBB5D312A),
    ],
}


@pytest.mark.parametrize("dim_bits", list(PUBLISHED_CODEBOOKS))
def test_dsv4_codebooks_equal_published_float32_bits(dim_bits):
    neg = np.array(PUBLISHED_CODEBOOKS[dim_bits], dtype=np.uint32)
    expected = np.concatenate([neg, neg[::-1] & 0x7FFFFFFF])
    np.testing.assert_array_equal(mxtq.codebook(*dim_bits).view(np.uint32), expected)


def test_seed42_signs_fingerprint_and_prefix_property():
    s4096, s2048 = mxtq.signs(4096, 42), mxtq.signs(2048, 42)
    assert "".join("+" if v > 0 else "-" for v in s4096[:32]) == "-++--+-+--+++++++-+-+--+++-++---"
    assert (s4096.sum(), s2048.sum()) == (-24.0, 6.0)
    digest = hashlib.sha256(s4096.tobytes()).hexdigest()
    assert digest.startswith("166c7c4e") and digest.endswith("cbcd4d45")
    np.testing.assert_array_equal(s2048, s4096[:2048])  # one stream per seed, no per-size offset


def test_hadamard_blocks_are_binary_decomposition_largest_first():
    assert mxtq.hadamard_blocks(384) == [256, 128]
    assert mxtq.hadamard_blocks(6144) == [4096, 2048]
    assert mxtq.hadamard_blocks(4096) == [4096]


def test_codes_pack_lsb_first():
    assert mxtq.pack_codes(np.tile(np.arange(4), 4), 2).tolist() == [0xE4E4E4E4]
    assert mxtq.pack_codes(np.arange(8), 4).tolist() == [0x76543210]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_pack_unpack_roundtrip_numpy_and_mlx(bits):
    vpw = 32 // bits
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 5, 4 * vpw))
    packed = mxtq.pack_codes(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 5, 4)
    np.testing.assert_array_equal(mxtq.unpack_codes(packed, bits), codes)
    np.testing.assert_array_equal(np.array(mxtq.unpack_codes(mx.array(packed), bits)), codes)


def test_rows_that_do_not_fill_whole_words_are_refused():
    with pytest.raises(ValueError, match="multiple of 16 "):
        mxtq.encode(_weights((4, 200)), bits=2)
    with pytest.raises(ValueError, match="multiple of 10 "):
        MXTQLinear(384, 8, bits=3)


@pytest.mark.parametrize("bits,lo,hi", [(2, 0.31, 0.37), (4, 0.085, 0.11)])
def test_roundtrip_error_is_the_lloyd_max_distortion(bits, lo, hi):
    # Gaussian Lloyd-Max distortion: √0.1175 ≈ 0.343 at 2 bits, √0.0095 ≈ 0.097 at 4 bits.
    w = _weights((64, 384))
    err = np.linalg.norm(mxtq.decode(mxtq.encode(w, bits)) - w) / np.linalg.norm(w)
    assert lo < err < hi


# ---------------------------------------------------------------- bit-compatibility with jang


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [256, 384, 2048, 4096])
def test_codebook_and_signs_equal_jang(jang_linear, dim, bits):
    from jang_tools.turboquant.codebook import compute_codebook
    from jang_tools.turboquant.rotation import generate_random_signs

    theirs = compute_codebook(dim, bits)
    assert mxtq._lloyd_max(dim, bits) == tuple(theirs)  # float64, before the float32 cast
    np.testing.assert_array_equal(mxtq.codebook(dim, bits), np.array(theirs, np.float32))
    np.testing.assert_array_equal(mxtq.signs(dim, 42), np.array(generate_random_signs(dim, 42)))


def _assert_same_encoding(ours, theirs):
    assert ours.packed.dtype == theirs["packed"].dtype == np.uint32
    np.testing.assert_array_equal(ours.packed, theirs["packed"])
    assert ours.norms.dtype == theirs["norms"].dtype == np.float16
    np.testing.assert_array_equal(ours.norms.view(np.uint16), theirs["norms"].view(np.uint16))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_encoding_equals_jang(jang_linear, shape, bits):
    w = _weights(shape, seed=bits)
    _assert_same_encoding(mxtq.encode(w, bits), jang_linear.tq_quantize_weight(w, bits, seed=42))


def test_wide_row_norms_equal_jang_to_the_float16_bit(jang_linear):
    # Summing v² in another float32 order (NumPy's pairwise sum, or float64) moves ~1% of
    # 4096-wide norms by one float16 ulp; these 256 rows include such cases.
    w = _weights((256, 4096), seed=2)
    _assert_same_encoding(mxtq.encode(w, 2), jang_linear.tq_quantize_weight(w, 2, seed=42))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", EXPERT_SHAPES)
def test_expert_stack_encoding_equals_jang(jang_linear, shape, bits):
    w = _weights(shape, seed=bits)
    _assert_same_encoding(mxtq.encode(w, bits), jang_linear.tq_quantize_experts(w, bits, seed=42))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_decode_equals_jang_dense_decode(jang_linear, shape, bits):
    q = mxtq.encode(_weights(shape, seed=bits), bits)
    layer = jang_linear.TurboQuantLinear(q.in_features, q.out_features, bits=bits, seed=42)
    layer.packed, layer.norms = mx.array(q.packed), mx.array(q.norms)
    theirs = np.array(layer(mx.eye(q.in_features))).T  # I · Ŵᵀ is exact: Ŵᵀ itself
    np.testing.assert_array_equal(mxtq.decode(q), theirs)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", EXPERT_SHAPES)
def test_expert_stack_decode_equals_jang_dense_decode(jang_linear, shape, bits):
    q = mxtq.encode(_weights(shape, seed=bits), bits)
    n_exp, out_f, in_f = shape
    layer = jang_linear.TurboQuantSwitchLinear(in_f, out_f, n_exp, bits=bits, seed=42)
    layer.packed, layer.norms = mx.array(q.packed), mx.array(q.norms)
    # Its __call__ needs mx.unique without `size`, which MLX 0.32 no longer has; the dense decode
    # it would run is _dequant_experts.
    theirs = np.array(layer._dequant_experts(range(n_exp)))
    np.testing.assert_array_equal(mxtq.decode(q), theirs)


# ---------------------------------------------------------------- runtime layers


def _spy(monkeypatch, cls, name):
    """Count calls of cls.name, so a test can prove which code path produced its result."""
    calls, original = [], getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a: calls.append(1) or original(self, *a))
    return calls


@pytest.mark.parametrize("lead", [(2, 3), (1,)], ids=["rows_expand", "one_row_byte_table"])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", LINEAR_SHAPES)
def test_linear_matvec_matches_dense_decode(shape, bits, lead, monkeypatch):
    table = _spy(monkeypatch, MXTQLinear, "_byte_table_matvec")
    q = mxtq.encode(_weights(shape, seed=bits), bits)
    x = np.random.default_rng(7).standard_normal((*lead, shape[1])).astype(np.float32)
    y = MXTQLinear.from_weight(q)(mx.array(x))
    assert y.shape == (*lead, shape[0]) and y.dtype == mx.float32
    assert _rel_err(y, x.astype(np.float64) @ mxtq.decode(q).T.astype(np.float64)) < 1e-5
    assert bool(table) == (lead == (1,))


def test_linear_returns_the_input_dtype():
    q = mxtq.encode(_weights((32, 256)), 4)
    x = mx.array(np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32))
    y = MXTQLinear.from_weight(q)(x.astype(mx.bfloat16))
    assert y.dtype == mx.bfloat16
    assert _rel_err(y.astype(mx.float32), np.array(x, np.float64) @ mxtq.decode(q).T) < 2e-2


N_EXP, OUT, IN, K = 6, 32, 320, 2  # 320 = 256 + 64, and whole words at 2, 3 and 4 bits
EXPERT_BYTES = 4 * OUT * IN
PATHS = {"per_slot": 1 << 30, "grouped_by_1": 1, "grouped_by_4": 4 * EXPERT_BYTES}


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda b: f"{b}bit")
def experts(request):
    q = mxtq.encode(_weights((N_EXP, OUT, IN), seed=3), bits=request.param)
    return q, mxtq.decode(q).astype(np.float64)


def _switch(q, path, monkeypatch):
    """The layer, and call counters proving which path ran (grouped, byte table)."""
    grouped = _spy(monkeypatch, MXTQSwitchLinear, "_grouped")
    table = _spy(monkeypatch, MXTQSwitchLinear, "_byte_table_matvec")
    return MXTQSwitchLinear.from_weight(q, max_dequant_bytes=PATHS[path]), grouped, table


def _routes(shape, seed=0):
    # Expert 5 is never routed so the poisoning test has something to poison.
    return mx.array(np.random.default_rng(seed).integers(0, N_EXP - 1, shape))


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("path", list(PATHS))
def test_switch_shared_input_equals_per_expert_dense(experts, path, m, monkeypatch):
    q, dense = experts
    layer, grouped, table = _switch(q, path, monkeypatch)
    x = np.random.default_rng(1).standard_normal((2, 5, 1, m, IN)).astype(np.float32)
    idx = _routes((2, 5, K))
    y = layer(mx.array(x), idx)  # gate/up layout of mlx-lm's SwitchGLU (there m = 1)
    assert y.shape == (2, 5, K, m, OUT)
    ids = np.array(idx)
    ref = np.einsum("blmj,blkoj->blkmo", x[:, :, 0].astype(np.float64), dense[ids])
    assert _rel_err(y, ref) < 1e-5
    assert bool(grouped) == path.startswith("grouped")
    assert bool(table) == (path == "per_slot" and m == 1 and q.bits != 3)


@pytest.mark.parametrize("path", list(PATHS))
def test_switch_per_slot_input_equals_per_expert_dense(experts, path, monkeypatch):
    q, dense = experts
    layer, grouped, _ = _switch(q, path, monkeypatch)
    x = np.random.default_rng(2).standard_normal((3, 4, K, 1, IN)).astype(np.float32)
    idx = _routes((3, 4, K), seed=1)
    y = layer(mx.array(x), idx)  # down_proj layout: one input per routed slot
    ids = np.array(idx)
    ref = np.einsum("blkj,blkoj->blko", x[..., 0, :].astype(np.float64), dense[ids])
    assert _rel_err(y[..., 0, :], ref) < 1e-5
    assert bool(grouped) == path.startswith("grouped")


@pytest.mark.parametrize("path", list(PATHS))
def test_switch_sorted_flat_layout_equals_per_expert_dense(experts, path, monkeypatch):
    q, dense = experts
    layer = _switch(q, path, monkeypatch)[0]
    ids = np.sort(np.array(_routes((12,), seed=2)))
    x = np.random.default_rng(3).standard_normal((12, 1, IN)).astype(np.float32)
    y = layer(mx.array(x), mx.array(ids), sorted_indices=True)
    ref = np.einsum("sj,soj->so", x[:, 0].astype(np.float64), dense[ids])
    assert _rel_err(y[:, 0], ref) < 1e-5


@pytest.mark.parametrize("path", list(PATHS))
def test_switch_never_reads_unrouted_experts(experts, path, monkeypatch):
    q, _ = experts
    x = mx.array(np.random.default_rng(4).standard_normal((2, 3, 1, 1, IN)).astype(np.float32))
    idx = _routes((2, 3, K), seed=3)
    clean = _switch(q, path, monkeypatch)[0](x, idx)
    # NaN norms on the unrouted expert would leak into any output that touched it (0·NaN = NaN).
    unrouted = sorted(set(range(N_EXP)) - set(np.array(idx).ravel().tolist()))
    assert unrouted
    norms = q.norms.copy()
    norms[unrouted] = np.nan
    poisoned = mxtq.MXTQWeight(q.packed, norms, q.bits)
    y = _switch(poisoned, path, monkeypatch)[0](x, idx)
    np.testing.assert_array_equal(np.array(y), np.array(clean))


def test_switch_loads_prestacked_bundle_tensors_strictly(experts):
    q, _ = experts
    tensors = q.tensors("switch")
    tensors["switch.tq_bits"] = np.array([q.bits], dtype=np.uint8)  # prestacked bundles store uint8
    layer = MXTQSwitchLinear(IN, OUT, N_EXP, bits=q.bits)
    assert set(layer.parameters()) == {"tq_packed", "tq_norms", "tq_bits"}
    prefix = len("switch.")
    layer.load_weights([(k[prefix:], mx.array(v)) for k, v in tensors.items()], strict=True)
    x, idx = mx.ones((1, 1, 1, IN)), mx.array([[0, 3]])
    expected = MXTQSwitchLinear.from_weight(q)(x, idx)
    np.testing.assert_array_equal(np.array(layer(x, idx)), np.array(expected))


def test_docs_example_runs(capsys):
    doc = (Path(__file__).parents[1] / "docs" / "mxtq.md").read_text(encoding="utf-8")
    exec(doc.split("```python\n")[1].split("```")[0], {})
    assert capsys.readouterr().out.rstrip().endswith("True")


def test_switch_per_slot_path_compiles_without_host_sync(experts):
    q, _ = experts
    layer = MXTQSwitchLinear.from_weight(q)
    x, idx = mx.array(np.ones((2, 1, 1, IN), np.float32)), _routes((2, K), seed=5)
    np.testing.assert_allclose(
        np.array(mx.compile(layer)(x, idx)), np.array(layer(x, idx)), rtol=1e-6, atol=1e-7
    )
