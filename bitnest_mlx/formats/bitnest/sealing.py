"""Recording a package's checksums in its manifest (docs/bitnest-package.md §2.6): the last step
of writing one, and of any deliberate edit of its files."""

from __future__ import annotations

import json
from pathlib import Path

from .. import checksums
from .files import find_manifest, read_json, safetensors_files
from .layout import CHECKSUMS_KEY


def write_manifest(f: Path, manifest: dict, files: list[Path], config: dict | None) -> None:
    """The manifest with its checksum block (docs/bitnest-package.md §2.6): every tensor of
    `files`, config.json's content when there is one, the bytes of every other file beside it,
    and the manifest itself."""
    json_docs = {"config.json": config} if config is not None else {}
    checksums.make_block(manifest, CHECKSUMS_KEY, files, json_docs, f)
    f.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def seal(path: str | Path) -> Path:
    """Recompute a package's checksums after a deliberate edit of its files (a hand-edited
    manifest value, re-saved tensors): from then on the edited package is the one that loads.

    Checks nothing else; `read` still validates every rule.
    """
    path = Path(path)
    manifest_file = find_manifest(path)
    config_file = path / "config.json"
    config = read_json(config_file) if config_file.is_file() else None
    files, _, _ = safetensors_files(path)
    write_manifest(manifest_file, read_json(manifest_file), files, config)
    return path
