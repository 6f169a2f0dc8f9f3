"""The reduced draft vocabulary (docs/bitnest-package.md §2.9, an extension): the manifest's
`draft` block, the `draft.vocab` tensor of token ids the draft's lm_head keeps, and adding both
to a package whose files are being written.

The target always verifies over the whole vocabulary, so speculative output does not depend on
which ids are kept; only the draft's cost and acceptance do.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import safetensors_io
from .files import find_manifest, read_json, safetensors_files
from .layout import INDEX_NAME, PackageError
from .sealing import seal

DRAFT_VOCAB = "draft.vocab"  # int32 [K]: the kept token ids, strictly increasing
# `vocab_size` (K) is interpreted; `ranking` describes how the ids were chosen. Any other key
# might change the function, so it is refused.
DRAFT_KEYS = ("vocab_size", "ranking")


def draft_vocab_size(manifest: dict, f: Path) -> int:
    """K of the manifest's `draft` block, 0 when there is none (the draft reads every row)."""
    block = manifest.get("draft")
    if block is None:
        return 0
    if not isinstance(block, dict):
        raise PackageError(f"{f}: draft is {block!r}, expected an object (§2.9)")
    for key in block:
        if key not in DRAFT_KEYS:
            raise PackageError(
                f"{f}: draft.{key}: unknown key; expected only {', '.join(DRAFT_KEYS)} (this "
                "reader cannot interpret it)"
            )
    k = block.get("vocab_size")
    if not (isinstance(k, int) and not isinstance(k, bool) and k > 0):
        raise PackageError(f"{f}: draft.vocab_size = {k!r}, expected a positive integer")
    return k


def check_ids(f: Path, ids: mx.array, vocab_size: int) -> None:
    """Kept ids are strictly increasing (so each is kept once) and inside [0, vocab_size)."""
    v = np.array(ids, dtype=np.int64)
    bad = np.flatnonzero((v < 0) | (v >= vocab_size))
    if bad.size:
        raise PackageError(
            f"{f}: tensor {DRAFT_VOCAB}: id {v[bad[0]]} at index {bad[0]}, expected a token id "
            f"in [0, {vocab_size})"
        )
    bad = np.flatnonzero(np.diff(v) <= 0)
    if bad.size:
        raise PackageError(
            f"{f}: tensor {DRAFT_VOCAB}: id {v[bad[0] + 1]} at index {bad[0] + 1} follows "
            f"{v[bad[0]]}; expected strictly increasing ids"
        )


def add_draft_vocab(path: str | Path, ids: np.ndarray, ranking: dict | None = None) -> Path:
    """Give a package being written (a converter's own folder) a reduced draft vocabulary:
    `ids` go into one more shard (the package becomes sharded), the manifest gets its `draft`
    block and the checksums are recomputed. The files are renamed in place, so this is for a
    folder nobody reads yet, not for an installed package."""
    path = Path(path)
    manifest_file = find_manifest(path)
    manifest = read_json(manifest_file)
    if "draft" in manifest:
        raise PackageError(f"{manifest_file}: already has a draft block; expected none")
    vocab_size = manifest["layers"]["lm_head"]["shape"][0]
    ids = np.asarray(ids)
    if ids.ndim != 1 or not ids.size:
        raise PackageError(f"{path}: draft vocabulary of shape {list(ids.shape)}, expected [K>0]")
    kept = mx.array(ids.astype(np.int32))
    check_ids(path, kept, vocab_size)

    files, index, weight_map = safetensors_files(path)
    if weight_map is None:
        names = safetensors_io.read_header(files[0], PackageError)
        weight_map = dict.fromkeys(names, files[0].name)
    n = len(files) + 1
    renamed = {f.name: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files)}
    for f in files:
        f.rename(path / renamed[f.name])
    last = f"model-{n:05d}-of-{n:05d}.safetensors"
    mx.save_safetensors(str(path / last), {DRAFT_VOCAB: kept}, metadata={"format": "mlx"})
    weight_map = {name: renamed[shard] for name, shard in weight_map.items()}
    weight_map[DRAFT_VOCAB] = last
    index_doc = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX_NAME).write_text(json.dumps(index_doc, indent=2) + "\n")

    manifest["draft"] = {"vocab_size": int(ids.size), **({"ranking": ranking} if ranking else {})}
    manifest_file.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return seal(path)
