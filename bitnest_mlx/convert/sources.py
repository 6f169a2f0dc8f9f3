"""Float weights (HF names, [out, in], float32 numpy) and configs from HF checkpoints or GGUF
(`gguf_source`): the converter's inputs, as a `Source` (source_base.py).

A checkpoint is memory-mapped and each tensor is converted (or dequantized) only when asked for,
so converting a model needs the memory of the tensors in use, not of the whole checkpoint.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import numpy as np

from ..formats.safetensors_io import check_safetensors, read_json, string_map
from .gguf_source import load_gguf
from .rope import rope_params
from .source_base import Entry, MappedFile, Source, SourceError, close_all, complete_hf_config

__all__ = ["Source", "SourceError", "load_gguf", "load_hf", "rope_params"]


# ---------------------------------------------------------------------------------------------
# Hugging Face safetensors

# numpy has no bfloat16: its bits are the top half of a float32, read as uint16.
_SAFETENSORS_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}
# A hub id ("org/model"); anything else in _name_or_path is a path on the machine that saved it.
_HUB_ID = re.compile(r"[\w-][\w.-]*(/[\w-][\w.-]*)?")


def _to_float32(raw: np.ndarray) -> np.ndarray:
    if raw.dtype == np.dtype("<u2"):
        out = raw.astype(np.uint32)
        out <<= 16
        return out.view(np.float32)
    return raw.astype(np.float32)


def _shards(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: its index's shards when it has one, so stray
    files beside them (another format's `consolidated.safetensors`) are not read as weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = string_map(
            read_json(index, SourceError).get("weight_map"), index, "weight_map", SourceError
        )
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SourceError(f"{index}: shards {missing} are missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{path}: no *.safetensors files")
    return files


def _hf_tensors(f: Path, mapped: MappedFile) -> dict[str, Entry]:
    """The tensors of one safetensors file (its header checked by `check_safetensors`)."""
    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    tensors = {}
    for k, info in header.items():
        # Old Llama checkpoints store RoPE's inverse frequencies, a buffer derived from config.
        if k == "__metadata__" or k.endswith("rotary_emb.inv_freq"):
            continue
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SourceError(
                f"{f}: tensor {k} has dtype {info.get('dtype')}, expected one of F32, F16, BF16"
            )
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        if end - begin != dtype.itemsize * int(np.prod(shape)):
            raise SourceError(f"{f}: tensor {k} holds {end - begin} bytes, not its shape {shape}")
        tensors[k] = Entry(shape, partial(mapped.read, 8 + n + begin, dtype, shape, _to_float32))
    return tensors


def load_hf(path: str | Path) -> Source:
    """A Hugging Face Llama/Qwen2 safetensors checkpoint directory (float16/bfloat16/float32)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SourceError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    config = complete_hf_config(
        read_json(path / "config.json", SourceError), str(path / "config.json")
    )
    maps: list[MappedFile] = []
    tensors: dict[str, Entry] = {}
    try:
        for f in _shards(path):
            check_safetensors(f, SourceError)  # size and header sanity: the header is trusted
            try:
                maps.append(MappedFile(f))
            except (OSError, ValueError) as e:
                raise SourceError(f"{f}: unreadable safetensors file ({e})") from e
            for k, entry in _hf_tensors(f, maps[-1]).items():
                if k in tensors:
                    raise SourceError(f"{f}: tensor {k} is in another shard too")
                tensors[k] = entry
    except BaseException:
        close_all(maps)()
        raise
    if "lm_head.weight" not in tensors:
        # Tied in all but name: transformers would leave lm_head random, no model is saved so.
        config["tie_word_embeddings"] = True
    elif config.get("tie_word_embeddings"):
        del tensors["lm_head.weight"]  # transformers ignores a stored copy of a tied head
    # The name, never where the checkpoint happened to be saved on someone's machine.
    saved_as = config.pop("_name_or_path", None)
    name = saved_as if isinstance(saved_as, str) and _HUB_ID.fullmatch(saved_as) else None
    return Source(config, path, name or path.resolve().name, tensors, close_all(maps))
