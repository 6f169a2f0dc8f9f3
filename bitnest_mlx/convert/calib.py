"""Calibration text and token batches for GPTQ."""

from __future__ import annotations

import importlib
import inspect
import warnings
from pathlib import Path

import numpy as np

# GPTQ's Hessian for a Linear with d inputs is a sum of rank-one terms, one per token: fewer than d
# tokens leave it singular and the codes lean on damping. 32 k tokens is several times the widest
# Linear input of small models (4,864 in Qwen2.5-0.5B's down_proj) and still above it up to 7 B
# (18,944); the reference GPTQ set (128 × 2,048) is out of reach on a laptop CPU.
CALIB_TOKENS = 32768

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
    # Appended later, so the first 14.6 k tokens (Qwen2's tokenizer) are unchanged: about
    # 100 k tokens in all, room for a calibration set several times the widest Linear input.
    "typing",
    "logging",
    "unittest",
    "email.message",
    "http.client",
    "urllib.parse",
    "asyncio",
    "subprocess",
    "os",
    "shutil",
    "tarfile",
    "zipfile",
    "sqlite3",
    "xml.etree.ElementTree",
    "configparser",
    "enum",
    "dataclasses",
    "inspect",
    "ast",
    "pickle",
    "copy",
    "heapq",
    "bisect",
    "random",
    "threading",
    "queue",
    "socket",
    "struct",
    "codecs",
    "io",
    "tempfile",
    "difflib",
    "pprint",
    "contextlib",
    "abc",
    "types",
    "traceback",
    "warnings",
    "calendar",
    "hashlib",
    "base64",
    "gzip",
    "shlex",
    "optparse",
    "timeit",
    "doctest",
    "pdb",
    "html.parser",
    "mimetypes",
    "uuid",
    "ipaddress",
    "selectors",
    "platform",
    "importlib",
    "pkgutil",
    "tokenize",
    "ftplib",
    "smtplib",
    "imaplib",
    "mailbox",
    "plistlib",
    "gettext",
    "locale",
    "operator",
    "weakref",
    "numbers",
    "cmd",
    "trace",
    "sched",
    "concurrent.futures",
    "multiprocessing",
    "fileinput",
    "filecmp",
    "glob",
    "fnmatch",
    "netrc",
    "wave",
    "colorsys",
    "graphlib",
    "zoneinfo",
    "secrets",
    "hmac",
    "unicodedata",
)


def builtin_corpus() -> str:
    docs = []
    with warnings.catch_warnings():  # reading members touches deprecated ones (typing.io)
        warnings.simplefilter("ignore", DeprecationWarning)
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
    if len(ids) < n_tokens:
        source = text_file or "the built-in corpus"
        warnings.warn(
            f"{source} has {len(ids)} tokens, fewer than the {n_tokens} calibration tokens "
            f"asked for: calibrating on {n_seq * seq_len}",
            stacklevel=2,
        )
    return ids[: n_seq * seq_len].reshape(n_seq, seq_len)
