"""A local Hugging Face Hub for tests: stdlib only, 127.0.0.1, an ephemeral port.

Serves folders as model repos at one commit, speaking the part of the Hub's HTTP API that
huggingface_hub 2.4 uses for ``snapshot_download``, ``hf_hub_download``, ``HfApi.list_repo_tree``
and ranged reads of ``hf_hub_url(...)`` (``GET /api/models/{repo}[/revision/{rev}]``,
``GET /api/models/{repo}/tree/{rev}[/{path}]``, ``POST /api/models/{repo}/paths-info/{rev}``,
``HEAD|GET /{repo}/resolve/{rev}/{path}`` with a single ``Range`` answered 206 and
``Content-Range``). Like the Hub, LFS files (``*.safetensors``) carry ``X-Linked-Etag`` (sha256)
and ``X-Linked-Size``, and with ``lfs_redirect`` a resolve of one answers 302 to a second listener
(another origin, as the Hub's CDN), so the client drops its token there. It never sends
``X-Xet-*`` headers, so the client stays on plain HTTP.

Every request is logged (method, path, range, status, body bytes actually sent, authorization),
and faults can be injected, one-shot by default (:class:`Fault`)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 64 * 1024
LFS_SUFFIXES = (".safetensors",)


@dataclass
class Entry:
    """One file of a repo: path in the repo, where it is, size, git blob sha1 (of the LFS pointer
    for LFS files) and the LFS sha256 (None for a plain git file)."""

    path: str
    abspath: str
    size: int
    blob_oid: str
    sha256: str | None

    def tree_json(self) -> dict:
        d = {"type": "file", "oid": self.blob_oid, "size": self.size, "path": self.path}
        if self.sha256:
            d["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 128}
        return d


@dataclass
class Repo:
    repo_id: str
    commit: str
    files: dict[str, Entry]

    def info_json(self) -> dict:
        return {"id": self.repo_id, "sha": self.commit, "private": False, "gated": False, "disabled": False,
                "siblings": [{"rfilename": p} for p in sorted(self.files)]}


def _sha(kind, data_iter, prefix: bytes = b"") -> str:
    h = kind(prefix)
    for chunk in data_iter:
        h.update(chunk)
    return h.hexdigest()


def _chunks(path: str):
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            yield chunk


def build_repo(repo_id: str, folder: str) -> Repo:
    """A repo of the files directly in ``folder``, at a commit derived from its content."""
    files = {}
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            continue
        size = os.path.getsize(p)
        if name.endswith(LFS_SUFFIXES):
            sha256 = _sha(hashlib.sha256, _chunks(p))
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
            files[name] = Entry(name, p, size, _sha(hashlib.sha1, [pointer], b"blob %d\0" % len(pointer)), sha256)
        else:
            files[name] = Entry(name, p, size, _sha(hashlib.sha1, _chunks(p), b"blob %d\0" % size), None)
    commit = _sha(hashlib.sha1, [f"{p}\0{e.blob_oid}\0".encode() for p, e in sorted(files.items())],
                  repo_id.encode())
    return Repo(repo_id, commit, files)


@dataclass
class Fault:
    """One injected failure, matching requests by ``method``, ``path`` (a substring of the URL
    path), ``ranged`` (only requests with / without a Range header) and ``match(method, path,
    range)``; it fires ``times`` times.

    ``kind``: "status" answers ``status`` (500); "drop" sends the headers and ``fraction`` of the
    body, then resets the connection (RST); "short" promises the whole body, sends ``fraction`` and
    closes (FIN); "truncate" answers a valid 206 for ``fraction`` of the range asked; "disconnect"
    closes without an answer; "stall" waits ``delay`` seconds first."""

    kind: str = "status"
    path: str | None = None
    method: str | None = None
    ranged: bool | None = None
    match: object = None
    times: int = 1
    status: int = 500
    fraction: float = 0.5
    delay: float = 2.0
    fired: int = 0

    def matches(self, method: str, path: str, rng: str | None) -> bool:
        return (self.fired < self.times and (self.method is None or self.method == method)
                and (self.path is None or self.path in path)
                and (self.ranged is None or self.ranged == (rng is not None))
                and (self.match is None or self.match(method, path, rng)))


@dataclass
class Record:
    """One request as the server saw it; ``sent``: body bytes written to the socket."""

    method: str
    path: str
    range: str | None
    authorization: str | None
    status: int | None = None
    sent: int = 0
    fault: str | None = None

    def span(self) -> tuple[int, int] | None:
        """The ``[start, stop)`` a ``bytes=a-b`` Range asked for."""
        if not self.range:
            return None
        a, _, b = self.range.partition("=")[2].partition("-")
        return int(a), int(b) + 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        with self.hub._busy():
            parts = urlsplit(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) if method == "POST" else b""
            self.rec = Record(method, unquote(parts.path), self.headers.get("Range"),
                              self.headers.get("Authorization"))
            self.hub._log(self.rec)
            self.fault = self.hub._take_fault(method, self.rec.path, self.rec.range)
            if self.fault is not None:
                self.rec.fault = self.fault.kind
                if self.fault.kind == "stall":
                    time.sleep(self.fault.delay)
                elif self.fault.kind == "disconnect":
                    self.close_connection = True
                    return
                elif self.fault.kind == "status":
                    return self._json(self.fault.status, {"error": f"injected {self.fault.status}"})
            try:
                self._route(method, parts.path, parse_qs(parts.query), body)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    # -- responses ----------------------------------------------------------------------------------
    def _headers(self, status: int, headers: dict) -> None:
        self.rec.status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.end_headers()

    def _json(self, status: int, obj, extra: dict | None = None) -> None:
        data = json.dumps(obj).encode()
        self._headers(status, {"Content-Type": "application/json", "Content-Length": len(data), **(extra or {})})
        if self.command != "HEAD":
            self.wfile.write(data)
            self.rec.sent += len(data)

    def _error(self, status: int, code: str, message: str, extra: dict | None = None) -> None:
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})})

    def _reset(self) -> None:
        """Close with a TCP reset instead of a FIN."""
        self.wfile.flush()
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.hub._resets.add(self.connection)
        self.close_connection = True

    # -- routes -------------------------------------------------------------------------------------
    def _route(self, method: str, raw: str, query: dict, body: bytes) -> None:
        segs = [unquote(s) for s in raw.strip("/").split("/")]
        if raw == "/api/agent-harnesses":
            return self._json(200, {"standardEnvVars": [], "harnesses": {}})
        if segs[0] == "cdn" and len(segs) == 2:
            entry = next((e for r in self.hub.repos.values() for e in r.files.values() if e.sha256 == segs[1]), None)
            return self._bytes(method, entry, {"ETag": f'"{segs[1]}"'}) if entry else self._error(404, "", "no object")
        if segs[0] == "api" and len(segs) >= 3 and segs[1] == "models":
            return self._api(method, segs[2:], query, body)
        if len(segs) >= 5 and segs[2] == "resolve" and method in ("GET", "HEAD"):
            return self._resolve(method, f"{segs[0]}/{segs[1]}", segs[3], "/".join(segs[4:]))
        return self._error(404, "", f"no route for {method} {raw}")

    def _repo(self, repo_id: str, rev: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(401, "RepoNotFound", "Repository not found")
        elif rev not in ("main", repo.commit):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        else:
            return repo
        return None

    def _api(self, method: str, segs: list[str], query: dict, body: bytes) -> None:
        repo_id, rest = "/".join(segs[:2]), segs[2:]
        if method == "GET" and (not rest or rest[0] == "revision"):
            if repo := self._repo(repo_id, rest[1] if rest else "main"):
                self._json(200, repo.info_json())
        elif method == "GET" and rest and rest[0] == "tree":  # top-level files only
            if repo := self._repo(repo_id, rest[1]):
                self._json(200, [e.tree_json() for _, e in sorted(repo.files.items())])
        elif method == "POST" and rest and rest[0] == "paths-info":
            if repo := self._repo(repo_id, rest[1]):
                paths = (json.loads(body).get("paths", []) if "json" in self.headers.get("Content-Type", "")
                         else parse_qs(body.decode()).get("paths", []))
                self._json(200, [repo.files[p].tree_json() for p in paths if p in repo.files])
        else:
            self._error(404, "", f"no api route {segs}")

    def _resolve(self, method: str, repo_id: str, rev: str, path: str) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        entry = repo.files.get(path)
        if entry is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": repo.commit})
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{entry.sha256 or entry.blob_oid}"'}
        if entry.sha256:
            headers.update({"X-Linked-Etag": f'"{entry.sha256}"', "X-Linked-Size": entry.size})
            if self.hub.lfs_redirect:
                headers.update({"Location": f"{self.hub.cdn_url}/cdn/{entry.sha256}", "Content-Length": 0})
                return self._headers(302, headers)
        self._bytes(method, entry, headers)

    def _bytes(self, method: str, entry: Entry, headers: dict) -> None:
        start, end, status = 0, entry.size - 1, 200
        if rng := self.headers.get("Range"):
            a, _, b = rng.partition("=")[2].partition("-")
            start, end, status = int(a), min(int(b) if b else entry.size - 1, entry.size - 1), 206
            if start > end:
                return self._error(416, "", f"range {rng} not satisfiable", {"Content-Range": f"bytes */{entry.size}"})
        fault = self.fault
        if fault is not None and fault.kind == "truncate":
            end, status = start + max(1, int((end - start + 1) * fault.fraction)) - 1, 206
        n = end - start + 1
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream", "Content-Length": n}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        self._headers(status, headers)
        if method == "HEAD":
            return
        send = int(n * fault.fraction) if fault is not None and fault.kind in ("drop", "short") else n
        with open(entry.abspath, "rb") as f:
            f.seek(start)
            while send > 0 and (chunk := f.read(min(CHUNK, send))):
                self.wfile.write(chunk)
                self.rec.sent += len(chunk)
                send -= len(chunk)
        if fault is not None and fault.kind == "drop":
            self._reset()
        elif fault is not None and fault.kind == "short":
            self.wfile.flush()
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, hub: HubServer):
        self.hub = hub
        super().__init__(("127.0.0.1", 0), type("Handler", (_Handler,), {"hub": hub}))

    def shutdown_request(self, request):
        if request in self.hub._resets:  # close() alone, with SO_LINGER 0: a RST, not a FIN
            self.hub._resets.discard(request)
            self.close_request(request)
        else:
            super().shutdown_request(request)


class HubServer:
    """The local Hub (a context manager): ``url`` for HF_ENDPOINT, ``add_repo``, ``add_fault``, and
    the request log (``requests``, ``clear_log``), complete once no request is in flight."""

    def __init__(self, lfs_redirect: bool = True):
        self.repos: dict[str, Repo] = {}
        self.lfs_redirect = lfs_redirect
        self.log: list[Record] = []
        self.faults: list[Fault] = []
        self._resets: set = set()
        self._lock = threading.Condition()
        self._inflight = 0
        self._servers = [_Server(self), _Server(self)]
        self.url, self.cdn_url = (f"http://127.0.0.1:{s.server_address[1]}" for s in self._servers)

    def __enter__(self) -> HubServer:
        for s in self._servers:
            threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def add_repo(self, repo_id: str, folder) -> Repo:
        self.repos[repo_id] = repo = build_repo(repo_id, str(folder))
        return repo

    def add_fault(self, kind: str = "status", **kw) -> Fault:
        with self._lock:
            self.faults.append(f := Fault(kind, **kw))
        return f

    def clear(self) -> None:
        """Forget the faults and the log."""
        with self._lock:
            self.faults.clear()
            self.log.clear()

    def requests(self) -> list[Record]:
        """Every request so far, once none is being answered (the client can have the last byte
        before the server's thread has counted it)."""
        with self._lock:
            self._lock.wait_for(lambda: self._inflight == 0, timeout=10)
            return list(self.log)

    @contextmanager
    def _busy(self):
        with self._lock:
            self._inflight += 1
        try:
            yield
        finally:
            with self._lock:
                self._inflight -= 1
                self._lock.notify_all()

    def _log(self, rec: Record) -> None:
        with self._lock:
            self.log.append(rec)

    def _take_fault(self, method: str, path: str, rng: str | None) -> Fault | None:
        with self._lock:
            for f in self.faults:
                if f.matches(method, path, rng):
                    f.fired += 1
                    return f
        return None


def patch_endpoint(url: str, monkeypatch) -> None:
    """Point the imported huggingface_hub at ``url``: HF_ENDPOINT is read at import
    (``constants.py:69-70``) and ``hf_hub_url`` formats ``HUGGINGFACE_CO_URL_TEMPLATE``
    (``file_download.py:289``), so both constants are patched; telemetry's registry fetch is off."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
