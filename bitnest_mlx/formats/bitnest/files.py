"""Finding and opening a package's files: the manifest, JSON, safetensors (truncation checked)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .. import safetensors_io
from .layout import FORMAT, INDEX_NAME, MANIFEST_NAMES, PackageError


def find_manifest(path: Path) -> Path:
    """The package's one manifest file; PackageError when there is none or more than one."""
    path = Path(path)
    if not path.is_dir():
        raise PackageError(f"{path}: not a directory (a bitnest package is a directory)")
    found, ignored = [], []
    for name in MANIFEST_NAMES:
        f = path / name
        if not f.is_file():
            continue
        # manifest.json is a common name for unrelated JSON: it counts only with our format string.
        if name == "manifest.json" and read_json(f).get("format") != FORMAT:
            ignored.append(name)
            continue
        found.append(f)
    if not found:
        hint = f"; {ignored[0]} is present but lacks that format string" if ignored else ""
        raise PackageError(
            f"{path}: no manifest: expected bitnest.json (or manifest.json with "
            f'"format": "{FORMAT}"){hint}'
        )
    if len(found) > 1:
        raise PackageError(
            f"{path}: two manifests ({', '.join(f.name for f in found)}); expected exactly one"
        )
    return found[0]


def is_package(path: str | Path) -> bool:
    """True when `path` is a directory with exactly one bitnest manifest (nothing else checked)."""
    try:
        find_manifest(Path(path))
    except PackageError:
        return False
    return True


def read_json(f: Path) -> dict:
    return safetensors_io.read_json(f, PackageError)


def safetensors_files(path: Path) -> tuple[list[Path], Path | None, dict | None]:
    """(files, index file or None, the index's weight_map or None)."""
    index = path / INDEX_NAME
    single = path / "model.safetensors"
    if index.is_file():
        # Both would leave it open which copy of a tensor is meant (mlx-lm would load both).
        if single.is_file():
            raise PackageError(
                f"{path}: both model.safetensors and {INDEX_NAME}; expected one of the two"
            )
        weight_map = safetensors_io.string_map(
            read_json(index).get("weight_map"), index, "weight_map", PackageError
        )
        for tensor, shard in weight_map.items():
            if not (path / shard).is_file():
                raise PackageError(
                    f"{index}: weight_map puts tensor {tensor} in {shard}, which does not exist"
                )
        return sorted({path / f for f in weight_map.values()}), index, weight_map
    if single.is_file():
        return [single], None, None
    if sorted(path.glob("model-*-of-*.safetensors")):
        raise PackageError(f"{path}: sharded safetensors without {INDEX_NAME}")
    raise PackageError(f"{path}: no model.safetensors (or shards with {INDEX_NAME})")


def read_tensors(path: Path) -> dict[str, tuple[Path, mx.array]]:
    """All tensors of a package, each with the file it came from."""
    path = Path(path)
    files, index, weight_map = safetensors_files(path)
    out: dict[str, tuple[Path, mx.array]] = {}
    for f in files:
        arrays = safetensors_io.load_safetensors(f, PackageError)
        for name, a in arrays.items():
            if name in out:
                raise PackageError(
                    f"{f}: tensor {name} is also in {out[name][0].name}; expected it once"
                )
            out[name] = (f, a)
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in out or out[name][0] != path / shard:
                actual = f"it is in {out[name][0].name}" if name in out else "no shard has it"
                raise PackageError(
                    f"{index}: weight_map puts tensor {name} in {shard}, but {actual}"
                )
    return out
