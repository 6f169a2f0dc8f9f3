"""Converter: exact rotations, GPTQ beats RTN, HF and GGUF inputs become loadable packages."""

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from factory import VOCAB, config_dict, state, tiny_hf  # noqa: E402

from bitnest_mlx.convert import fold_norms  # noqa: E402
from bitnest_mlx.convert.gptq import gptq_codes  # noqa: E402
from bitnest_mlx.convert.rotation import rotate  # noqa: E402
from bitnest_mlx.convert.sweep import hessian  # noqa: E402
from bitnest_mlx.formats import bitnest  # noqa: E402


def logits(model, weights: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    model.load_state_dict({k: torch.tensor(np.asarray(v, np.float32)) for k, v in weights.items()})
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_fused_rotations_leave_float_logits_unchanged(arch, kind):
    model = tiny_hf(arch)
    weights, config = state(model), config_dict(model)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 24))
    reference = logits(model, weights, tokens)
    rotated = rotate(fold_norms(weights, 2), config, kind, seed=3)
    assert not np.allclose(
        rotated["model.embed_tokens.weight"], weights["model.embed_tokens.weight"]
    )
    np.testing.assert_allclose(logits(model, rotated, tokens), reference, atol=1e-4)


def gptq_problem(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibration inputs x [2048, 256] and a weight [192, 256]; the inputs are correlated and
    outlier-heavy, where GPTQ's error feedback pays."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2048, 256)) @ rng.standard_normal((256, 256))
    return x * rng.uniform(0.1, 3, 256), rng.standard_normal((192, 256))


def test_gptq_has_lower_layer_output_error_than_rtn():
    x, w = gptq_problem(0)
    s = np.repeat(bitnest.weight_scales(w).astype(np.float64), 128, axis=1)
    rtn = np.clip(np.round(w / s), -8, 7) * s
    q, scales = gptq_codes(w, hessian(x))
    assert np.array_equal(scales, bitnest.weight_scales(w))
    assert q.min() >= -8 and q.max() <= 7
    gptq = q * s

    def err(wq):
        return np.linalg.norm(x @ (w - wq).T)

    assert err(gptq) < 0.9 * err(rtn)


@pytest.mark.parametrize("slack", [1.5, 3.0])
def test_gptq_w8_slack_bounds_the_target_error_and_still_beats_rtn(slack):
    x, w = gptq_problem(2)
    h = hessian(x)
    q4, scales = gptq_codes(w, h, w8_slack=slack)
    bound = bitnest.planes_from_codes(w, q4, scales)  # RTN residual of the original weight
    free = bitnest.planes_from_codes(w, *gptq_codes(w, h))
    rtn = bitnest.planes_from_codes(w)
    s = np.repeat(scales.astype(np.float64), 128, axis=1)

    def w8(p):
        return bitnest.dequantize_planes(p.hi, p.lo, p.scales, draft=False)

    def err(p):
        w4 = bitnest.dequantize_planes(p.hi, p.lo, p.scales, draft=True)
        return np.linalg.norm(x @ (w - w4).T)

    # Every hi code is the nibble of a W8 code within `slack` steps of w: W8 error <= slack s/16.
    assert np.all(np.abs(w8(bound) - w) <= slack * s / 16 * (1 + 1e-6))
    assert np.any(np.abs(w8(free) - w) > slack * s / 16)  # free codes break that bound
    assert err(bound) < 0.97 * err(rtn)
    assert err(free) < err(bound)


def test_convert_cli_refuses_a_w8_slack_below_half_a_step(capsys):
    from bitnest_mlx.cli.convert import build_parser

    assert (
        build_parser().parse_args(["--gguf", "x", "--out", "y", "--w8-slack", "none"]).w8_slack
        is None
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--gguf", "x", "--out", "y", "--w8-slack", "0.2"])
    assert ">= 0.5" in capsys.readouterr().err


def test_convert_cli_hf_checkpoint_loads_in_all_modes(tmp_path):
    model = tiny_hf("qwen2")
    model.save_pretrained(tmp_path / "hf")
    from bitnest_mlx.runtime.demo import write_tokenizer

    write_tokenizer(tmp_path / "hf")
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "pkg"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bitnest_mlx.convert",
            "--hf-path",
            str(tmp_path / "hf"),
            "--out",
            str(out),
            "--calib",
            str(calib),
            "--calib-tokens",
            "512",
            "--calib-seq-len",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["method"] == "joint" and summary["rotation"] == "hadamard"
    # The default prints each Linear's draft and target output error against RTN's.
    assert "model.layers.0.mlp.down_proj: output error vs RTN: W4" in r.stderr
    assert 0 < summary["mean_w4_hessian_err_vs_rtn"] < 1
    import bitnest_mlx

    m, _ = bitnest_mlx.load(out, dtype=mx.float32)
    tokens = mx.array([[1, 2, 3, 4, 5]])
    outs = {mode: m(tokens, mode=mode) for mode in ("draft", "target")}
    assert all(o.shape == (1, 5, VOCAB) for o in outs.values())
    assert not mx.array_equal(outs["draft"], outs["target"])


@pytest.mark.parametrize("method", ["gptq", "joint"])
def test_calibrated_codes_beat_rtn_on_every_linear_with_its_calibration_inputs(tmp_path, method):
    """Each Linear's Hessian comes from the runtime forward of the partly quantized model; on it
    the calibrated W4 codes have a lower output error than rounding to nearest."""
    from bitnest_mlx.convert.methods import Method
    from bitnest_mlx.convert.pipeline import build
    from bitnest_mlx.convert.rotation import Rotation
    from bitnest_mlx.convert.settings import BuildSettings
    from bitnest_mlx.convert.sources import Source

    model = tiny_hf("qwen2")
    config = config_dict(model)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 64))
    settings = BuildSettings(
        method=Method(method), rotation=Rotation(config, "hadamard", 0), tokens=tokens
    )
    stats = build(tmp_path / "pkg", Source.from_arrays(state(model), config), settings).per_linear
    assert len(stats) == 2 * 7 + 1  # lm_head included
    for name, e in stats.items():
        assert e["w4_hessian_err_vs_rtn"] < 1, name


def test_converted_package_runs_speculative_decoding(tmp_path):
    import bitnest_mlx
    from bitnest_mlx.runtime.demo import write_tokenizer

    model = tiny_hf("llama")
    model.save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    from bitnest_mlx.convert import ConvertSettings, convert

    convert(
        out=tmp_path / "pkg",
        hf_path=tmp_path / "hf",
        settings=ConvertSettings(method="rtn", rotate_kind="random"),
        scratch=tmp_path,
    )
    from bitnest_mlx.runtime.speculative import speculative_generate_step

    m, tok = bitnest_mlx.load(tmp_path / "pkg", dtype=mx.float32)
    assert tok is not None
    stats = bitnest_mlx.SpeculativeStats()
    # The step generator does not stop at EOS, which a random model may well pick.
    steps = speculative_generate_step(
        mx.array(tok.encode("hello")),
        m,
        max_tokens=12,
        num_draft_tokens=2,
        fallback=False,
        stats=stats,
    )
    assert len([t for t, _, _ in steps]) == 12 and stats.rounds > 0


def test_gptq_residual_recovers_w8_accuracy_lost_to_saturation():
    from bitnest_mlx.convert.gptq import gptq_residual_codes
    from bitnest_mlx.formats import bitnest

    x, w = gptq_problem(1)
    h = hessian(x)
    q4, scales = gptq_codes(w, h)
    rtn = bitnest.planes_from_codes(w, q4, scales)
    qr = gptq_residual_codes(w, q4, scales, h)
    comp = bitnest.planes_from_codes(w, q4, scales, qr)
    assert rtn.saturation > 0.05  # GPTQ moved hi codes the RTN residual cannot reach back to
    assert np.array_equal(comp.hi, rtn.hi)  # the draft plane is untouched

    def err(p):
        w8 = bitnest.dequantize_planes(p.hi, p.lo, p.scales, draft=False)
        return np.linalg.norm(x @ (w - w8).T)

    assert err(comp) < 0.9 * err(rtn)  # measured 0.84 here; no residual can undo all of it


def test_convert_warns_when_calibration_tokens_leave_the_widest_hessian_singular(tmp_path):
    from bitnest_mlx.convert import ConvertSettings, convert
    from bitnest_mlx.runtime.demo import write_tokenizer

    tiny_hf("llama").save_pretrained(tmp_path / "hf")  # intermediate_size 384
    write_tokenizer(tmp_path / "hf")
    with pytest.warns(UserWarning, match=r"256 calibration tokens .* widest Linear input \(384\)"):
        convert(
            out=tmp_path / "pkg",
            hf_path=tmp_path / "hf",
            settings=ConvertSettings(method="gptq", calib_tokens=256, calib_seq_len=64),
            scratch=tmp_path,
        )
    assert (tmp_path / "pkg" / "bitnest.json").is_file()  # a warning, not a refusal


class _WordTokenizer:
    """One id per whitespace-separated word: fewer tokens than any subword tokenizer gives."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


def test_calibration_text_shorter_than_asked_warns_with_its_name_and_counts(tmp_path):
    from bitnest_mlx.convert.calib import calibration_tokens

    short = tmp_path / "short.txt"
    short.write_text("word " * 300)
    with pytest.warns(UserWarning, match=r"short\.txt has 300 tokens.*1024.*calibrating on 256"):
        tokens = calibration_tokens(_WordTokenizer(), short, 1024, 128)
    assert tokens.shape == (2, 128)


def test_builtin_corpus_holds_the_converters_default_calibration_tokens():
    import warnings

    from bitnest_mlx.convert import ConvertSettings
    from bitnest_mlx.convert.calib import calibration_tokens

    default, seq_len = ConvertSettings().calib_tokens, ConvertSettings().calib_seq_len
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens = calibration_tokens(_WordTokenizer(), None, default, seq_len)
    assert tokens.size == default
