"""`python -m bitnest_mlx.server` as a child process on a free 127.0.0.1 port, for tests."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: list[str], log_file: Path, env: dict | None = None) -> Iterator[str]:
    """Start the server with `args` (--model ...), wait until /v1/models answers, yield its URL."""
    port = free_port()
    with open(log_file, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bitnest_mlx.server", *args]
            + ["--host", "127.0.0.1", "--port", str(port)],
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                if proc.poll() is not None:
                    pytest.fail(log_file.read_text()[-2000:])
                try:
                    urllib.request.urlopen(url + "/v1/models", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def post(url: str, route: str, body: dict) -> bytes:
    req = urllib.request.Request(
        url + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()
