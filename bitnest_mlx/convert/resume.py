"""Resuming an interrupted conversion (docs/convert.md, "Resuming an interrupted conversion").

A conversion writes into a hidden sibling of its output (`output.atomic_directory`). The
sibling's `.resume/` folder records what is finished, so that the same command run again
continues after the last finished decoder layer instead of starting over:

- `record.json`: the run's `Identity` (the source's files, every setting that changes the
  output, the converter's version), how many layers are finished, the writer's segments that
  hold their tensors (`PackageWriter.checkpoint`) and their per-Linear diagnostics;
- the segments `.shard-*.safetensors`, and `hidden-NNNNN.npy`: the calibration's hidden states
  entering layer NNNNN (float32, saved exactly: a resumed run calibrates on the same bits);
- `smoothing.npz`: the `--smooth` search's vectors (the rest of its result is in the record);
- `lock`: held (flock) by the process writing the folder, so two runs never share one.

Every file is synced before the record names it, and the record is replaced by a rename, so a
process killed at any point (SIGKILL included) leaves a record that describes files on disk:
at most the layer in progress is lost.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..formats.bitnest.segments import fsync_file
from .output import OutputError
from .smoothing import Smoothing

RESUME_DIR = ".resume"
RECORD = "record.json"
FORMAT = 1  # of the record; another one is not resumed
FRESH = "--fresh"


class ResumeError(OutputError):
    """A partial conversion of this output that this run may not continue (one line)."""


def source_files(source: str | Path) -> dict[str, list[int]]:
    """{file name: [size, mtime_ns]} of what a conversion reads from `source`: the GGUF file,
    or every file at the top of an HF directory (config, index, shards and tokenizer all lie
    there). A rewritten or re-downloaded file has another size or modification time."""
    source = Path(source)
    if not source.exists():  # the reader refuses it next, in its own words
        return {}
    files = [source] if source.is_file() else sorted(source.iterdir())
    stats = {f.name: f.stat() for f in files if f.is_file() and not f.name.startswith(".")}
    return {name: [st.st_size, st.st_mtime_ns] for name, st in stats.items()}


@dataclass(frozen=True)
class Identity:
    """What a partial conversion must share with the run that continues it: the source (its
    resolved path and `source_files`) and `settings` ({CLI flag: value as the CLI spells it},
    every one that changes the package, and the converter's version)."""

    source: str
    files: dict
    settings: dict

    @classmethod
    def of(cls, source: str | Path, settings: dict) -> Identity:
        return cls(str(Path(source).resolve()), source_files(source), dict(settings))

    def difference(self, theirs: Identity) -> str | None:
        """How the partial's identity `theirs` differs from this run's, in words, or None."""
        for flag in {**theirs.settings, **self.settings}:
            was, now = theirs.settings.get(flag), self.settings.get(flag)
            if was != now:
                return f"was made with {flag} {was}, this run has {flag} {now}"
        if theirs.source != self.source:
            return f"was made from {theirs.source}, this run reads {self.source}"
        for name in {**theirs.files, **self.files}:
            was, now = theirs.files.get(name), self.files.get(name)
            if was != now:
                change = "is new" if was is None else "is gone" if now is None else "has changed"
                return f"was made from {self.source}, whose file {name} {change} since"
        return None


def _try_lock(folder: Path) -> int | None:
    """An exclusive lock on `folder`'s lock file (its descriptor), or None if another process
    holds it. The kernel drops it when the holder exits, however it exits."""
    fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def partials(out: str | Path) -> list[Path]:
    """The hidden siblings of `out` that hold a record, most recently recorded first."""
    out = Path(os.path.abspath(out))
    found = out.parent.glob(f".{glob.escape(out.name)}.partial-*")
    with_record = [p for p in found if (p / RESUME_DIR / RECORD).is_file()]
    return sorted(with_record, key=lambda p: -(p / RESUME_DIR / RECORD).stat().st_mtime_ns)


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads((path / RESUME_DIR / RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("format") == FORMAT else None


def _has_work(record: dict) -> bool:
    return record.get("layers_done", 0) > 0 or "smoothing" in record


def describe(out: str | Path) -> str | None:
    """One phrase on what a kept partial conversion of `out` holds, or None (for the CLI)."""
    for path in partials(out):
        record = _read_record(path)
        if record is not None and _has_work(record):
            return f"{record['layers_done']} finished layers are kept in {path}"
    return None


class Partial:
    """The folder a conversion writes into and its record; see the module docstring."""

    def __init__(
        self, identity: Identity, path: Path | None = None, record: dict | None = None, lock=None
    ):
        self.identity, self.path, self._lock = identity, path, lock
        self.record = record or {"format": FORMAT, "identity": asdict(identity), "layers_done": 0}
        self.finished = False

    @property
    def folder(self) -> Path:
        assert self.path is not None, "attach() first"
        return self.path / RESUME_DIR

    @property
    def layers_done(self) -> int:
        return self.record["layers_done"]

    def keep(self) -> bool:
        """Whether the folder is worth keeping when the conversion stops early."""
        return not self.finished and _has_work(self.record)

    def attach(self, path: Path) -> None:
        """Write into `path`: a new folder gets its record and lock; a resumed one loses
        whatever its record does not name (a package a killed run had begun to finish, a
        segment or hidden-state file cut short)."""
        if self.path is None:
            self.path = path
            self.folder.mkdir()
            self._lock = _try_lock(self.folder)
            self._save()
            return
        assert path == self.path, (path, self.path)
        named = {RECORD, "lock", "smoothing.npz", self.record.get("hidden")}
        named |= {seg for shard in self.writer_state["shards"] for seg, _ in shard}
        for entry in [*path.iterdir(), *self.folder.iterdir()]:
            if entry.name not in named and entry != self.folder:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def _save(self) -> None:
        """Replace the record in one rename, after its bytes are on the disk."""
        tmp = self.folder / (RECORD + ".tmp")
        tmp.write_text(json.dumps(self.record), encoding="utf-8")
        fsync_file(tmp)
        os.replace(tmp, self.folder / RECORD)

    @property
    def writer_state(self) -> dict:
        return self.record.get("writer") or {"shards": [], "open_bytes": 0}

    @property
    def per_linear(self) -> dict:
        return self.record.get("per_linear", {})

    def hidden(self) -> np.ndarray | None:
        """The calibration's hidden states entering the first unfinished layer."""
        name = self.record.get("hidden")
        return None if name is None else np.load(self.folder / name)

    def save_layer(
        self, done: int, writer: dict, per_linear: dict, hidden: np.ndarray | None
    ) -> None:
        """Record `done` finished layers: the writer's `checkpoint()` (its segments already
        synced), the diagnostics so far and the hidden states entering layer `done`."""
        old, name = self.record.get("hidden"), None
        if hidden is not None:
            name = f"hidden-{done:05d}.npy"
            np.save(self.folder / name, hidden)
            fsync_file(self.folder / name)
        self.record.update(layers_done=done, writer=writer, per_linear=per_linear, hidden=name)
        self._save()
        if old is not None and old != name:  # only now: until the record moved on it was named
            (self.folder / old).unlink(missing_ok=True)

    def save_smoothing(self, smoothing: Smoothing) -> None:
        """Keep the `--smooth` search's result: a resumed run does not search again."""
        np.savez(self.folder / "smoothing.npz", **smoothing.vectors)
        fsync_file(self.folder / "smoothing.npz")
        fields = {"alphas": smoothing.alphas, "errors": smoothing.errors}
        self.record["smoothing"] = {**fields, "settings": smoothing.settings}
        self._save()

    def smoothing(self) -> Smoothing | None:
        kept = self.record.get("smoothing")
        if kept is None:
            return None
        with np.load(self.folder / "smoothing.npz") as vectors:
            return Smoothing(vectors={k: vectors[k] for k in vectors.files}, **kept)

    def close(self, finished: bool) -> None:
        """Release the folder; `finished` (the package is complete): remove the record, the
        segments and the hidden states, which are no part of the package."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
        if finished and self.path is not None:
            self.finished = True
            shutil.rmtree(self.folder, ignore_errors=True)


def open_partial(out: str | Path, identity: Identity, fresh: bool = False) -> Partial:
    """The partial conversion of `out` to continue (same identity), else a new one (`attach`
    gives it its folder). `fresh`: delete the partial conversions of `out` first. A partial
    with another identity is refused (ResumeError naming the difference), as is one another
    process is writing; one with nothing finished is deleted."""
    refusal = None
    for path in partials(out):
        lock = _try_lock(path / RESUME_DIR)
        if lock is None:
            raise ResumeError(
                f"{path} is being written by another conversion to {out}: wait for it to end, "
                "or stop it, before converting to the same --out"
            )
        record = _read_record(path)
        if fresh or record is not None and not _has_work(record):
            os.close(lock)
            shutil.rmtree(path, ignore_errors=True)
            continue
        if record is None:
            differs = "was made by another version of the converter (its record is unreadable)"
            record = {"layers_done": "some"}
        else:
            differs = identity.difference(Identity(**record["identity"]))
        if differs is None:
            return Partial(identity, path, record, lock)
        os.close(lock)
        refusal = refusal or (
            f"{path} holds {record['layers_done']} finished layers of a conversion to {out} "
            f"that {differs}: rerun with its settings to resume it, or add {FRESH} to delete "
            "it and start over"
        )
    if refusal is not None:
        raise ResumeError(refusal)
    return Partial(identity)
