"""`python -m bitnest_mlx.server` on 127.0.0.1 (model fetched from the fake Hub): streaming and
non-streaming /v1/chat/completions (the default mode by device), the flags' help and refusals,
OpenAI's error shape and the served model's id."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from hub_server import FakeHub  # noqa: E402
from server_process import failed_start, post, request, running_server  # noqa: E402

from bitnest_mlx.cli.server import build_parser, resolved  # noqa: E402
from bitnest_mlx.runtime.demo import demo_path  # noqa: E402

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

    speculative = served("--model", pkg, "--mode", "speculative", "--port", "1")
    assert speculative == (pkg, pkg + "#draft", 1)
    assert served("--model", pkg, "--target-only") == (pkg, None, 8080)
    assert served("--model", pkg, "--mode", "target")[1] is None
    assert served("--model", "demo", "--draft-model", "other")[1] == "other"


def test_the_default_mode_follows_the_device_with_one_line_saying_why():
    """As generate's: speculation by default on a GPU; on a CPU device target-only, a note."""
    args = resolved(build_parser().parse_args(["--model", "demo"]))
    if mx.default_device().type == mx.DeviceType.gpu:
        assert args.draft_model.endswith("#draft") and not args.mode_note
    else:
        assert args.draft_model is None
        assert "target-only" in args.mode_note and "--mode speculative" in args.mode_note


def test_help_describes_every_flag_with_its_default():
    parser = build_parser()
    blocks = parser.format_help().split("\n  --")  # one per flag, as --help prints it
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{action.option_strings} has no help"
        flag = action.option_strings[0].removeprefix("--")
        (block,) = [b for b in blocks if b.split()[0] == flag]
        assert "default" in block, block


@pytest.mark.parametrize("flag", [["--kv-bits", "4"], ["--pipeline"]])
def test_kv_bits_and_pipeline_are_refused_for_a_bitnest_package_in_one_line(flag):
    status, err, listened = failed_start(["--model", str(demo_path()), *flag])
    assert status == 2 and not listened
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag[0]}: a bitnest package"), err


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
    error = json.loads(raw)["error"]
    assert status == 404 and "org/pkg" in error["message"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def test_a_request_without_model_is_answered_with_the_served_id(server):
    for route, body in (
        ("/v1/chat/completions", REQUEST),
        ("/v1/completions", {"prompt": "The river", "max_tokens": 4}),
    ):
        assert json.loads(post(server, route, body))["model"] == "org/pkg"
    raw = post(server, "/v1/chat/completions", {**REQUEST, "stream": True}).decode()
    first = json.loads(raw.split("data: ")[1])
    assert first["model"] == "org/pkg"


def test_an_empty_prompt_is_a_400_in_openais_error_shape(server):
    status, raw = request(server, "/v1/completions", {"prompt": "", "max_tokens": 4})
    assert status == 400, raw
    assert json.loads(raw) == {
        "error": {
            "message": "prompt must not be empty",
            "type": "invalid_request_error",
            "param": "prompt",
            "code": None,
        }
    }
    assert json.loads(post(server, "/v1/completions", {"prompt": "The", "max_tokens": 2}))
