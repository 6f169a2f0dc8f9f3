"""A shard saved in pieces: the writer saves what it holds at every layer a resumable conversion
finishes (a segment), so a killed process loses at most the layer in progress; the package's
shard is the segments joined at the end.

Joining copies the segments' data sections one after the other behind one header whose offsets
are shifted by what came before (the safetensors framing needs the tensors to tile the data
section, which concatenated sections do), so it streams: no tensor is loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..safetensors_io import read_header
from .layout import PackageError

_COPY_BLOCK = 16 * 2**20


def join_safetensors(parts: list[Path], out: Path) -> None:
    """Write `out`, one safetensors file holding every tensor of `parts`, in their order."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    sections: list[tuple[Path, int, int]] = []  # (file, data start, data length)
    base = 0
    for part in parts:
        spans = read_header(part, PackageError)
        start = min((s.begin for s in spans.values()), default=part.stat().st_size)
        end = max((s.end for s in spans.values()), default=start)
        for name, span in spans.items():
            header[name] = {
                "dtype": span.dtype,
                "shape": list(span.shape),
                "data_offsets": [base + span.begin - start, base + span.end - start],
            }
        sections.append((part, start, end - start))
        base += end - start
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as mlx writes it
    with open(out, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for part, start, length in sections:
            with open(part, "rb") as src:
                src.seek(start)
                while length:
                    block = src.read(min(length, _COPY_BLOCK))
                    if not block:
                        raise PackageError(f"write: {part} ended early")
                    f.write(block)
                    length -= len(block)


def place_shard(parts: list[Path], out: Path, keep: bool) -> None:
    """Make `out` from a shard's segments: the one segment itself (renamed, or hard-linked when
    the segments are to be `keep`t, a copy where the disk has no links) or their join; without
    `keep` the segments are removed."""
    if len(parts) == 1 and not keep:
        parts[0].rename(out)
        return
    if len(parts) == 1:
        try:
            os.link(parts[0], out)
        except OSError:  # FAT/exFAT disks, some network shares
            shutil.copyfile(parts[0], out)
        return
    join_safetensors(parts, out)
    if not keep:
        for part in parts:
            part.unlink()


def fsync_file(path: Path) -> None:
    """Push a file's bytes to the disk: a record naming it may be written next."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
