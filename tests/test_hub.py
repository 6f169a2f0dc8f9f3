"""Hub `org/repo[@revision]` against a fake Hub on 127.0.0.1 (tests/hub_server.py): only the
files a format needs, cache reuse, HF_HUB_OFFLINE, and one-line errors that leave the cache
usable."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import FakeHub  # noqa: E402

from bitnest_mlx.formats import bitnest, dsv4_bundle_write  # noqa: E402
from bitnest_mlx.hub import HubError, resolve  # noqa: E402
from bitnest_mlx.runtime.demo import demo_path, write_demo_bundle, write_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("repos")
    pkg = root / "pkg"
    shutil.copytree(demo_path(), pkg)
    (pkg / "README.md").write_text("not needed\n")
    (pkg / "original").mkdir()
    (pkg / "original" / "consolidated.pth").write_bytes(b"\0" * 4096)  # never downloaded
    neither = root / "neither"
    neither.mkdir()
    (neither / "config.json").write_text(json.dumps({"model_type": "llama"}))
    repos = {"org/pkg": pkg, "org/gated": pkg, "org/neither": neither}
    repos["org/dsv4"] = write_demo_bundle(root / "dsv4")
    write_tokenizer(repos["org/dsv4"])
    dsv4_bundle_write.seal(repos["org/dsv4"])  # a deliberate edit: record the new tokenizer
    # The demo package sealed (every file's sha256 recorded), then one bit of its weights flipped.
    flipped = shutil.copytree(demo_path(), root / "flipped")
    bitnest.seal(flipped)
    weights = bytearray((flipped / "model.safetensors").read_bytes())
    weights[-1] ^= 1
    (flipped / "model.safetensors").write_bytes(bytes(weights))
    repos["org/flipped"] = flipped
    server = FakeHub(repos, gated={"org/gated"})
    yield server
    server.close()


@pytest.fixture
def env(hub, tmp_path, monkeypatch):
    """A fresh Hub cache pointed at the fake Hub, for this process and for subprocesses."""
    import huggingface_hub.constants as constants

    values = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }
    for k, v in values.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", values["HF_HUB_CACHE"])
    hub.requests.clear()
    hub.truncate.clear()
    return dict(os.environ)


def test_bitnest_repo_downloads_only_package_files(hub, env):
    import bitnest_mlx

    path = resolve("org/pkg")
    assert sorted(p.name for p in path.iterdir()) == sorted(
        p.name for p in demo_path().iterdir() if p.is_file()
    )
    assert "README.md" not in hub.downloaded()
    assert not any(p.startswith("original/") for p in hub.downloaded())
    model, tokenizer = bitnest_mlx.load("org/pkg")
    _, local_tokenizer = bitnest_mlx.load(demo_path())
    assert model.mode == "target"
    assert tokenizer.encode("hi there") == local_tokenizer.encode("hi there")


def test_revision_pins_a_commit_and_unknown_revision_fails(hub, env):
    sha = hub.sha("org/pkg")
    assert resolve(f"org/pkg@{sha}").name == sha
    with pytest.raises(HubError, match="revision 'v9' not found"):
        resolve("org/pkg@v9")


def test_cached_repo_loads_offline_without_requests(hub, env, monkeypatch):
    first = resolve("org/pkg")
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("org/pkg") == first
    assert hub.requests == []


def test_dsv4_repo_downloads_bundle(hub, env):
    from bitnest_mlx import load

    path = resolve("org/dsv4")
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    model, tokenizer = load(path)
    assert tokenizer is not None


def test_a_download_that_differs_from_its_recorded_sha256_is_refused_naming_the_file(hub, env):
    with pytest.raises(HubError) as e:
        resolve("org/flipped")
    line = str(e.value)
    assert "model.safetensors: sha256" in line and "bitnest.json records" in line
    assert "\n" not in line


def test_interrupted_download_is_never_used_and_resumes(hub, env, monkeypatch):
    from bitnest_mlx.formats import bitnest

    hub.truncate.add("model.safetensors")
    with pytest.raises(HubError, match="download failed"):
        resolve("org/pkg")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="incomplete"):
        resolve("org/pkg")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    hub.truncate.clear()
    assert bitnest.read(resolve("org/pkg")).num_layers == bitnest.read(demo_path()).num_layers


ERRORS = {
    "org/missing": "repository not found",
    "org/gated": "gated repo",
    "org/neither": "neither a bitnest package",
    "not a repo": "not a Hub id",
}


@pytest.mark.parametrize("model", [*ERRORS, "offline"])
def test_cli_errors_are_one_line_and_non_zero(hub, env, model):
    if model == "offline":
        env = {**env, "HF_HUB_OFFLINE": "1"}
        model, expected = "org/pkg", "not in the local cache and HF_HUB_OFFLINE is set"
    else:
        expected = ERRORS[model]
    out = subprocess.run(
        [sys.executable, "-m", "bitnest_mlx.generate", "--model", model, "--max-tokens", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], out.stderr
