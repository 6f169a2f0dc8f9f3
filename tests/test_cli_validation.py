"""Every command refuses a bad argument before loading anything: exit status 2 and one line
`error: ...` on stderr naming the flag (or file) and the bound (or problem), no traceback."""

import subprocess
import sys

import pytest
from factory import make_package

from bitnest_mlx.cli import bench, convert, generate
from bitnest_mlx.cli import eval as eval_cli


def refusal(main, argv: list[str], capsys) -> str:
    """Run `main(argv)`; assert exit status 2 and exactly one `error:` line; return that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals exit
        code = e.code
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


GENERATE = [
    (["--max-tokens", "0"], "--max-tokens", ">= 1"),
    (["-m", "-3"], "--max-tokens", ">= 1"),
    (["--temp", "-0.1"], "--temp", ">= 0"),
    (["--temp", "nan"], "--temp", "finite"),
    (["--top-p", "0"], "--top-p", "(0, 1]"),
    (["--top-p", "1.01"], "--top-p", "(0, 1]"),
    (["--top-k", "-1"], "--top-k", ">= 0"),
    (["--min-p", "1"], "--min-p", "[0, 1)"),
    (["--min-p", "-0.5"], "--min-p", "[0, 1)"),
    (["--num-draft-tokens", "-1"], "--num-draft-tokens", ">= 0"),
    (["--prompt", ""], "--prompt", "empty"),
    (["--max-tokens", "ten"], "--max-tokens", "integer"),
]


@pytest.mark.parametrize("argv,flag,bound", GENERATE, ids=[" ".join(a) for a, _, _ in GENERATE])
def test_generate_refuses_bad_arguments(argv, flag, bound, capsys):
    line = refusal(generate.main, ["--model", "never-loaded", *argv], capsys)
    assert flag in line and bound in line


BENCH = [
    (["--repeats", "0"], "--repeats", ">= 1"),
    (["--prompt-tokens", "1"], "--prompt-tokens", ">= 2"),
    (["--gen-tokens", "1"], "--gen-tokens", ">= 2"),
    (["--num-draft-tokens", "-2"], "--num-draft-tokens", ">= 0"),
    (["--temp", "-1"], "--temp", ">= 0"),
    (["--speed-model", "--acceptance", "full=1.5"], "--acceptance", "0 < alpha < 1"),
    (["--speed-model", "--acceptance", "0.8"], "--acceptance", "expected K=alpha"),
]


@pytest.mark.parametrize("argv,flag,bound", BENCH, ids=[" ".join(a) for a, _, _ in BENCH])
def test_bench_refuses_bad_arguments(argv, flag, bound, capsys):
    line = refusal(bench.main, ["--model", "never-loaded", *argv], capsys)
    assert flag in line and bound in line


CONVERT = [
    (["--calib-tokens", "0"], "--calib-tokens", ">= 1"),
    (["--calib-seq-len", "1"], "--calib-seq-len", ">= 2"),
    (["--damp", "-0.01"], "--damp", ">= 0"),
    (["--seed", "-1"], "--seed", ">= 0"),
    (["--draft-vocab", "0"], "--draft-vocab", "positive number of tokens"),
    (["--draft-vocab", "most"], "--draft-vocab", "'auto' or 'full'"),
]


@pytest.mark.parametrize("argv,flag,bound", CONVERT, ids=[" ".join(a) for a, _, _ in CONVERT])
def test_convert_refuses_bad_numbers(argv, flag, bound, tmp_path, capsys):
    line = refusal(convert.main, ["--gguf", "x.gguf", "--out", str(tmp_path / "o"), *argv], capsys)
    assert flag in line and bound in line
    assert not (tmp_path / "o").exists()


def test_convert_refuses_a_missing_calibration_file(tmp_path, capsys):
    argv = ["--gguf", "x.gguf", "--out", str(tmp_path / "o"), "--calib", str(tmp_path / "no.txt")]
    line = refusal(convert.main, argv, capsys)
    assert "--calib" in line and "no.txt" in line


EVAL_NUMBERS = [
    (["--max-tokens", "1"], "--max-tokens", ">= 2"),
    (["--window", "1"], "--window", ">= 2"),
    (["--gamma", "-1"], "--gamma", ">= 0"),
]


@pytest.mark.parametrize(
    "argv,flag,bound", EVAL_NUMBERS, ids=[" ".join(a) for a, _, _ in EVAL_NUMBERS]
)
def test_eval_refuses_bad_numbers(argv, flag, bound, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    line = refusal(eval_cli.main, ["--model", "never-loaded", "--text", str(text), *argv], capsys)
    assert flag in line and bound in line


TEXTS = {
    "empty": (b"", "empty"),
    "binary": (b"PK\x03\x04\x00\x00text", "NUL byte at offset 4"),
    "latin-1": ("caf\u00e9 au lait".encode("latin-1"), "not UTF-8"),
}


@pytest.mark.parametrize("kind", TEXTS)
def test_eval_refuses_a_text_file_that_is_not_utf8_text(kind, tmp_path, capsys):
    data, problem = TEXTS[kind]
    text = tmp_path / f"{kind}.txt"
    text.write_bytes(data)
    # The file is checked before the model is loaded: the model path is never read.
    line = refusal(eval_cli.main, ["--model", "never-loaded", "--text", str(text)], capsys)
    assert str(text) in line and "--text" in line and problem in line


def test_eval_refuses_a_missing_text_file(tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    line = refusal(eval_cli.main, ["--model", "never-loaded", "--text", str(missing)], capsys)
    assert str(missing) in line and "No such file" in line


def test_eval_refuses_a_text_of_one_token(tmp_path, capsys):
    pkg, _, _ = make_package(tmp_path / "pkg", tokenizer=True)
    text = tmp_path / "one.txt"
    text.write_text("a")  # the byte-level tokenizer: one token, nothing to score
    line = refusal(eval_cli.main, ["--model", str(pkg), "--text", str(text)], capsys)
    assert str(text) in line and "at least 2" in line


def test_eval_refuses_a_single_precision_model(tmp_path, capsys):
    from bitnest_mlx.runtime.demo import demo_bundle_path

    text = tmp_path / "t.txt"
    text.write_text("the river runs slowly past the old mill")
    line = refusal(eval_cli.main, ["--model", str(demo_bundle_path()), "--text", str(text)], capsys)
    assert "one precision" in line


@pytest.mark.parametrize("cli", [generate, bench], ids=["generate", "bench"])
def test_a_broken_dsv4_bundle_is_one_line(cli, tmp_path, capsys):
    import shutil

    from bitnest_mlx.runtime.demo import demo_bundle_path

    bundle = shutil.copytree(demo_bundle_path(), tmp_path / "b")
    shard = sorted(bundle.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    line = refusal(cli.main, ["--model", str(bundle)], capsys)
    assert shard.name in line and "truncated" in line


def test_refusal_through_python_m_is_one_line_without_usage():
    r = subprocess.run(
        [sys.executable, "-m", "bitnest_mlx.generate", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["error: argument --top-p: must be in (0, 1], got 2"]


def test_help_shows_the_bounds_and_when_generation_stops(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no wrapping inside the phrases looked for
    help_text = generate.build_parser().format_help()
    for bound in (">= 1", "(0, 1]", "[0, 1)", "end-of-sequence", "context"):
        assert bound in help_text, bound
