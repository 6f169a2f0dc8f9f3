"""`python -m bitnest_mlx.server` as a child process on a free 127.0.0.1 port, for tests, and the
small HTTP clients the server tests share (every call bounded in time)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

START_TIMEOUT = 120  # seconds for the model to load and the port to answer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args: list[str], port: int) -> list[str]:
    return [sys.executable, "-m", "bitnest_mlx.server", *args, "--host", "127.0.0.1"] + [
        "--port",
        str(port),
    ]


READY = "Starting httpd"  # the server's last line before it serves (its port is bound by then)


@contextmanager
def running_server(args: list[str], log_file: Path, env: dict | None = None) -> Iterator[str]:
    """Start the server with `args` (--model ...), wait for its ready line, yield its URL. Its
    output goes to `log_file` line by line as it comes."""
    port = free_port()
    proc = subprocess.Popen(
        server_command(args, port),
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = threading.Event()

    def tee() -> None:
        with open(log_file, "w") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if READY in line:
                    ready.set()
        ready.set()  # the server ended: nothing more to wait for

    reader = threading.Thread(target=tee, daemon=True)
    reader.start()
    try:
        if not ready.wait(START_TIMEOUT) or proc.poll() is not None:
            pytest.fail("server did not start:\n" + log_file.read_text()[-2000:])
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)


def wait_for(done: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    """Poll `done` until it holds (an event the test cannot be told of directly, e.g. a log
    line); failing after a generous `timeout` says what never happened."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {timeout} s")
        time.sleep(0.05)


def failed_start(args: list[str], env: dict | None = None) -> tuple[int, str, bool]:
    """Run a server that is expected to refuse to start: (exit status, stderr, whether anything
    ever accepted a connection on its port while it ran)."""
    port = free_port()
    proc = subprocess.Popen(
        server_command(args, port),
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    listened = threading.Event()

    def probe() -> None:
        while proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                listened.set()
                return
            except OSError:
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        _, err = proc.communicate(timeout=START_TIMEOUT)
    finally:
        proc.kill()
        prober.join(timeout=5)
    return proc.returncode, err, listened.is_set()


def post(url: str, route: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def request(url: str, route: str, body: dict | bytes | None = None) -> tuple[int, bytes]:
    """(status, body) of a GET (no body) or a POST (a dict as JSON, bytes as they are); an HTTP
    error status is returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read()


def stream_text(raw: bytes) -> str:
    """The text of a streamed chat completion (its `data:` events up to [DONE])."""
    events = [ln[len("data: ") :] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-500:]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1] if json.loads(e)["choices"]]
    return "".join(c["delta"].get("content") or "" for c in chunks)


def disconnect_mid_stream(url: str, route: str, body: dict, events: int = 1) -> None:
    """POST a streaming request, read `events` data events, then close the connection."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(
            f"POST {route} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        seen = b""
        while seen.count(b"data: ") < events:
            chunk = s.recv(65536)
            assert chunk, seen[-500:]
            seen += chunk
