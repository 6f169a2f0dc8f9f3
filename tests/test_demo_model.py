"""`--model demo` names the demo package in every command; once the trained demo ships
(bitnest_mlx/demo_model, examples/train_demo.py), it is a language model small enough to ship."""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import bitnest_mlx
from bitnest_mlx.measurement.evaluation import window_nll
from bitnest_mlx.runtime.demo import SHIPPED_DEMO, demo_path, resolve_model

# The Artistic License 1.0's preamble: English of the training text's kind, but from the one
# license examples/train_demo.py holds out, so the model never saw it.
HELD_OUT = (
    "The intent of this document is to state the conditions under which a Package may be "
    "copied, such that the Copyright Holder maintains some semblance of artistic control over "
    "the development of the package, while giving the users of the package the right to use and "
    "distribute the Package in a more-or-less customary fashion, plus the right to make "
    "reasonable modifications."
)
LICENSES = Path("/usr/share/common-licenses")  # the training corpus (Debian)
trained = pytest.mark.skipif(
    not (SHIPPED_DEMO / "bitnest.json").is_file(), reason="the trained demo is not shipped yet"
)


@pytest.fixture(scope="module")
def demo():
    return bitnest_mlx.load(resolve_model("demo"))


def test_demo_names_the_demo_package():
    assert resolve_model("demo") == resolve_model(None) == demo_path()
    assert resolve_model("some/dir") == "some/dir"


@trained
def test_shipped_demo_fits_in_a_wheel():
    assert demo_path() == SHIPPED_DEMO
    files = [p for p in demo_path().iterdir() if p.is_file()]
    assert {"bitnest.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in files}
    assert sum(p.stat().st_size for p in files) <= 20 * 2**20  # issue 16's bound


def perplexity(model, tokenizer, text: str, mode: str) -> float:
    ids = tokenizer.encode(text)
    logits = model(mx.array([ids]), options=bitnest_mlx.RunOptions(mode=mode))[0]
    return math.exp(window_nll(logits, ids) / (len(ids) - 1))


def unigram_perplexity(tokenizer, text: str, vocab: int) -> float:
    """The held-out text scored by the training corpus's token frequencies (add-one): what a
    model that ignores context can do at best with that data."""
    corpus = {p.resolve() for p in LICENSES.iterdir() if p.is_file() and p.name != "Artistic"}
    counts = np.ones(vocab)
    for path in corpus:
        np.add.at(counts, tokenizer.encode(path.read_text(encoding="utf-8")), 1.0)
    logp = np.log(counts / counts.sum())
    return math.exp(-logp[tokenizer.encode(text)].mean())


@trained
@pytest.mark.skipif(not LICENSES.is_dir(), reason="the training corpus is Debian's licenses")
def test_held_out_perplexity_beats_the_training_texts_unigram_statistics(demo):
    model, tokenizer = demo
    unigram = unigram_perplexity(tokenizer, HELD_OUT, model.args.vocab_size)
    assert 300 < unigram < model.args.vocab_size  # BPE tokens of English: a few hundred
    for mode in ("target", "draft"):  # the W8 and the W4 reading of the same model
        assert perplexity(model, tokenizer, HELD_OUT, mode) < 0.6 * unigram, mode


def greedy(model, tokenizer, prompt: str, n: int, **kw) -> str:
    return bitnest_mlx.generate(model, tokenizer, prompt, max_tokens=n, **kw)


@trained
@pytest.mark.skipif(not LICENSES.is_dir(), reason="the training corpus is Debian's licenses")
def test_greedy_text_is_made_of_the_corpus_words(demo):
    model, tokenizer = demo
    known = corpus_words()
    model.mode = "target"
    text = greedy(model, tokenizer, "The", 48, num_draft_tokens=0)
    words = [w.strip(".,;:()\"'") for w in text.split()]
    english = [w for w in words if w.isalpha() and w.lower() in known]
    assert len(words) >= 12, text
    assert len(english) >= 0.8 * len(words), text


def corpus_words() -> set[str]:
    return set(re.findall(r"[a-z]+", " ".join(p.read_text() for p in LICENSES.iterdir()).lower()))


@trained
@pytest.mark.skipif(not LICENSES.is_dir(), reason="the training corpus is Debian's licenses")
def test_generate_with_no_flags_prints_english_words(capsys):
    """The README's first command: the demo, speculative, temp 0.8, seed 0, 100 tokens."""
    from bitnest_mlx.cli import generate

    assert generate.main([]) == 0
    words = re.findall(r"[A-Za-z]+", capsys.readouterr().out)
    known = corpus_words()
    assert len(words) >= 40, words
    assert sum(w.lower() in known for w in words) >= 0.8 * len(words), words


@trained
def test_speculative_decoding_accepts_most_drafts_and_equals_target(demo):
    model, tokenizer = demo
    model.mode = "target"
    stats = bitnest_mlx.SpeculativeStats()
    spec = greedy(
        model,
        tokenizer,
        "The",
        48,
        num_draft_tokens=3,
        fallback=False,
        stats=stats,
        draft_source="model",
    )
    assert spec == greedy(model, tokenizer, "The", 48, num_draft_tokens=0)
    # A random draft would be accepted with probability ~1/vocab; W4 of a trained model agrees
    # with W8 on most greedy tokens. Only the W4 chain drafts here: n-gram copies of the
    # model's own text are a different source with its own acceptance.
    assert set(stats.sources) == {"model"}
    assert stats.drafted > 0 and stats.acceptance_rate > 0.5


def test_every_command_takes_model_demo(tmp_path, capsys):
    import json

    from bitnest_mlx.cli import bench, generate
    from bitnest_mlx.cli import eval as eval_cli
    from bitnest_mlx.cli.server import build_parser, resolved

    pkg = str(demo_path())
    served = resolved(build_parser().parse_args(["--model", "demo", "--mode", "speculative"]))
    assert (served.model, served.draft_model) == (pkg, pkg + "#draft")
    assert bench.build_parser().parse_args([]).model == "demo"
    assert generate.main(["--model", "demo", "--max-tokens", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["generation_tokens"] == 3
    text = tmp_path / "held_out.txt"
    text.write_text(HELD_OUT)
    argv = ["--text", str(text), "--max-tokens", "32", "--gen-tokens", "0", "--json"]
    assert eval_cli.main(["--model", "demo", *argv]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] > 1
