"""An interrupted conversion resumes from its last finished layer: the hidden partial folder
keeps the finished layers (Ctrl-C, SIGTERM, a crash, SIGKILL), the same conversion run again
computes only the layers after them, and the package is byte for byte the uninterrupted one.
Another source or other settings are refused in one line, and --fresh starts over."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitnest_mlx.cli.convert import main
from bitnest_mlx.convert import ConvertSettings, ResumeError, checkpoint, convert, pipeline
from bitnest_mlx.convert.calibrate import Calibration
from bitnest_mlx.convert.methods import Method
from bitnest_mlx.convert.resume import RECORD, RESUME_DIR, _try_lock
from bitnest_mlx.convert.stages import Stages
from bitnest_mlx.formats.bitnest import read

LAYERS = 3
CALIB = ["--calib-tokens", "1024", "--calib-seq-len", "64"]
RTN = ConvertSettings(method="rtn")
SETTINGS = ConvertSettings(method="gptq", calib_tokens=1024, calib_seq_len=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(checkpoint.TINY, "num_hidden_layers", LAYERS)
        return checkpoint.make_checkpoint(
            tmp_path_factory.mktemp("src") / "tiny3", tiny=True, progress=False
        )


@pytest.fixture(autouse=True)
def fixed_resources(monkeypatch):
    """The stages' seconds and memory (manifest `conversion.resources`) differ between any
    two runs, interrupted or not; fixed here so every byte of the package can be compared."""
    monkeypatch.setattr(
        Stages, "report", lambda self: {"stages": {}, "seconds": 0.0, "peak_rss_gb": 0.0}
    )


def digest(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file below `folder` (hidden ones included)."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def reference(ckpt, tmp_path_factory) -> dict[str, str]:
    """The uninterrupted conversion's files (two shards of several segments each)."""
    out = tmp_path_factory.mktemp("ref") / "pkg"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            Stages, "report", lambda self: {"stages": {}, "seconds": 0.0, "peak_rss_gb": 0.0}
        )
        mp.setitem(pipeline.build.__kwdefaults__, "shard_bytes", 2**20)
        convert(out=out, hf_path=ckpt, scratch=out.parent, settings=SETTINGS)
    assert (out / "model.safetensors.index.json").is_file()
    read(out)  # every rule of the format, the joined shards' framing and checksums included
    return digest(out)


def partial_of(out: Path) -> Path:
    (found,) = out.parent.glob(f".{out.name}.partial-*")
    return found


def record(out: Path) -> dict:
    return json.loads((partial_of(out) / RESUME_DIR / RECORD).read_text())


def stop_at_layer(monkeypatch, layer: int, error: BaseException) -> None:
    """Raise `error` when the converter starts reading `layer` (the ones before it finished)."""
    real = pipeline.stored_layer

    def stored_layer(source, i, *args):
        if i == layer:
            raise error
        return real(source, i, *args)

    monkeypatch.setattr(pipeline, "stored_layer", stored_layer)


class Counts:
    """Which layers are read and calibrated, and how many Linears quantized."""

    def __init__(self, monkeypatch):
        self.read, self.hessians, self.quantized = [], [], 0
        real_read, real_hessians, real_quantize = (
            pipeline.stored_layer,
            Calibration.hessians,
            Method.quantize,
        )

        def read(source, i, *args):
            self.read.append(i)
            return real_read(source, i, *args)

        def hessians(calibration, i, weights):
            self.hessians.append(i)
            return real_hessians(calibration, i, weights)

        def quantize(method, *args):
            self.quantized += 1
            return real_quantize(method, *args)

        monkeypatch.setattr(pipeline, "stored_layer", read)
        monkeypatch.setattr(Calibration, "hessians", hessians)
        monkeypatch.setattr(Method, "quantize", quantize)


def test_a_resumed_conversion_is_byte_identical_and_recomputes_no_finished_layer(
    ckpt, reference, tmp_path, monkeypatch
):
    monkeypatch.setitem(pipeline.build.__kwdefaults__, "shard_bytes", 2**20)
    out = tmp_path / "pkg"
    with monkeypatch.context() as mp:
        stop_at_layer(mp, 1, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            convert(out=out, hf_path=ckpt, scratch=tmp_path, settings=SETTINGS)
    assert not out.exists() and record(out)["layers_done"] == 1
    # What a kill in the middle of layer 1 or of the final renames could leave: a cut segment,
    # cut hidden states, a half-finished package. The record names none of them.
    kept = partial_of(out)
    (kept / RESUME_DIR / ".shard-00000-0001.safetensors").write_bytes(b"cut short")
    (kept / RESUME_DIR / "hidden-00002.npy").write_bytes(b"cut short")
    (kept / "model-00001-of-00002.safetensors").write_bytes(b"cut short")

    counts = Counts(monkeypatch)
    convert(out=out, hf_path=ckpt, scratch=tmp_path, settings=SETTINGS)
    assert counts.read == counts.hessians == [1, 2]  # layer 0 is not read or calibrated again
    assert counts.quantized == 2 * 7 + 1  # layers 1 and 2, lm_head
    assert digest(out) == reference
    assert list(tmp_path.glob(".pkg.*")) == []


def test_a_killed_conversion_resumes_to_the_same_package(ckpt, reference, tmp_path):
    """SIGKILL while layer 2 is read (an OOM kill): nothing runs on the way out."""
    out = tmp_path / "pkg"
    child = f"""
import sys
from bitnest_mlx.cli.convert import main
from bitnest_mlx.convert import pipeline
pipeline.build.__kwdefaults__["shard_bytes"] = 2**20
real = pipeline.stored_layer
def stored_layer(source, i, *args):
    if i == 2:
        print("at layer 2", flush=True)
        sys.stdin.readline()  # until killed
    return real(source, i, *args)
pipeline.stored_layer = stored_layer
main({["--hf-path", str(ckpt), "--out", str(out), "--method", "gptq", *CALIB]!r})
"""
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "at layer 2\n"
        proc.kill()
    finally:
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    assert record(out)["layers_done"] == 2
    monkeypatch = pytest.MonkeyPatch()
    try:
        monkeypatch.setitem(pipeline.build.__kwdefaults__, "shard_bytes", 2**20)
        convert(out=out, hf_path=ckpt, scratch=tmp_path, settings=SETTINGS)
    finally:
        monkeypatch.undo()
    assert digest(out) == reference


def interrupted_rtn(ckpt: Path, out: Path, monkeypatch, capsys) -> None:
    """A CLI conversion (rtn, quick) stopped by SIGTERM's SystemExit after layer 0."""
    with monkeypatch.context() as mp:
        stop_at_layer(mp, 1, SystemExit(143))
        with pytest.raises(SystemExit):
            main(["--hf-path", str(ckpt), "--out", str(out), "--method", "rtn"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: interrupted") and "run the same command again" in err[-1]
    assert str(partial_of(out)) in err[-1]


@pytest.mark.parametrize(
    "change, said",
    [
        (["--seed", "1"], "was made with --seed 0, this run has --seed 1"),
        (["--r3", "off"], "was made with --r3 on, this run has --r3 off"),
        (["--kv-group", "64"], "was made with --kv-group 32, this run has --kv-group 64"),
    ],
)
def test_other_settings_are_refused_in_one_line(ckpt, tmp_path, monkeypatch, capsys, change, said):
    out = tmp_path / "pkg"
    interrupted_rtn(ckpt, out, monkeypatch, capsys)
    before = digest(partial_of(out))
    code = main(["--hf-path", str(ckpt), "--out", str(out), "--method", "rtn", *change])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert said in err[0] and "--fresh" in err[0] and "1 finished layers" in err[0]
    assert digest(partial_of(out)) == before and not out.exists()

    counts = Counts(monkeypatch)
    argv = ["--hf-path", str(ckpt), "--out", str(out), "--method", "rtn", *change, "--fresh"]
    assert main(argv) == 0
    assert counts.read == list(range(LAYERS))  # started over
    assert list(tmp_path.glob(".pkg.*")) == [] and (out / "bitnest.json").is_file()


def test_a_changed_source_is_refused_and_the_same_one_resumes(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    interrupted_rtn(ckpt, out, monkeypatch, capsys)
    config = ckpt / "config.json"
    stat = config.stat()
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        with pytest.raises(ResumeError, match="whose file config.json has changed since"):
            convert(out=out, hf_path=ckpt, settings=RTN, scratch=tmp_path)
    finally:
        os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    counts = Counts(monkeypatch)
    convert(out=out, hf_path=ckpt, settings=RTN, scratch=tmp_path)
    assert counts.read == list(range(1, LAYERS))


def test_nothing_is_kept_when_the_first_layer_did_not_finish(ckpt, tmp_path, monkeypatch):
    with monkeypatch.context() as mp:
        stop_at_layer(mp, 0, RuntimeError("disk on fire"))
        with pytest.raises(RuntimeError):
            convert(out=tmp_path / "pkg", hf_path=ckpt, settings=RTN, scratch=tmp_path)
    assert list(tmp_path.glob(".pkg.*")) == []


def test_a_crash_keeps_the_finished_layers_and_says_so(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    with monkeypatch.context() as mp:
        stop_at_layer(mp, 2, OSError("disk full"))
        assert main(["--hf-path", str(ckpt), "--out", str(out), "--method", "rtn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == "error: disk full"
    assert err[-1].startswith("note: 2 finished layers are kept in") and "resumes" in err[-1]
    assert record(out)["layers_done"] == 2


def test_a_partial_another_run_is_writing_is_left_alone(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pkg"
    interrupted_rtn(ckpt, out, monkeypatch, capsys)
    lock = _try_lock(partial_of(out) / RESUME_DIR)  # as the other process would hold it
    try:
        with pytest.raises(ResumeError, match="being written by another conversion"):
            convert(out=out, hf_path=ckpt, settings=RTN, scratch=tmp_path, fresh=True)
    finally:
        os.close(lock)
    assert record(out)["layers_done"] == 1


def test_a_smoothed_conversion_resumes_with_its_kept_search(ckpt, tmp_path, monkeypatch):
    """--smooth: the search ran once, before layer 0; the resumed run reads its result back."""
    settings = ConvertSettings(method="rtn", smooth=True, calib_tokens=1024, calib_seq_len=64)
    convert(out=tmp_path / "ref", hf_path=ckpt, scratch=tmp_path, settings=settings)
    out = tmp_path / "pkg"
    with monkeypatch.context() as mp:
        stop_at_layer(mp, 2, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            convert(out=out, hf_path=ckpt, scratch=tmp_path, settings=settings)
    assert "smoothing" in record(out)
    monkeypatch.setattr(
        "bitnest_mlx.convert.smoothing_vectors", lambda *a, **k: pytest.fail("searched again")
    )
    convert(out=out, hf_path=ckpt, scratch=tmp_path, settings=settings)
    assert digest(out) == digest(tmp_path / "ref")
    assert json.loads((out / "bitnest.json").read_text())["norms"].get("smoothing") is True
