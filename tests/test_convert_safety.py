"""The converter never destroys its input and never leaves a half package: it writes a hidden
sibling of --out and renames it into place at the end; --out equal to or inside the source, or
an existing non-empty --out without --force, is refused before anything is read."""

import hashlib
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from factory import tiny_hf  # noqa: E402

import bitnest_mlx.convert as convert_module  # noqa: E402
from bitnest_mlx.cli.convert import main  # noqa: E402
from bitnest_mlx.convert import (  # noqa: E402
    ConvertSettings,
    OutputError,
    atomic_directory,
    check_output,
    convert,
)
from bitnest_mlx.convert.methods import Method  # noqa: E402
from bitnest_mlx.runtime.demo import write_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    """A tiny HF Llama checkpoint (safetensors, config.json, tokenizer files)."""
    path = tmp_path_factory.mktemp("src") / "hf"
    tiny_hf("llama").save_pretrained(path)
    write_tokenizer(path)
    return path


def digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below `folder` (hidden files included)."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main([*argv, "--method", "rtn"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_out_equal_to_the_source_is_refused_and_the_source_is_byte_identical(hf, capsys):
    before = digest(hf)
    code, err = run(["--hf-path", str(hf), "--out", str(hf)], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert err[0].count(str(hf)) == 2  # names --out and the source
    assert digest(hf) == before
    assert hidden(hf.parent) == []


def test_out_inside_the_source_is_refused(hf, capsys):
    before = digest(hf)
    code, err = run(["--hf-path", str(hf), "--out", str(hf / "pkg")], capsys)
    assert code == 2 and len(err) == 1
    assert str(hf / "pkg") in err[0] and "inside the source directory" in err[0]
    assert digest(hf) == before and not (hf / "pkg").exists()
    # Spelled another way, through `..`, it is still the source.
    code, err = run(["--hf-path", str(hf), "--out", str(hf / "pkg" / ".." / ".")], capsys)
    assert code == 2 and digest(hf) == before


def test_out_that_contains_the_source_is_refused_even_with_force(hf, capsys):
    before = digest(hf)
    code, err = run(["--hf-path", str(hf), "--out", str(hf.parent), "--force"], capsys)
    assert code == 2 and len(err) == 1 and "contains the input" in err[0]
    assert digest(hf) == before


def test_gguf_file_as_out_is_refused_but_its_folder_is_a_fine_parent(tmp_path, capsys):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF not really")
    code, err = run(["--gguf", str(gguf), "--out", str(gguf)], capsys)
    assert code == 2 and len(err) == 1 and err[0].count(str(gguf)) == 2
    assert gguf.read_bytes() == b"GGUF not really"
    check_output(tmp_path / "pkg", source=gguf, source_is_dir=False)  # no refusal


def test_existing_non_empty_out_is_refused_without_force_and_replaced_with_it(hf, tmp_path, capsys):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "keep.txt").write_text("an earlier package")
    code, err = run(["--hf-path", str(hf), "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1 and str(out) in err[0] and "--force" in err[0]
    assert digest(out) == {"keep.txt": hashlib.sha256(b"an earlier package").hexdigest()}

    code, err = run(["--hf-path", str(hf), "--out", str(out), "--force"], capsys)
    assert code == 0, err
    assert not (out / "keep.txt").exists()
    assert {"bitnest.json", "config.json", "model.safetensors"} <= set(digest(out))
    assert hidden(tmp_path) == []


def test_an_existing_empty_out_is_written_without_force(hf, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    summary = convert(out=out, hf_path=hf, settings=ConvertSettings(method="rtn"), scratch=tmp_path)
    assert summary["out"] == str(out) and (out / "model.safetensors").is_file()
    assert hidden(tmp_path) == []


class Interrupt:
    """Method.quantize that raises `error` on the second Linear (after the first is done)."""

    def __init__(self, error: BaseException):
        self.error, self.calls = error, 0
        self.real = Method.quantize

    def patch(self, monkeypatch) -> None:
        def quantize(method, *args, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise self.error
            return self.real(method, *args, **kwargs)

        monkeypatch.setattr(Method, "quantize", quantize)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("disk on fire")])
def test_an_interrupted_conversion_leaves_neither_out_nor_a_temporary_folder(
    hf, tmp_path, monkeypatch, error
):
    interrupt = Interrupt(error)
    interrupt.patch(monkeypatch)
    out = tmp_path / "pkg"
    with pytest.raises(type(error)):
        convert(out=out, hf_path=hf, settings=ConvertSettings(method="rtn"), scratch=tmp_path)
    assert interrupt.calls == 2
    assert not out.exists() and hidden(tmp_path) == []


def test_an_interrupted_forced_conversion_keeps_the_old_package(hf, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "old.txt").write_text("old")
    Interrupt(KeyboardInterrupt()).patch(monkeypatch)
    code, err = run(["--hf-path", str(hf), "--out", str(out), "--force"], capsys)
    # The progress bar's last state, then the one error line, on a line of its own.
    assert code == 130 and err[-1].startswith("error: interrupted")
    assert [line for line in err if "error" in line] == err[-1:]
    assert digest(out) == {"old.txt": hashlib.sha256(b"old").hexdigest()}
    assert hidden(tmp_path) == []


def test_a_failed_final_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "old.txt").write_text("old")
    real_rename, calls = convert_module.output.os.rename, []

    def rename(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # old aside worked; the new one cannot come in
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(convert_module.output.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        with atomic_directory(out, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert hidden(tmp_path) == []


def test_atomic_directory_refuses_a_non_empty_out_without_replace(tmp_path):
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OutputError, match="not empty"):
        with atomic_directory(out) as tmp:
            assert tmp.parent == tmp_path and tmp.name.startswith(".pkg.partial-")
            (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert hidden(tmp_path) == []
