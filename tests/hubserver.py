"""A local stand-in for the Hugging Face hub's file API, for tests: point HF_ENDPOINT at `url`.

What huggingface_hub 2.4 (and so `dsv4 pull`) asks of the hub, and nothing more:

  GET  /api/models/ORG/NAME[/revision/REV]  repo info: `sha` and, with ?blobs=True, each
                                            sibling's size, blobId and lfs {sha256, size}
  GET  /api/models/ORG/NAME/tree/REV        the recursive listing `snapshot_download` reads
  HEAD|GET /ORG/NAME/resolve/REV/PATH       a small file: 200 with ETag (its git blob id),
                                            X-Repo-Commit, Content-Length; an LFS file
                                            (*.safetensors, *.bin): 302 to the "CDN" with
                                            X-Linked-Etag (its sha256), X-Linked-Size,
                                            X-Repo-Commit, and the Xet headers the hub sends
                                            (X-Xet-Hash, a Link to a token route that is not
                                            served here), so a client that tried Xet would fail
  GET  /cdn/SHA256                          the bytes, with Range (206)

The CDN is this same server reached as `localhost` rather than 127.0.0.1: another origin, as
the hub's CDN is, so a client must not send it the token. Errors carry the hub's
X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound). A repo made `private` answers
only requests with `Authorization: Bearer TOKEN` (else 401 RepoNotFound, as the hub does).

Faults: `drop_at[path] = n` ends every transfer of that file at its byte n, closing the
connection mid-body (Content-Length promised more); `corrupt.add(path)` serves bytes other
than those its advertised hash is of. Records: `served[path]` (body bytes sent, by file),
`requests` (method, path, headers with lower-case names).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
CHUNK = 1 << 16


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> path -> bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit
    token: Optional[str] = None  # private: only this token reads it


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.drop_at: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.served: Counter = Counter()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = _Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn = f"http://localhost:{self.port}/cdn"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, repo_id: str, files: dict[str, bytes], ref: str = "main", token: Optional[str] = None) -> str:
        """Commit `files` to `repo_id` under `ref` (a branch or tag); returns the commit."""
        listing = json.dumps({p: hashlib.sha256(b).hexdigest() for p, b in sorted(files.items())})
        commit = hashlib.sha1(f"{repo_id}\n{listing}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo())
        repo.commits[commit] = dict(files)
        repo.refs[ref] = commit
        repo.token = token if token is not None else repo.token
        return commit

    def add_dir(self, repo_id: str, path: Path, ref: str = "main", extra: Optional[dict[str, bytes]] = None,
                **kw: Any) -> str:
        files = {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}
        files.update(extra or {})
        return self.add(repo_id, files, ref, **kw)

    def reset_records(self) -> None:
        with self.lock:
            self.served.clear()
            self.requests.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------ lookups
    def find_blob(self, sha: str) -> Optional[tuple[str, bytes]]:
        for repo in self.repos.values():
            for files in repo.commits.values():
                for path, data in files.items():
                    if hashlib.sha256(data).hexdigest() == sha:
                        return path, data
        return None


def sibling(path: str, data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
    if path.endswith(LFS_SUFFIXES):
        out["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
    return out


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that hung up mid-body (a test's Ctrl-C, a refused hash): not news


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: FakeHub

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    # ------------------------------------------------------------------ helpers
    def _send(self, code: int, body: bytes = b"", headers: Optional[dict[str, str]] = None,
              error: Optional[str] = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if error:
            self.send_header("X-Error-Code", error)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: Any) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"})

    def _repo(self, repo_id: str) -> Optional[Repo]:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._send(404, b'{"error":"Repository not found"}', error="RepoNotFound")
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._send(401, b'{"error":"Invalid username or password."}', error="RepoNotFound")
            return None
        return repo

    def _commit(self, repo: Repo, rev: str) -> Optional[str]:
        commit = rev if rev in repo.commits else repo.refs.get(rev)
        if commit is None:
            self._send(404, b'{"error":"Invalid rev id"}', error="RevisionNotFound")
        return commit

    # ------------------------------------------------------------------ routes
    def do_HEAD(self) -> None:
        self._route()

    def do_GET(self) -> None:
        self._route()

    def _route(self) -> None:
        url = urlparse(self.path)
        with self.hub.lock:
            self.hub.requests.append((self.command, url.path, {k.lower(): v for k, v in self.headers.items()}))
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+))?", url.path)
        if m and self.command == "GET":
            return self._api(m.group(1), m.group(2), unquote(m.group(3) or "main"))
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", url.path)
        if m:
            return self._resolve(m.group(1), unquote(m.group(2)), unquote(m.group(3)))
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", url.path)
        if m and self.command == "GET":
            found = self.hub.find_blob(m.group(1))
            if found is None:
                return self._send(404)
            return self._bytes(*found)
        self._send(404, b"not found")

    def _api(self, repo_id: str, kind: Optional[str], rev: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, rev)
        if commit is None:
            return
        files = repo.commits[commit]
        if kind == "tree":
            tree = []
            for path, data in sorted(files.items()):
                entry: dict[str, Any] = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
                if path.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                tree.append(entry)
            return self._json(tree)
        self._json({"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.token is not None,
                    "siblings": [sibling(p, d) for p, d in sorted(files.items())]})

    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        commit = self._commit(repo, rev)
        if commit is None:
            return
        data = repo.commits[commit].get(path)
        if data is None:
            return self._send(404, b'{"error":"Entry not found"}', {"X-Repo-Commit": commit}, error="EntryNotFound")
        if path.endswith(LFS_SUFFIXES):
            sha = hashlib.sha256(data).hexdigest()
            return self._send(302, b"", {
                "Location": f"{self.hub.cdn}/{sha}", "X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"',
                "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(len(data)),
                "X-Xet-Hash": hashlib.sha256(b"xet" + data).hexdigest(),
                "Link": f'<{self.hub.url}/api/models/{repo_id}/xet-read-token/{commit}>; rel="xet-auth"'})
        self._bytes(path, data, {"X-Repo-Commit": commit, "ETag": f'"{git_blob_id(data)}"'})

    def _bytes(self, path: str, data: bytes, headers: Optional[dict[str, str]] = None) -> None:
        """The file's bytes (from a Range's start), with the faults set for it."""
        if path in self.hub.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        start, code = 0, 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        extra = dict(headers or {}, **{"Accept-Ranges": "bytes"})
        if m:
            start = int(m.group(1))
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
            code = 206
            extra["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        body = data[start:]
        self.send_response(code)
        for k, v in extra.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command == "HEAD":
            return
        stop = self.hub.drop_at.get(path)
        end = len(data) if stop is None else max(start, min(stop, len(data)))
        pos = start
        while pos < end:
            n = min(CHUNK, end - pos)
            self.wfile.write(data[pos:pos + n])
            pos += n
            with self.hub.lock:
                self.hub.served[path] += n
        if end < len(data):  # a dropped connection: the promised body ends here
            self.wfile.flush()
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
