"""`python -m bitnest_mlx.server --mode speculative` with several clients: concurrent requests are
decoded together in target mode (each stream's tokens those of the request alone), a lone request
speculates and hands over to the batch when others arrive, and an abandoned non-streamed request
stops at its next token."""

from __future__ import annotations

import json
import socket
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import START_TIMEOUT, request, running_server, wait_for  # noqa: E402

from bitnest_mlx.runtime.demo import demo_path  # noqa: E402

CHAT = "/v1/chat/completions"
PROMPTS = ("The river", "The mill has not turned", "Once upon", "A long time ago in the valley")


def chat(prompt: str, max_tokens: int = 24, **kw) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        **kw,
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("batching") / "server.log"
    with running_server(["--model", str(demo_path()), "--mode", "speculative"], log) as url:
        yield url, log


def token_ids(url: str, body: dict) -> tuple[list[int], str]:
    status, raw = request(url, CHAT, {**body, "logprobs": True})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    return [t["id"] for t in choice["logprobs"]["content"]], choice["message"]["content"]


def concurrently(n: int, work) -> list:
    start, results = threading.Barrier(n), [None] * n

    def client(i: int) -> None:
        start.wait(timeout=30)
        try:
            results[i] = work(i)
        except Exception as e:  # reported by the caller with the client's number
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=START_TIMEOUT)
    return results


def in_flight_counts(log: Path) -> list[int]:
    lines = [ln for ln in log.read_text().splitlines() if "request: batched target, " in ln]
    return [int(ln.split("batched target, ")[1].split()[0]) for ln in lines]


def test_concurrent_streams_are_batched_and_each_equals_the_request_alone(server):
    url, log = server
    alone = {p: token_ids(url, chat(p)) for p in PROMPTS}
    before = len(in_flight_counts(log))
    got = concurrently(8, lambda i: token_ids(url, chat(PROMPTS[i % 4])))
    for i, g in enumerate(got):
        assert g == alone[PROMPTS[i % 4]], f"client {i}: {g!r}"
    assert max(in_flight_counts(log)[before:], default=0) >= 2, "no request joined a batch"


def read_events(response, until: int | None = None):
    """The `data:` payloads of an SSE response, up to `until` of them or [DONE]."""
    seen = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            seen.append(line[len("data: ") :])
            if seen[-1] == "[DONE]" or (until is not None and len(seen) >= until):
                break
    return seen


def streamed_text(events: list[str]) -> str:
    chunks = [json.loads(e)["choices"] for e in events if e != "[DONE]"]
    return "".join(c[0]["delta"].get("content") or "" for c in chunks if c)


def test_a_lone_request_speculates_then_hands_over_to_the_batch_with_the_same_text(server):
    url, log = server
    long = chat(PROMPTS[0], max_tokens=300)
    want = json.loads(request(url, CHAT, long)[1])["choices"][0]["message"]["content"]
    before = log.read_text().count("the rest joins the batch")
    req = urllib.request.Request(
        url + CHAT,
        data=json.dumps({**long, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        first = read_events(r, until=1)  # it is speculating, alone
        others = concurrently(3, lambda i: token_ids(url, chat(PROMPTS[i + 1])))
        events = first + read_events(r)
    assert events[-1] == "[DONE]"
    assert streamed_text(events) == want
    assert log.read_text().count("the rest joins the batch") == before + 1
    assert not any(isinstance(o, Exception) for o in others), others


def test_an_abandoned_non_streamed_request_stops_at_its_next_token(server):
    url, log = server
    text = log.read_text
    picked, gone = text().count("request: "), text().count("went away")
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(chat(PROMPTS[1], max_tokens=1500)).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        wait_for(lambda: text().count("request: ") > picked, "the request being decoded")
    # The handler sees the hang-up before it takes the next token, and stops the generation.
    wait_for(lambda: text().count("went away") > gone, "the abandoned request's log line")
    picked = text().count("request: ")
    assert token_ids(url, chat(PROMPTS[2], max_tokens=4))
    # Alone when picked: the 1500-token generation had ended (else it would be in flight).
    decided = [ln for ln in text().splitlines() if "request: " in ln][picked:]
    assert decided and "alone: speculative" in decided[0], decided
