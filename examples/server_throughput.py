"""Aggregate throughput of bitnest-server for 1, 2, 4 and 8 concurrent streams, batched against
one at a time, in one run (one server per model).

    python examples/server_throughput.py --model demo [--model PKG ...] [--tokens 32]
        [--streams 1 2 4 8] [--mode speculative|target] [--markdown]

For each model a server is started (`python -m bitnest_mlx.server`, its default mode by device
unless --mode is given). For each stream count N, N streamed chat requests of `--tokens` tokens
(temperature 0, N distinct prompts, the same N both ways, so the same text) are sent:

* one at a time: each after the previous one ended (a lone request: speculative when the server
  speculates);
* together: all at once (the server batches them in target mode).

Aggregate tokens/s = tokens received (each stream's usage) / wall time from the first request
sent to the last stream's end; `last first byte` is when the last stream's first token came.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, mode: str | None) -> tuple[subprocess.Popen, str]:
    """A server for `model` on a free port, once it prints that it serves."""
    port = free_port()
    cmd = [sys.executable, "-m", "bitnest_mlx.server", "--model", model, "--port", str(port)]
    cmd += ["--mode", mode] if mode else []
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=os.environ)
    for line in proc.stderr:
        if "bitnest-server: model=" in line:
            print(line.split(" - ")[-1].strip(), file=sys.stderr)
        if "Starting httpd" in line:
            break
    else:
        raise SystemExit(f"error: the server for {model} did not start")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
    return proc, f"http://127.0.0.1:{port}"


def stream(url: str, prompt: str, tokens: int) -> tuple[int, float]:
    """(tokens received, seconds from the call to the first content) of one streamed chat."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start, first, used = time.perf_counter(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if first is None and event["choices"]:
                first = time.perf_counter() - start
            if event.get("usage"):
                used = event["usage"]["completion_tokens"]
    return used, first or 0.0


def measure(url: str, n: int, tokens: int, together: bool, tag: str) -> dict:
    """N streams, together or one after another: aggregate tokens/s, wall, last first byte."""
    prompts = [f"Story {tag}-{i}: the river by the mill" for i in range(n)]  # the same per N
    results: list = [None] * n
    start = time.perf_counter()
    if together:

        def client(i: int) -> None:
            sent = time.perf_counter() - start
            used, first = stream(url, prompts[i], tokens)
            results[i] = (used, sent + first)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(n):
            sent = time.perf_counter() - start
            used, first = stream(url, prompts[i], tokens)
            results[i] = (used, sent + first)
    wall = time.perf_counter() - start
    total = sum(used for used, _ in results)
    return {"tok_s": total / wall, "wall": wall, "last_first": max(f for _, f in results)}


def run_model(model: str, args: argparse.Namespace) -> list[tuple]:
    proc, url = start_server(model, args.mode)
    rows = []
    try:
        measure(url, 2, args.tokens, True, "warmup")  # first-use compilation, both paths
        measure(url, 1, args.tokens, False, "warmup")
        for n in args.streams:
            alone = measure(url, n, args.tokens, False, str(n))
            batch = measure(url, n, args.tokens, True, str(n))
            rows.append((model, n, alone, batch))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="package, Hub id or demo")
    p.add_argument("--tokens", type=int, default=32, help="max_tokens of each stream")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--mode", choices=("speculative", "target"), help="the server's --mode")
    args = p.parse_args(argv)
    head = (
        "| model | streams | one at a time tok/s | together tok/s | speed-up "
        "| wall (one at a time / together) s | last first byte (together) s |"
    )
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for model in args.model:
        for name, n, a, b in run_model(model, args):
            print(
                f"| {name} | {n} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | "
                f"{b['tok_s'] / a['tok_s']:.2f}x | {a['wall']:.2f} / {b['wall']:.2f} | "
                f"{b['last_first']:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
