"""Resolve `--model` to a local directory: a path, or a Hugging Face Hub `org/repo[@revision]`."""

from __future__ import annotations

from pathlib import Path


class ModelNotFound(FileNotFoundError):
    pass


def resolve(path_or_repo: str | Path) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    text = str(path_or_repo)
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelNotFound(f"{text}: no such directory (and not a Hub id of the form org/repo)")
    from huggingface_hub import snapshot_download

    repo, _, revision = text.partition("@")
    return Path(snapshot_download(repo, revision=revision or None))
