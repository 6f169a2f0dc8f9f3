"""`python -m bitnest_mlx.server` on 127.0.0.1 (model fetched from the fake Hub): streaming and
non-streaming /v1/chat/completions, served by the self-speculative loop by default."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import FakeHub  # noqa: E402
from server_process import post, request, running_server  # noqa: E402

from bitnest_mlx.cli.server import build_parser, resolved  # noqa: E402
from bitnest_mlx.demo import demo_path  # noqa: E402

REQUEST = {"messages": [{"role": "user", "content": "The river"}], "max_tokens": 10}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    shutil.copytree(demo_path(), root / "pkg")
    hub = FakeHub({"org/pkg": root / "pkg"})
    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HUB_CACHE": str(root / "cache"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HUB_OFFLINE": "0",
    }
    try:
        with running_server(["--model", "org/pkg"], root / "server.log", env) as url:
            yield url
    finally:
        hub.close()


def _post(url: str, body: dict) -> bytes:
    return post(url, "/v1/chat/completions", body)


def test_draft_model_defaults_to_the_same_package_unless_target_only(tmp_path):
    pkg = str(demo_path())

    def served(*argv: str) -> tuple[str, str | None, int]:
        args = resolved(build_parser().parse_args(list(argv)))
        return args.model, args.draft_model, args.port

    assert served("--model", pkg, "--port", "1") == (pkg, pkg + "#draft", 1)
    assert served("--model", pkg, "--target-only") == (pkg, None, 8080)
    assert served("--model", "demo", "--draft-model", "other")[1] == "other"


def test_chat_completion_non_streaming_and_streaming_agree(server):
    answer = json.loads(_post(server, {**REQUEST, "temperature": 0.0}))
    choice = answer["choices"][0]
    assert choice["message"]["content"] and choice["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == REQUEST["max_tokens"]

    raw = _post(server, {**REQUEST, "temperature": 0.0, "stream": True}).decode()
    events = [line[len("data: ") :] for line in raw.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" for c in chunks)
    assert text == choice["message"]["content"]  # greedy: speculation is lossless
    assert chunks[-1]["finish_reason"] == "length"


def test_models_lists_the_hub_id_and_requests_may_name_it(server):
    status, raw = request(server, "/v1/models")
    assert status == 200
    assert [m["id"] for m in json.loads(raw)["data"]] == ["org/pkg"]
    answer = json.loads(_post(server, {**REQUEST, "model": "org/pkg", "temperature": 0.0}))
    assert answer["choices"][0]["message"]["content"]
    status, raw = request(server, "/v1/chat/completions", {**REQUEST, "model": "org/other"})
    assert status == 404 and "org/pkg" in json.loads(raw)["error"]
