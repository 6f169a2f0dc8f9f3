"""`bitnest-upload` publishes a package with a model card, through huggingface_hub, to a fake
Hub on 127.0.0.1; downloading the published repo and running it gives what the local package
gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import bitnest_mlx
from bitnest_mlx.cli import upload as upload_cli
from bitnest_mlx.cli.publish import model_card
from bitnest_mlx.runtime.demo import demo_path
from tests.hub_server import FakeHub


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    server = FakeHub({}, upload_root=tmp_path / "hub-repos")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # create_repo needs one; the fake ignores it
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield server
    server.close()


def eval_json(tmp_path) -> str:
    result = {
        "text": "/usr/share/common-licenses/Artistic",
        "modes": {"target": {"ppl": 317.34, "bits_per_byte": 2.377}},
        "argmax_agreement": 0.8486,
        "sum_min_pq": 0.874,
    }
    f = tmp_path / "eval.json"
    f.write_text(json.dumps(result))
    return str(f)


def test_upload_writes_a_card_pushes_one_commit_and_the_repo_runs(hub, tmp_path, capsys):
    package = shutil.copytree(demo_path(), tmp_path / "pkg")
    argv = [str(package), "me/demo-bitnest", "--eval-json", eval_json(tmp_path)]
    assert upload_cli.main(argv) == 0, capsys.readouterr().err
    assert "uploaded" in capsys.readouterr().out
    (commit,) = hub.commits
    assert commit["repo"] == "me/demo-bitnest"
    assert set(commit["files"]) == {p.name for p in package.iterdir()}
    card = (hub.repos["me/demo-bitnest"] / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: mlx")
    assert "# me/demo-bitnest" in card and "python -m bitnest_mlx.generate --model me/demo" in card
    assert '| `method` | "joint" |' in card  # the converter's settings, from the manifest
    assert "W8 (target) output error against round-to-nearest: mean" in card
    assert "target: ppl 317.3400" in card and "greedy agreement: 84.86%" in card
    # The round trip: the published repo downloads, verifies and decodes as the local package.
    local, tokenizer = bitnest_mlx.load(package)
    remote, remote_tokenizer = bitnest_mlx.load("me/demo-bitnest")
    kw = dict(max_tokens=8, num_draft_tokens=0)
    assert bitnest_mlx.generate(remote, remote_tokenizer, "The river", **kw) == (
        bitnest_mlx.generate(local, tokenizer, "The river", **kw)
    )


def test_the_card_links_a_hub_source_never_a_local_path(tmp_path):
    package = shutil.copytree(demo_path(), tmp_path / "pkg")
    card = model_card(package, "me/x")  # the demo records a local source path
    assert "base_model" not in card and "/tmp/" not in card.split("## How")[0]
    manifest = json.loads((package / "bitnest.json").read_text())
    manifest["source_model"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    (package / "bitnest.json").write_text(json.dumps(manifest))
    card = model_card(package, "me/x")
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card


def test_upload_refuses_a_folder_or_eval_file_it_cannot_describe_in_one_line(hub, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert upload_cli.main([str(tmp_path / "empty"), "me/x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a bitnest package" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert upload_cli.main([str(demo_path()), "me/x", "--eval-json", str(bad)]) == 2
    assert "not the output of `eval --json`" in capsys.readouterr().err
    assert hub.commits == []


def test_convert_upload_repo_publishes_the_new_package(hub, tmp_path, capsys):
    pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from factory import tiny_hf

    from bitnest_mlx.cli import convert as convert_cli
    from bitnest_mlx.runtime.demo import write_tokenizer

    tiny_hf("llama").save_pretrained(tmp_path / "hf")
    write_tokenizer(tmp_path / "hf")
    calib = tmp_path / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    argv = ["--hf-path", str(tmp_path / "hf"), "--out", str(tmp_path / "pkg"), "--calib"]
    argv += [str(calib), "--calib-tokens", "256", "--calib-seq-len", "64"]
    assert convert_cli.main([*argv, "--upload-repo", "me/tiny"]) == 0, capsys.readouterr().err
    assert "uploaded" in capsys.readouterr().err
    (commit,) = hub.commits
    assert "README.md" in commit["files"] and "bitnest.json" in commit["files"]
    remote, _ = bitnest_mlx.load("me/tiny")
    assert remote.supports_draft
