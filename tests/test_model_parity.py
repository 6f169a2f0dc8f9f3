"""Model-level parity of the MLX runtime against code nobody here wrote, and against the spec.

(a) A8 and KV quantization off: runtime logits == transformers' Llama/Qwen2 forward with the
    package's effective (dequantized) weights, draft (W4) and target (W8).
(b) A8 and KV on: runtime logits == tests/numpy_reference.py, a numpy forward written from the
    spec text.
    The same at weight groups of 64 and 32 columns (one Qwen2 and one Llama case).
(d) One prefill of T tokens == T single-token steps through the nested KV cache.

Tiny random models (head_dim 128, GQA 2:1, 2 layers) with random RMSNorm gammas (so the
writer's norm folding is exercised), llama3 RoPE scaling (Llama), q/k/v biases and an untied
lm_head (Qwen2), and R4 with K = 12 (intermediate 384) and K = 1 (intermediate 512).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from factory import (
    CASES,
    LAYERS,
    VOCAB,
    Case,
    effective_hf_model,
    hf_config,
    random_source_weights,
    writer_config,
)
from numpy_reference import Reference, Trace
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

import bitnest_mlx
from bitnest_mlx.convert import write_package
from bitnest_mlx.formats import bitnest
from bitnest_mlx.layers import dual_plane, nested_kv
from bitnest_mlx.layers.options import RunOptions
from bitnest_mlx.runtime.demo import write_tokenizer

TOL = 1e-4
TOKENS = [3, 141, 59, 265, 35, 89, 7, 93]  # 8 positions: enough for RoPE and causality to matter


@pytest.fixture(scope="module", params=list(CASES))
def package(request, tmp_path_factory) -> tuple[Case, Path]:
    case = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    write_package(path, random_source_weights(case, seed=1234), writer_config(case))
    return case, path


def test_writer_ships_had_k_only_for_k_above_1(package):
    """The two cases really cover both R4 paths: K = 12 with a shipped matrix, K = 1 without."""
    case, path = package
    pkg = bitnest.read(path)
    shipped = sorted(k for k in pkg.tensors if k.startswith("aux.had_K."))
    assert shipped == ([f"aux.had_K.{case.r4_k}"] if case.r4_k > 1 else [])
    r4 = pkg.manifest["online_hadamard"]["layers"]
    assert [r4[f"model.layers.{i}.mlp.down_proj"]["K"] for i in range(LAYERS)] == [case.r4_k] * 2


def load_model(path: Path, mode: str) -> nn.Module:
    """bitnest_mlx.load in fp32 of a package without tokenizer files: these tests need logits
    only (loading a tokenizer is covered once, by the last test of this file)."""
    with pytest.warns(UserWarning, match="no tokenizer files"):
        model, tokenizer = bitnest_mlx.load(path, mode=mode, dtype=mx.float32)
    assert tokenizer is None
    return model


@contextmanager
def recording(trace: Trace | None) -> Iterator[None]:
    """Record the runtime's quantizer inputs (A8 sites, KV writes) in call order, reshaped to
    the reference's layout; outputs are not recorded (numpy_reference: Ties)."""
    if trace is None:
        yield
        return
    a8, nest_quantize = dual_plane.a8, nested_kv.nest_quantize
    last: list[mx.array] = []

    def a8_spy(x: mx.array, group: int = -1) -> mx.array:
        if not last or last[0] is not x:  # q/k/v (and gate/up) quantize one input: one site
            trace.a8.append(np.array(x[0]))  # [1, T, D] -> [T, D]
        last[:] = [x]
        return a8(x, group)

    def kv_spy(x: mx.array, group: int):
        # K and V side by side along the head dim (NestedKVCache._encode_both): two sites.
        for site in mx.split(x, 2, axis=-1):
            trace.kv.append(np.array(site[0]).transpose(1, 0, 2))  # [1, H, T, hd] -> [T, H, hd]
        return nest_quantize(x, group)

    with (
        mock.patch.object(dual_plane, "a8", a8_spy),
        mock.patch.object(nested_kv, "nest_quantize", kv_spy),
    ):
        yield


def runtime_logits(
    path: Path,
    tokens: list[int],
    mode: str,
    quantize: bool,
    steps: list[int] | None = None,
    trace: Trace | None = None,
) -> np.ndarray:
    """Logits [T, V] from bitnest_mlx.load in fp32; `steps` splits the tokens into chunks fed
    one after another through the same cache (None: one prefill); `trace` records quantizer
    inputs."""
    model = load_model(path, mode)
    model.options = RunOptions(mode, quantize_activations=quantize, quantize_kv=quantize)
    cache = model.make_cache()
    chunks, start = [], 0
    with recording(trace):
        for n in steps or [len(tokens)]:
            chunks.append(model(mx.array([tokens[start : start + n]]), cache)[0])
            start += n
        out = mx.concatenate(chunks, axis=0)
        mx.eval(out)
    return np.array(out).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# (a) transformers with the effective weights, quantizers off


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_unquantized_forward_matches_transformers_with_dequantized_weights(package, mode):
    case, path = package
    ours = runtime_logits(path, TOKENS, mode, quantize=False)
    ref = hf_logits(effective_hf_model(case, path, draft=mode == "draft"), TOKENS)
    assert ours.shape == (len(TOKENS), VOCAB)
    assert np.abs(ours - ref).max() <= TOL
    # The comparison can fail: W4 vs W8 logits differ by far more than the tolerance.
    other = hf_logits(effective_hf_model(case, path, draft=mode != "draft"), TOKENS)
    assert np.abs(other - ref).max() > 100 * TOL


def test_package_tracks_the_float_source_model(package):
    """The effective-weight model is not self-consistent nonsense: the runtime's W8 logits track
    the original float transformers model (norm folding, R4 fusion, untying all undone), far
    closer than W4 does."""
    case, path = package
    source = (LlamaForCausalLM if case.arch == "llama" else Qwen2ForCausalLM)(
        hf_config(case, tied=case.arch == "llama")
    )
    weights = random_source_weights(case, seed=1234)
    if case.arch == "llama":
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    source.load_state_dict({k: torch.tensor(v) for k, v in weights.items()}, strict=True)
    ref = hf_logits(source.eval(), TOKENS)

    def rel_rms(x: np.ndarray) -> float:
        return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))

    w8 = rel_rms(runtime_logits(path, TOKENS, "target", quantize=False))
    w4 = rel_rms(runtime_logits(path, TOKENS, "draft", quantize=False))
    assert w8 < 0.1  # measured ~0.03: W8 rounding + the bf16 embedding
    assert w8 < 0.2 * w4


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
    """The same weights written without rope_scaling give clearly different logits, so the
    transformers parity of the Llama case really covers llama3 scaling."""
    case = CASES["llama-K12"]
    weights = random_source_weights(case, seed=1234)
    cfgs = {"scaled": writer_config(case), "plain": {**writer_config(case), "rope_scaling": None}}
    logits = {}
    for name, cfg in cfgs.items():
        write_package(tmp_path / name, weights, cfg)
        logits[name] = runtime_logits(tmp_path / name, TOKENS, "target", quantize=False)
    assert np.abs(logits["scaled"] - logits["plain"]).max() > 100 * TOL


# ---------------------------------------------------------------------------------------------
# (b) numpy reference of the spec, quantizers on


def assert_matches_spec_reference(path: Path, mode: str) -> None:
    trace = Trace()
    ours = runtime_logits(path, TOKENS, mode, quantize=True, trace=trace)
    ref = Reference.load(path)
    expected = ref.forward(TOKENS, draft=mode == "draft", trace=trace)
    assert np.abs(ours - expected).max() <= TOL
    # Every site was visited (4 A8 per layer + lm_head, K and V per layer) and checked.
    assert (len(trace.a8), len(trace.kv)) == (4 * LAYERS + 1, 2 * LAYERS)
    assert trace.max_input_err < 1e-5
    # Near-tie decisions taken from the runtime's side stay rare (the structural ties are a
    # handful per sequence); many would mean the quantizer rule itself disagrees.
    assert trace.adopted <= 1e-3 * trace.total
    # Sensitivity: the same reference with A8/KV off differs by far more than the tolerance.
    plain = ref.forward(TOKENS, draft=mode == "draft", quantize_act=False, quantize_kv=False)
    assert np.abs(plain - expected).max() > 100 * TOL


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_quantized_forward_matches_numpy_spec_reference(package, mode):
    assert_matches_spec_reference(package[1], mode)


@pytest.fixture(
    scope="module", params=[("qwen2-K1", 64), ("llama-K12", 32)], ids=lambda p: f"{p[0]}-g{p[1]}"
)
def grouped_package(request, tmp_path_factory) -> Path:
    """The parity cases written with one weight scale per 64 or 32 columns."""
    name, group = request.param
    path = tmp_path_factory.mktemp(f"{name}-g{group}")
    case = CASES[name]
    write_package(
        path, random_source_weights(case, seed=1234), writer_config(case), group_size=group
    )
    assert bitnest.read(path).spec.group_size == group
    return path


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_quantized_forward_at_smaller_weight_groups_matches_numpy_spec_reference(
    grouped_package, mode
):
    assert_matches_spec_reference(grouped_package, mode)


def test_r3_enabled_in_manifest_matches_numpy_spec_reference(tmp_path):
    """Optional R3 (docs/bitnest-package.md §5.4): with `kv.r3: true` q and k get a per-head
    Hadamard after RoPE, which changes what the nested KV cache quantizes."""
    case = CASES["llama-K12"]
    write_package(tmp_path, random_source_weights(case, seed=1234), writer_config(case))
    manifest_file = tmp_path / "bitnest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["kv"]["r3"] = True
    manifest_file.write_text(json.dumps(manifest))
    bitnest.seal(tmp_path)  # a deliberate variant: record its checksums again
    ref = Reference.load(tmp_path)
    assert ref.r3
    trace = Trace()
    ours = runtime_logits(tmp_path, TOKENS, "draft", quantize=True, trace=trace)
    expected = ref.forward(TOKENS, draft=True, trace=trace)
    assert np.abs(ours - expected).max() <= TOL
    assert trace.adopted <= 1e-3 * trace.total
    ref.r3 = False
    assert np.abs(ref.forward(TOKENS, draft=True) - expected).max() > 100 * TOL


def test_numpy_reference_agrees_with_transformers_when_quantizers_are_off(package):
    """Cross-check of the reference itself against transformers (RoPE, GQA, R4, biases)."""
    case, path = package
    ref = Reference.load(path).forward(TOKENS, draft=False, quantize_act=False, quantize_kv=False)
    hf = hf_logits(effective_hf_model(case, path, draft=False), TOKENS)
    assert np.abs(ref - hf).max() <= TOL


# ---------------------------------------------------------------------------------------------
# (d) prefill vs token-by-token through the cache


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_prefill_equals_single_token_steps(package, mode):
    _, path = package
    prefill = runtime_logits(path, TOKENS, mode, quantize=True)
    steps = runtime_logits(path, TOKENS, mode, quantize=True, steps=[1] * len(TOKENS))
    assert np.abs(prefill - steps).max() <= TOL


@pytest.mark.parametrize("mode", ["draft", "target"])
def test_chunk_after_prefill_equals_one_prefill(package, mode):
    """A multi-token call at offset > 0 (a verify pass) needs the causal mask shifted by the
    cache offset."""
    _, path = package
    prefill = runtime_logits(path, TOKENS, mode, quantize=True)
    chunked = runtime_logits(path, TOKENS, mode, quantize=True, steps=[3, 5])
    assert np.abs(prefill - chunked).max() <= TOL


# ---------------------------------------------------------------------------------------------
# Writer input from transformers 5 configs


def test_writer_keeps_rope_from_transformers5_config_dict(tmp_path):
    """transformers 5's `to_dict()` nests rope_theta and the scaling in `rope_parameters`; a
    writer reading only the top-level keys would silently write theta 10000, no scaling."""
    case = CASES["llama-K12"]
    cfg = hf_config(case, tied=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        write_package(tmp_path, random_source_weights(case, seed=1), cfg.to_dict())
    written = bitnest.read(tmp_path).config
    assert written["rope_theta"] == 500000.0
    assert (written.get("rope_scaling") or {}).get("rope_type") == "llama3"


def test_load_with_tokenizer_accepts_llama3_scaled_package(tmp_path):
    """AutoTokenizer must not parse the package's config.json: as a bare transformers config
    (model_type "bitnest" is unknown to it) its llama3 rope_scaling fails to standardize."""
    case = CASES["llama-K12"]
    write_package(tmp_path, random_source_weights(case, seed=1), writer_config(case))
    write_tokenizer(tmp_path)
    model, tokenizer = bitnest_mlx.load(tmp_path, dtype=mx.float32)
    assert tokenizer.encode("ab")
