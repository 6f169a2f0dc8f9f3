"""Calibration text and token batches for GPTQ."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import numpy as np

# Docstrings of standard-library modules: ordinary technical English present on every Python
# install, under the PSF license; deterministic for a given Python version.
_MODULES = (
    "json",
    "re",
    "pathlib",
    "collections",
    "argparse",
    "functools",
    "itertools",
    "textwrap",
    "datetime",
    "decimal",
    "fractions",
    "statistics",
    "string",
    "csv",
)


def builtin_corpus() -> str:
    docs = []
    for name in _MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(doc) > 200:
                docs.append(doc)
    return "\n\n".join(dict.fromkeys(docs))


def calibration_tokens(
    tokenizer, text_file: str | Path | None, n_tokens: int, seq_len: int
) -> np.ndarray:
    """[n_seq, seq_len] token ids from the file (or the built-in corpus), consecutive windows."""
    text = Path(text_file).read_text(encoding="utf-8") if text_file else builtin_corpus()
    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
    n_seq = max(1, min(n_tokens, len(ids)) // seq_len)
    if len(ids) < seq_len:
        raise ValueError(f"calibration text has {len(ids)} tokens, need at least {seq_len}")
    return ids[: n_seq * seq_len].reshape(n_seq, seq_len)
