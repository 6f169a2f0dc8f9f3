"""Resolve `--model` to a local directory: a path, or a Hugging Face Hub `org/repo[@revision]`.

A Hub repo is fetched with `huggingface_hub.snapshot_download` in two steps: the small JSON files
that say what the repo is (bitnest manifest, config.json), then only the files that format needs.
Downloads go through the normal Hub cache (reused, resumable, with a progress bar), and
`HF_HUB_OFFLINE=1` / `HF_ENDPOINT` are read at call time. Every failure is a `HubError` with a
one-line message, and a snapshot is only returned when huggingface_hub holds all its files, so a
download that was cut short is completed (online) or refused (offline), never used half-written.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from .formats import bitnest, checksums, detect, dsv4_bundle, safetensors_io
from .formats.bitnest import TOKENIZER_FILES

# What each format needs from a repo (huggingface_hub allow_patterns).
_PROBE = ["config.json", "bitnest.json", "manifest.json"]
_TOKENIZER = [*TOKENIZER_FILES, "*.jinja"]
PATTERNS = {
    "bitnest": [*_PROBE, "model*.safetensors", "model.safetensors.index.json", *_TOKENIZER],
    "dsv4": ["config.json", "jang_config.json", "*.safetensors", "*.safetensors.index.json"]
    + _TOKENIZER,
}
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class HubError(OSError):
    """`--model` could not be resolved; the message is one line, fit for `error: ...`."""


class ModelNotFound(HubError):
    pass


def split_revision(text: str) -> tuple[str, str | None]:
    """ "org/repo@rev" -> ("org/repo", "rev"); no "@" -> revision None."""
    repo, _, revision = text.partition("@")
    return repo, revision or None


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve(path_or_repo: str | Path) -> Path:
    """A local directory as is; a Hub id downloaded (or found in the cache) and returned."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    repo, revision = split_revision(text)
    if text.startswith((".", "/", "~")) or not _REPO_ID.match(repo):
        raise ModelNotFound(f"{text}: no such directory (and not a Hub id of the form org/repo)")
    where = f"{repo}@{revision}" if revision else repo
    started = time.time()
    snapshot = _download(repo, revision, _PROBE, where)
    fmt = detect(snapshot)
    if fmt is None:
        raise HubError(
            f"{where}: neither a bitnest package (no bitnest.json) nor a DeepSeek-V4 bundle "
            "(config.json model_type is not deepseek_v4)"
        )
    snapshot = _download(repo, revision, PATTERNS[fmt], where)
    verify_downloaded(snapshot, fmt, started)
    return snapshot


def verify_downloaded(snapshot: Path, fmt: str, since: float) -> None:
    """Hash the files of `snapshot` fetched at or after `since` (their cache blobs are that
    new) against the checksums the model records (formats/checksums.py), so a file that
    differs from what its writer wrote is refused once, when it arrives; files already in the
    cache were checked when they came, and loading them again reads no data."""
    if fmt == "bitnest":
        doc_file, key = bitnest.find_manifest(snapshot), bitnest.CHECKSUMS_KEY
    else:
        doc_file, key = snapshot / "config.json", dsv4_bundle.CHECKSUMS_KEY
    doc = safetensors_io.read_json(doc_file, HubError)
    if key not in doc:
        return  # written without checksums: nothing to compare with
    block = checksums.check_block(doc, doc_file, key, HubError)
    # A second of slack: some file systems keep mtimes in whole seconds.
    fresh = [f.name for f in snapshot.iterdir() if f.is_file() and f.stat().st_mtime >= since - 1]
    checksums.verify_files(block, doc_file, HubError, only=fresh)


def _download(repo: str, revision: str | None, patterns: list[str], where: str) -> Path:
    from huggingface_hub import errors, snapshot_download

    try:
        return Path(
            snapshot_download(
                repo,
                revision=revision,
                allow_patterns=patterns,
                local_files_only=offline(),
                endpoint=os.environ.get("HF_ENDPOINT") or None,
            )
        )
    except errors.GatedRepoError as e:
        raise HubError(f"{where}: gated repo: accept its terms on the Hub and log in") from e
    except errors.RepositoryNotFoundError as e:
        # The Hub answers 401 for private repos too: say both.
        raise HubError(f"{where}: repository not found (or private: log in / set HF_TOKEN)") from e
    except errors.RevisionNotFoundError as e:
        raise HubError(f"{where}: revision {revision!r} not found") from e
    except errors.IncompleteSnapshotError as e:
        raise HubError(
            f"{where}: the cached copy is incomplete and the Hub cannot be reached; "
            "run again online to finish the download"
        ) from e
    except errors.LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline() else "the Hub cannot be reached"
        raise HubError(f"{where}: not in the local cache and {why}") from e
    except errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status in (401, 403):
            raise HubError(f"{where}: unauthorized (HTTP {status}): log in / set HF_TOKEN") from e
        raise HubError(f"{where}: download failed (HTTP {status})") from e
    except errors.HFValidationError as e:
        raise ModelNotFound(f"{where}: not a valid Hub repo id") from e
    except Exception as e:  # a connection dropped mid-file (httpx errors are not OSError), ...
        raise HubError(f"{where}: download failed ({type(e).__name__}: {e})") from e
