"""Where a conversion writes: never into its own input, and never a half-written package.

`check_output` refuses an output directory that is (or is inside) the source checkpoint, that
contains an input, or that already holds files (unless replacing it was asked for).
`atomic_directory` gives the writer a hidden sibling of the output (`.NAME.partial-XXXXXXXX`) and
renames it into place only when the body has finished; an exception or a KeyboardInterrupt
removes it, unless a resumable conversion has finished layers in it (`resume.py`: then it stays
for the next run). A process killed outright (SIGKILL) can leave only that hidden sibling behind,
never a half package under the output's name.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputError(ValueError):
    """An output directory the converter will not write; the message names the paths."""


def _same(a: Path, b: Path) -> bool:
    """The same file system entry: equal resolved paths, or one inode (case-insensitive disks)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def _within(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies anywhere below it (checked through every existing ancestor)."""
    path = Path(os.path.abspath(path))
    return any(_same(p, folder) for p in (path, *path.parents))


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def check_output(
    out: str | Path,
    *,
    source: str | Path,
    source_is_dir: bool,
    inputs: Iterable[str | Path] = (),
    replace: bool = False,
) -> None:
    """Refuse (OutputError) an output directory that would overwrite or delete an input.

    `source` is the checkpoint (a directory for HF, a file for GGUF: a file's own directory is a
    fine parent for the output, the file itself is not); `inputs` are other files read (the
    calibration text). An existing non-empty `out` is refused unless `replace`.
    """
    out, source = Path(out), Path(source)
    if _within(out, source):
        where = "is" if _same(out, source) else "is inside"
        kind = "directory" if source_is_dir else "file"
        raise OutputError(
            f"output directory {out} {where} the source {kind} {source}; writing there would "
            "overwrite the source checkpoint: choose an output outside it"
        )
    for path in (source, *inputs):
        if Path(path).exists() and _within(Path(path), out):
            raise OutputError(
                f"output directory {out} contains the input {path}; replacing it would delete "
                "the input: choose another output directory"
            )
    if os.path.lexists(out):
        if not out.is_dir():
            raise OutputError(f"output path {out} exists and is not a directory")
        if not replace and not _is_empty_dir(out):
            raise OutputError(
                f"output directory {out} exists and is not empty; pass --force to replace it "
                "(the old directory is removed only once the new package is complete)"
            )


def _sibling(out: Path, tag: str) -> Path:
    """A new hidden name beside `out`: `.NAME.<tag>-XXXXXXXX`."""
    while True:
        path = out.with_name(f".{out.name}.{tag}-{secrets.token_hex(4)}")
        if not os.path.lexists(path):
            return path


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _install(new: Path, out: Path, replace: bool) -> None:
    """Rename `new` to `out`; a non-empty `out` is renamed aside first (with `replace`), and
    removed only once `new` is in place."""
    if not os.path.lexists(out) or _is_empty_dir(out):
        try:
            os.rename(new, out)  # POSIX replaces an empty directory in the same step
            return
        except OSError as e:
            if not (os.path.lexists(out) and not _is_empty_dir(out)):
                raise
            if not replace:  # something was written there meanwhile
                raise OutputError(f"output directory {out} was filled during conversion") from e
    elif not replace:
        raise OutputError(f"output directory {out} exists and is not empty; pass --force")
    old = _sibling(out, "old")
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)  # the old package stays where it was
        raise
    _remove(old)


@contextmanager
def atomic_directory(
    out: str | Path,
    *,
    replace: bool = False,
    into: Path | None = None,
    keep: Callable[[], bool] | None = None,
) -> Iterator[Path]:
    """Yield a new empty hidden sibling of `out` to write into; when the body returns, rename it
    to `out`. On any exception (KeyboardInterrupt and SystemExit included) the sibling is removed
    and `out` is as it was.

    `out` may be absent or an empty directory. A non-empty `out` is refused (OutputError) unless
    `replace`: then it is renamed aside, the new directory renamed in, and the old one deleted.
    Its parent directories are created as needed.

    A resumable conversion (`resume.py`) passes `into`, an existing sibling to continue in
    instead of a new one, and `keep`: when it says so on an exception, the sibling stays, for
    the next run to resume.
    """
    out = Path(os.path.abspath(out))  # no symlink resolution: a linked `out` is replaced itself
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = into
    while tmp is None:
        tmp = _sibling(out, "partial")
        try:
            tmp.mkdir()  # plain mkdir: the package gets the umask's permissions, like any folder
        except FileExistsError:  # another process took the name in between
            tmp = None
    try:
        yield tmp
        _install(tmp, out, replace)
    except BaseException:
        if keep is None or not keep():
            _remove(tmp)
        raise
