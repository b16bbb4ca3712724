"""A fake Hugging Face hub on 127.0.0.1, enough of it for huggingface_hub's snapshot_download.

It serves plain (non-LFS, non-xet) files from a dict
`{repo_id: {revision: {filename: bytes}}}`, where a revision is a branch/tag name or a 40-hex
commit; a branch gets a commit sha derived from its content. The endpoints are the ones
huggingface_hub 2.x calls:

- `GET /api/models/{repo}/revision/{rev}`: repo info with `sha` and `siblings`;
- `GET /api/models/{repo}/tree/{rev}`: the (recursive) file listing;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit`, `ETag` and sizes.

Errors carry the `X-Error-Code` header (RepoNotFound, RevisionNotFound, EntryNotFound) that
huggingface_hub turns into its typed exceptions. Every request is recorded in `requests`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

Repos = dict[str, dict[str, dict[str, bytes]]]

_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def git_blob_sha(data: bytes) -> str:
    """Answers the git blob id of `data` (what the hub sends as the ETag of a non-LFS file)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def commit_sha(repo_id: str, revision: str, files: dict[str, bytes]) -> str:
    """Answers the commit sha of `revision`: itself when it is one, else a hash of the content."""
    if _COMMIT.match(revision):
        return revision
    digest = hashlib.sha1(f"{repo_id}@{revision}".encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    return digest.hexdigest()


class FakeHub:
    """The fake hub's content and request log; `url` is its endpoint once started."""

    def __init__(self, repos: Repos):
        # repo -> revision name or commit -> (commit, files)
        self.revisions: dict[str, dict[str, tuple[str, dict[str, bytes]]]] = {}
        for repo_id, revisions in repos.items():
            table = self.revisions.setdefault(repo_id, {})
            for revision, files in revisions.items():
                commit = commit_sha(repo_id, revision, files)
                table[revision] = table[commit] = (commit, dict(files))
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def commit(self, repo_id: str, revision: str = "main") -> str:
        """Answers the commit sha the hub reports for `revision` of `repo_id`."""
        return self.revisions[repo_id][revision][0]

    def fetched(self) -> list[str]:
        """Answers the file names downloaded with GET so far."""
        return [
            path.rsplit("/", 1)[-1]
            for method, path in self.requests
            if method == "GET" and "/resolve/" in path
        ]

    def start(self) -> FakeHub:
        """Starts serving on a free port of 127.0.0.1."""
        hub = self

        class Handler(_Handler):
            fake = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving and frees the port, so later requests fail to connect."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


@contextmanager
def serve(repos: Repos):
    """Runs a FakeHub serving `repos` for the duration of the block."""
    hub = FakeHub(repos).start()
    try:
        yield hub
    finally:
        hub.stop()


class _Handler(BaseHTTPRequestHandler):
    fake: FakeHub

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._route(send_body=True)

    def do_HEAD(self) -> None:
        self._route(send_body=False)

    def _route(self, *, send_body: bool) -> None:
        path = urlsplit(self.path).path
        self.fake.requests.append((self.command, path))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in {"revision", "tree"}:
            repo_id, kind, revision = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            self._api(repo_id, kind, revision, send_body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, filename = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            self._resolve(repo_id, revision, filename, send_body)
        else:
            self._error(404, "RepoNotFound", send_body)

    def _lookup(self, repo_id: str, revision: str, send_body: bool):
        """Answers (commit, files) of `revision`, or sends the hub's error and answers None."""
        table = self.fake.revisions.get(repo_id)
        if table is None:
            self._error(404, "RepoNotFound", send_body)
            return None
        if revision not in table:
            self._error(404, "RevisionNotFound", send_body)
            return None
        return table[revision]

    def _api(self, repo_id: str, kind: str, revision: str, send_body: bool) -> None:
        found = self._lookup(repo_id, revision, send_body)
        if found is None:
            return
        commit, files = found
        if kind == "revision":
            body = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": n} for n in sorted(files)]}
        else:
            body = [
                {"type": "file", "path": n, "size": len(files[n]), "oid": git_blob_sha(files[n])}
                for n in sorted(files)
            ]
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)

    def _resolve(self, repo_id: str, revision: str, filename: str, send_body: bool) -> None:
        found = self._lookup(repo_id, revision, send_body)
        if found is None:
            return
        commit, files = found
        if filename not in files:
            self._error(404, "EntryNotFound", send_body, {"X-Repo-Commit": commit})
            return
        data = files[filename]
        headers = {
            "Content-Type": "application/octet-stream",
            "X-Repo-Commit": commit,
            "ETag": f'"{git_blob_sha(data)}"',
        }
        self._send(200, data, headers, send_body)

    def _error(self, status: int, code: str, send_body: bool, extra: dict | None = None) -> None:
        body = json.dumps({"error": code}).encode()
        headers = {"Content-Type": "application/json", "X-Error-Code": code, **(extra or {})}
        self._send(status, body, headers, send_body)

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)
