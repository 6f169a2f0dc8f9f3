"""eval: perplexity of a package's float mode matches transformers' on the source model."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from factory import VOCAB, config_dict, state, tiny_hf  # noqa: E402

import bitnest_mlx  # noqa: E402
from bitnest_mlx.cli import eval as eval_cli  # noqa: E402
from bitnest_mlx.convert import write_package  # noqa: E402
from bitnest_mlx.demo import write_tokenizer  # noqa: E402
from bitnest_mlx.evaluation import evaluate  # noqa: E402

TEXT = "the mill by the river turned slowly while the water ran under the old stone bridge. " * 8


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    model = tiny_hf("llama")
    out = tmp_path_factory.mktemp("pkg")
    write_package(out, state(model), config_dict(model))
    write_tokenizer(out)
    return model, out


def test_float_mode_perplexity_matches_transformers_on_source_weights(package):
    hf, path = package
    model, tokenizer = bitnest_mlx.load(path, dtype=mx.float32)
    tokens = tokenizer.encode(TEXT)[:128]
    assert max(tokens) < VOCAB
    with torch.no_grad():
        loss = hf(torch.tensor([tokens]), labels=torch.tensor([tokens])).loss.item()
    result = evaluate(
        model,
        tokenizer,
        TEXT,
        ["float"],
        max_tokens=128,
        window=128,
        gamma=2,
        spec_tokens=8,
        gen_tokens=0,
    )
    assert result["tokens"] == 127
    scores = result["modes"]["float"]
    # W8 weights without A8/KV quantization stay within 1 % of the float model's perplexity.
    assert scores["ppl"] == pytest.approx(math.exp(loss), rel=0.01)
    assert scores["bits_per_byte"] * result["bytes"] * math.log(2) == pytest.approx(
        result["tokens"] * math.log(scores["ppl"])
    )
    assert 0 <= result["argmax_agreement"] <= 1
    assert 0 <= result["mean_accepted"] <= 2


def test_draft_perplexity_is_worse_than_target_and_float(package):
    _, path = package
    model, tokenizer = bitnest_mlx.load(path, dtype=mx.float32)
    result = evaluate(
        model,
        tokenizer,
        TEXT,
        ["draft", "target", "float"],
        max_tokens=128,
        window=64,
        gamma=2,
        spec_tokens=8,
        gen_tokens=0,
    )
    ppl = {m: s["ppl"] for m, s in result["modes"].items()}
    # Fewer bits cost perplexity: W4A8KV4 > W8A8KV8, and quantizing A/KV costs a little.
    assert ppl["draft"] > ppl["target"]
    assert abs(ppl["target"] - ppl["float"]) < abs(ppl["draft"] - ppl["float"])


def test_eval_cli_prints_json(package, tmp_path, capsys):
    _, path = package
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["--model", str(path), "--text", str(text), "--max-tokens", "64", "--window", "32"]
    capsys.readouterr()
    # In-process (test_cli_entry_points runs the command as a process).
    assert eval_cli.main([*argv, "--json", "--gen-tokens", "8"]) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "target" and out["tokens"] == 62
    assert np.isfinite(out["ppl"])
