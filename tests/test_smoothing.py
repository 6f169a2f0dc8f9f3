"""Per-channel smoothing (docs/bitnest-package.md §2.5): stored norm weights d with W/d in the
Linears that read them. The runtime applies d in both modes (parity with transformers), the
float function is kept, the search lowers the W4 error where activations have outlier
channels, the reader refuses every broken variant, and the converter writes it end to end."""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from factory import (
    CASES,
    VOCAB,
    config_dict,
    copy_package,
    edit_json,
    edit_tensors,
    effective_hf_model,
    float_weights,
    hf_config,
    random_source_weights,
    read_json,
    state,
    tiny_hf,
    writer_config,
)

import bitnest_mlx
from bitnest_mlx.convert import fold_norms, write_package
from bitnest_mlx.convert.package import smooth_linears
from bitnest_mlx.convert.smoothing import measure, norm_inputs, smoothing_vectors
from bitnest_mlx.convert.sources import Source
from bitnest_mlx.formats import bitnest
from bitnest_mlx.formats.bitnest import PackageError
from bitnest_mlx.formats.hadamard import hadamard_k, split_k
from bitnest_mlx.layers.options import RunOptions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
TOKENS = [3, 141, 59, 265, 35, 89, 7, 93]
CASE = CASES["llama-K12"]  # R4 with a shipped hadK, llama3 RoPE, GQA, random gammas


def random_vectors(n_layers: int, d: int, seed: int) -> dict[str, np.ndarray]:
    """Positive smoothing vectors spread over a factor ~e either way, for every norm."""
    rng = np.random.default_rng(seed)
    return {
        n: np.exp(rng.normal(0, 0.5, d)).astype(np.float32) for n in bitnest.norm_names(n_layers)
    }


@pytest.fixture(scope="module")
def smoothed(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smoothed") / "pkg"
    weights = random_source_weights(CASE, seed=1234)
    write_package(path, weights, writer_config(CASE), smoothing=random_vectors(2, 256, seed=5))
    return path


def load_model(path: Path, mode: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer files: these tests need logits only
        model, _ = bitnest_mlx.load(path, mode=mode, dtype=mx.float32)
    return model


def runtime_logits(path: Path, mode: str) -> np.ndarray:
    model = load_model(path, mode)
    model.options = RunOptions(mode, quantize_activations=False, quantize_kv=False)
    return np.array(model(mx.array([TOKENS]))[0]).astype(np.float64)


def effective_hf_logits(path: Path, draft: bool, with_norms: bool = True) -> np.ndarray:
    """transformers' Llama holding what the package computes with A8/KV off, norm weights =
    the stored d (or ones without `with_norms`, to show the comparison sees them)."""
    model = effective_hf_model(CASE, path, draft, stored_norms=with_norms)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0].double().numpy()


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_runtime_applies_stored_norm_weights_like_transformers(smoothed, mode):
    ours = runtime_logits(smoothed, mode)
    ref = effective_hf_logits(smoothed, draft=mode == "draft")
    assert np.abs(ours - ref).max() <= TOL
    # The comparison sees the norm weights: dropping them moves the logits far beyond TOL.
    dropped = effective_hf_logits(smoothed, draft=mode == "draft", with_norms=False)
    assert np.abs(dropped - ref).max() > 100 * TOL


def source_logits(weights: dict[str, np.ndarray], tied: bool = False) -> np.ndarray:
    """transformers' Llama of CASE with `weights`; `tied`: lm_head is the embedding (the source)."""
    model = transformers.LlamaForCausalLM(hf_config(CASE, tied=tied))
    if tied:
        weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
    model.load_state_dict({k: torch.tensor(v) for k, v in weights.items()}, strict=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([TOKENS])).logits[0].double().numpy()


def test_smoothing_keeps_the_float_function():
    """Norms folded, then d stored as the norm weights and W/d in their Linears (what the writer
    quantizes): transformers gives the source's logits; without d it does not."""
    weights = random_source_weights(CASE, seed=1234)
    ref = source_logits(weights, tied=True)
    vectors = random_vectors(2, 256, seed=5)
    smoothed = smooth_linears(fold_norms(weights, 2), vectors)
    assert np.abs(source_logits({**smoothed, **vectors}) - ref).max() <= TOL
    assert np.abs(source_logits(smoothed) - ref).max() > 100 * TOL


def test_smoothed_package_tracks_the_float_source(smoothed):
    """End to end through the planes: W8 stays close to the source, far closer than W4."""
    weights = random_source_weights(CASE, seed=1234)
    ref = source_logits(weights, tied=True)

    def rel_rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))

    w8 = rel_rms(runtime_logits(smoothed, "target"))
    # ~0.06 (~0.03 unsmoothed: these random d spread each group's columns, coarsening its grid)
    assert w8 < 0.1
    assert w8 < 0.2 * rel_rms(runtime_logits(smoothed, "draft"))


# ---------------------------------------------------------------------------------------------
# The search


def outlier_model(outlier: float):
    """A 1-layer Llama whose embedding has three channels `outlier` times larger: every norm's
    output then has outlier channels (no rotation here spreads them)."""
    weights, config = float_weights("llama", n_layers=1, intermediate=512)
    weights["model.embed_tokens.weight"][:, [3, 70, 200]] *= outlier
    tokens = np.random.default_rng(0).integers(0, 257, (4, 64))
    return weights, config, tokens


def draft_error(x: np.ndarray, w: np.ndarray, planes_of, d: np.ndarray) -> float:
    """||A8(x·d)·W4ᵀ - x·wᵀ||² / ||x·wᵀ||² with W4 read back from a written package."""
    hi, lo, scales = (np.array(planes_of[k]) for k in ("hi", "lo", "scales"))
    w4 = bitnest.dequantize_planes(hi, lo, scales, draft=True)
    y = x @ w.T
    return float(np.sum((bitnest.a8(x * d) @ w4.T - y) ** 2) / np.sum(y * y))


def test_smoothing_lowers_the_draft_error_where_activations_have_outlier_channels(tmp_path):
    weights, config, tokens = outlier_model(30.0)
    result = smoothing_vectors(weights, config, tokens)
    name = "model.layers.0.input_layernorm.weight"
    assert result.alphas[name] > 0 and name in result.vectors
    plain = write_package(tmp_path / "plain", weights, config)
    smooth = write_package(tmp_path / "smooth", weights, config, smoothing=result.vectors)
    # Layer 0's q/k/v read the first norm: x computed here, independently of the search.
    x = weights["model.embed_tokens.weight"][tokens].reshape(-1, 256).astype(np.float64)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + config["rms_norm_eps"])
    gamma = weights[name]
    d = np.array(bitnest.read(smooth).tensors[name], dtype=np.float64)
    for lin in ("q_proj", "k_proj", "v_proj"):
        stem = f"model.layers.0.self_attn.{lin}"
        w = weights[f"{stem}.weight"] * gamma  # the folded weight: the function to reproduce
        parts = {p: bitnest.read(pkg).tensors for p, pkg in (("plain", plain), ("smooth", smooth))}

        def planes(kind: str, stem=stem, parts=parts) -> dict:
            return {k: parts[kind][f"{stem}.{k}"] for k in ("hi", "lo", "scales")}

        before = draft_error(x, w, planes("plain"), np.ones(256))
        after = draft_error(x, w, planes("smooth"), d)
        assert after < 0.7 * before, (lin, before, after)  # measured ~0.45x


def test_search_keeps_norms_unsmoothed_when_no_alpha_pays():
    weights, config, tokens = outlier_model(30.0)
    result = smoothing_vectors(weights, config, tokens, alphas=(0.0, 0.5), min_gain=0.99)
    assert result.vectors == {} and set(result.alphas.values()) == {0.0}


def test_norm_inputs_follow_the_transformers_forward():
    """The search's float forward reproduces transformers' hidden states at every norm."""
    model = tiny_hf("llama")
    weights = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    config = {**model.config.to_dict(), "head_dim": 128}
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 12))
    with torch.no_grad():
        out = model(torch.tensor(tokens), output_hidden_states=True)
    hidden = [h.numpy().reshape(-1, 256) for h in out.hidden_states]
    source = Source.from_arrays(weights, config)
    ours = {norm: x for norm, x, _ in norm_inputs(source, config, tokens)}

    def rms(h: np.ndarray) -> np.ndarray:
        return h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + config["rms_norm_eps"])

    np.testing.assert_allclose(
        ours["model.layers.1.input_layernorm.weight"], rms(hidden[1]), atol=1e-4
    )
    # transformers' last hidden state is after the final norm (its gamma included).
    final = ours["model.norm.weight"] * weights["model.norm.weight"]
    np.testing.assert_allclose(final, hidden[-1], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# The reader


@pytest.fixture
def pkg(smoothed, tmp_path) -> Path:
    return copy_package(smoothed, tmp_path / "pkg")


def refused(path: Path, *fragments: str) -> None:
    with pytest.raises(PackageError) as e:
        bitnest.read(path)
    for fragment in fragments:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_smoothed_package_reads_with_its_vectors(smoothed):
    package = bitnest.read(smoothed)
    assert package.spec.smoothing and package.manifest["norms"]["smoothing"] is True
    want = random_vectors(2, 256, seed=5)
    for name in bitnest.norm_names(2):
        np.testing.assert_array_equal(np.array(package.tensors[name]), want[name])


NORM = "model.layers.1.post_attention_layernorm.weight"


@pytest.mark.parametrize(
    "value, fragments",
    [
        (None, ["missing tensor", NORM, "float32 [256]", "norms.smoothing"]),
        (mx.ones((255,)), [NORM, "shape [255] but expected float32 [256]"]),
        (mx.ones((256,), dtype=mx.float16), [NORM, "dtype float16"]),
        (mx.ones((256,)).at[5].add(-1.0), [NORM, "value 0.0 at channel 5", "finite positive"]),
        (mx.ones((256,)).at[7].add(-3.0), [NORM, "value -2.0 at channel 7"]),
        (mx.full((256,), float("nan")), [NORM, "value nan at channel 0"]),
        (mx.full((256,), float("inf")), [NORM, "value inf at channel 0"]),
    ],
    ids=["missing", "shape", "dtype", "zero", "negative", "nan", "inf"],
)
def test_reader_refuses_a_broken_smoothing_vector(pkg, value, fragments):
    def edit(t: dict) -> None:
        if value is None:
            del t[NORM]
        else:
            t[NORM] = value

    edit_tensors(pkg, edit)
    refused(pkg, "model.safetensors", *fragments)


def test_norm_weights_without_the_manifest_key_are_refused(pkg):
    edit_json(pkg, "bitnest.json", lambda m: m["norms"].pop("smoothing"))
    refused(pkg, "layernorm.weight", "unfused", "norms.smoothing: true")


@pytest.mark.parametrize(
    "edit, fragments",
    [
        (lambda m: m["norms"].update(center=True), ["norms.center: unknown key", "smoothing"]),
        (lambda m: m["norms"].update(smoothing="yes"), ["norms.smoothing = 'yes'", "true or"]),
        (lambda m: m.update(norms="fused"), ["norms is 'fused', expected an object"]),
    ],
    ids=["unknown-key", "not-a-bool", "not-an-object"],
)
def test_reader_refuses_a_norms_block_it_cannot_interpret(pkg, edit, fragments):
    edit_json(pkg, "bitnest.json", edit)
    refused(pkg, "bitnest.json", *fragments)


def test_explicit_smoothing_false_with_unit_norms_reads_as_unsmoothed(tmp_path):
    weights, config = float_weights("llama", n_layers=1)
    path = write_package(tmp_path / "pkg", weights, config)
    edit_json(path, "bitnest.json", lambda m: m["norms"].update(smoothing=False))
    assert bitnest.read(path).spec.smoothing is False


def test_writer_refuses_a_vector_that_is_not_positive(tmp_path):
    weights, config = float_weights("llama", n_layers=1)
    bad = {"model.norm.weight": -np.ones(256, np.float32)}
    with pytest.raises(PackageError, match="model.norm.weight .*finite positive"):
        write_package(tmp_path / "pkg", weights, config, smoothing=bad)
    assert not (tmp_path / "pkg").exists()  # refused before any file is written


# ---------------------------------------------------------------------------------------------
# Loading paths and the converter


def test_bitnest_load_and_mlx_lm_load_apply_the_same_norm_weights(tmp_path):
    from mlx_lm import load as mlx_lm_load

    from bitnest_mlx.runtime.demo import write_tokenizer

    path = tmp_path / "pkg"
    path.mkdir()
    weights, config = float_weights("qwen2", vocab=write_tokenizer(path), intermediate=768)
    write_package(path, weights, config, smoothing=random_vectors(2, 256, seed=7))
    ours, _ = bitnest_mlx.load(path)
    theirs, _ = mlx_lm_load(str(path))
    tokens = mx.array([[3, 141, 59, 35, 89]])  # within the byte tokenizer's 257
    for mode in ("draft", "target"):
        want = ours(tokens, mode=mode)
        assert mx.array_equal(theirs(tokens, mode=mode), want)
    stored = bitnest.read(path).tensors
    assert mx.array_equal(theirs.layers[1].post_attention_layernorm, stored[NORM])
    assert mx.array_equal(theirs.norm, stored["model.norm.weight"])
    # Weightless norms (what a reader without the extension would run) change the logits.
    for layer in theirs.layers:
        layer.input_layernorm = layer.post_attention_layernorm = None
    assert not mx.allclose(theirs(tokens), ours(tokens), atol=1e-3)


@pytest.fixture(scope="module")
def outlier_hf(tmp_path_factory):
    """A tiny HF Llama checkpoint whose embedding has outlier channels: (model, directory)."""
    from bitnest_mlx.runtime.demo import write_tokenizer

    model = tiny_hf("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, [3, 70, 200]] *= 30
    path = tmp_path_factory.mktemp("outlier") / "hf"
    model.save_pretrained(path)
    write_tokenizer(path)
    return model, path


CALIB = ["--calib-tokens", "1024", "--calib-seq-len", "64"]


@pytest.mark.parametrize("method", ["rtn", "joint"])  # joint calibrates on d·x into W/d
def test_convert_smooth_writes_a_smoothed_package_that_tracks_the_source(
    outlier_hf, tmp_path, method
):
    from bitnest_mlx.cli.convert import main

    model, hf = outlier_hf
    out = tmp_path / "pkg"
    # --rotate none keeps the outlier channels, so smoothing must pay somewhere.
    argv = ["--hf-path", str(hf), "--out", str(out), "--method", method, "--rotate", "none"]
    assert main([*argv, "--smooth", *CALIB]) == 0
    manifest = read_json(out, "bitnest.json")
    assert manifest["norms"]["smoothing"] is True
    alphas = {n: e["alpha"] for n, e in manifest["conversion"]["smoothing"]["per_norm"].items()}
    assert set(alphas) == set(bitnest.norm_names(2)) and max(alphas.values()) > 0
    assert manifest["conversion"]["smoothed_norms"] == sum(a > 0 for a in alphas.values())

    with torch.no_grad():
        ref = model(torch.tensor([TOKENS])).logits[0].double().numpy()
    got = runtime_logits(out, "target")
    assert np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)) < 0.1

    if method != "rtn":
        return
    # measure() (the report for a real checkpoint) makes the converter's choice.
    measured = measure(hf, rotate_kind="none", calib_tokens=1024, calib_seq_len=64)
    assert measured.alphas == alphas


def test_calibrated_methods_see_the_smoothed_norm_output_d_times_x():
    from bitnest_mlx.convert.calibrate import Calibration
    from bitnest_mlx.convert.package import stored_embedding, stored_layer
    from bitnest_mlx.formats.bitnest.writer import PackageWriter

    model = tiny_hf("llama")
    source = Source.from_arrays(state(model), config_dict(model))
    config = source.config
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 32))
    d = np.random.default_rng(1).uniform(0.5, 2.0, config["hidden_size"]).astype(np.float32)
    norms = {"model.layers.0.input_layernorm.weight": d}
    had_k = hadamard_k(split_k(config["intermediate_size"]))
    embed = mx.array(stored_embedding(source, None))
    q = {}
    for label, vectors in (("plain", None), ("smoothed", norms)):
        spec = PackageWriter.spec_for(config, had_k=had_k, norms=vectors)
        calib = Calibration(spec, embed, tokens, had_k, vectors)
        q[label] = calib.hessians(0, stored_layer(source, 0, None, vectors, had_k))[
            "self_attn.q_proj"
        ]
    # H = 2 E[x xᵀ] of the Linear's input: d·x has the diagonal d² times x's (A8 noise aside).
    np.testing.assert_allclose(np.diag(q["smoothed"]), d**2 * np.diag(q["plain"]), rtol=0.05)
