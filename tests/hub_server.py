"""A fake Hugging Face Hub on 127.0.0.1: the endpoints `huggingface_hub.snapshot_download` uses.

    GET  /api/models/{org}/{name}[/revision/{rev}]   repo info (sha, siblings)
    GET  /api/models/{org}/{name}/tree/{rev}          file listing
    HEAD /{org}/{name}/resolve/{rev}/{path}           metadata (X-Repo-Commit, ETag, size)
    GET  /{org}/{name}/resolve/{rev}/{path}           the bytes

    POST /api/repos/create                            create a repo (uploads)
    POST /api/validate-yaml                           a README.md's YAML front matter
    POST /api/models/{org}/{name}/preupload/{rev}     every file a plain git blob
    POST /api/models/{org}/{name}/commit/{rev}        NDJSON commit: files written to the repo

Repos are local directories, served read-only; repos created here live under `upload_root`.
`gated` repos answer downloads with the Hub's
401 GatedRepo, unknown repos 404 RepoNotFound, unknown revisions 404 RevisionNotFound.
Files named in `truncate` are cut off halfway (the connection drops), like a network failure.
`requests` records every (method, path) for assertions.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(
        self,
        repos: dict[str, Path],
        gated: set[str] = frozenset(),
        upload_root: Path | None = None,
    ):
        self.repos = {k: Path(v) for k, v in repos.items()}
        self.upload_root = upload_root
        self.commits: list[dict] = []  # each commit's header and file paths
        self.validated: list[str] = []  # README front matters checked (/api/validate-yaml)
        self.gated = set(gated)
        self.truncate: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}

    def sha(self, repo: str) -> str:
        h = hashlib.sha1(repo.encode())
        for name, p in self.files(repo).items():
            h.update(name.encode() + hashlib.sha1(p.read_bytes()).digest())
        return h.hexdigest()

    def downloaded(self) -> set[str]:
        """Paths (repo-relative) fetched with GET /resolve/."""
        return {p.split("/", 5)[5] for m, p in self.requests if m == "GET" and "/resolve/" in p}


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def do_POST(self) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append(("POST", path))
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            parts = path.strip("/").split("/")
            if parts == ["api", "repos", "create"]:
                return self._create(json.loads(body))
            if parts == ["api", "validate-yaml"]:  # a README.md's front matter, as the Hub does
                return self._validate_yaml(json.loads(body)["content"])
            repo = "/".join(parts[2:4])
            if parts[:2] != ["api", "models"] or repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            if parts[4:5] == ["preupload"]:
                files = json.loads(body)["files"]
                regular = {"uploadMode": "regular", "shouldIgnore": False}
                return self._json({"files": [{"path": f["path"], **regular} for f in files]})
            if parts[4:5] == ["commit"]:
                return self._commit(repo, body)
            return self._error(404, "EntryNotFound")

        def _validate_yaml(self, content: str) -> None:
            import yaml

            front = content.split("---\n")[1] if content.startswith("---\n") else ""
            try:
                meta = yaml.safe_load(front) or {}
                errors = [] if isinstance(meta, dict) else [{"message": "not a mapping"}]
            except yaml.YAMLError as e:
                errors = [{"message": str(e)}]
            hub.validated.append(front)
            if errors:
                raw = json.dumps({"errors": errors}).encode()
                self.send_response(400)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                return self.wfile.write(raw)
            self._json({"warnings": []})

        def _create(self, request: dict) -> None:
            repo = f"{request['organization']}/{request['name']}"
            if hub.upload_root is None:
                return self._error(403, "Forbidden")
            if repo not in hub.repos:
                hub.repos[repo] = hub.upload_root / repo
                hub.repos[repo].mkdir(parents=True)
            self._json({"url": f"{hub.url}/{repo}", "name": repo})

        def _commit(self, repo: str, body: bytes) -> None:
            import base64

            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            written = []
            for x in lines:
                if x["key"] == "file":
                    target = hub.repos[repo] / x["value"]["path"]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(base64.b64decode(x["value"]["content"]))
                    written.append(x["value"]["path"])
            hub.commits.append({"repo": repo, "header": header, "files": written})
            sha = hub.sha(repo)
            self._json({"commitUrl": f"{hub.url}/{repo}/commit/{sha}", "commitOid": sha})

        def _error(self, status: int, code: str) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, data: object) -> None:
            raw = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path))
            parts = path.strip("/").split("/")
            api = parts[:2] == ["api", "models"]
            if api:
                parts = parts[2:]
            repo = "/".join(parts[:2])
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            rest, sha = parts[2:], hub.sha(repo)
            revision = rest[1] if len(rest) > 1 else "main"
            if revision not in ("main", sha):
                return self._error(404, "RevisionNotFound")
            files = hub.files(repo)
            if api and (not rest or rest[0] == "revision"):
                siblings = [{"rfilename": n} for n in files]
                return self._json({"id": repo, "sha": sha, "siblings": siblings, "private": False})
            if api and rest[0] == "tree":
                return self._json(
                    [
                        {"type": "file", "path": n, "size": p.stat().st_size, "oid": _oid(p)}
                        for n, p in files.items()
                    ]
                )
            if api or rest[:1] != ["resolve"]:
                return self._error(404, "EntryNotFound")
            if repo in hub.gated:
                return self._error(401, "GatedRepo")
            name = "/".join(rest[2:])
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name].read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", sha)
            self.send_header("ETag", f'"{_oid(files[name])}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                # A truncated file: half the promised bytes, then the connection closes.
                self.wfile.write(data[: len(data) // 2] if name in hub.truncate else data)

    return Handler


def _oid(p: Path) -> str:
    return hashlib.sha1(p.read_bytes()).hexdigest()
