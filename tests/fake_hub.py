"""A small Hugging Face Hub on a local port: the HTTP endpoints `HfApi` uses to publish a dataset and read it
back, with git-like state (commits with parents, branch `main`, tags) and failures injected per step.

Point a real client at it with `HfApi(endpoint=hub.url, token=...)`. Every file is committed as a regular
(base64) file: the preupload answer never asks for LFS, so no LFS or Xet transfer is involved.

Steps (for `fail` and `requests`): create_repo, info, refs, commits, tree, validate, preupload, commit, tag,
resolve. A failure is an HTTP status (answered with a JSON error), "drop" (the connection is closed without an
answer) or "lost" (the step is done, then the connection is closed: the answer is lost). Note that huggingface_hub
retries 5xx and dropped connections with back-off (about 23 s) for commits, tree, preupload and resolve: fail
those with a 4xx in fast tests.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

REPO = r"(?P<repo>[^/]+/[^/]+)"
ROUTES = [
    ("create_repo", "POST", re.compile(r"^/api/repos/create$")),
    ("validate", "POST", re.compile(r"^/api/validate-yaml$")),
    ("info", "GET", re.compile(rf"^/api/datasets/{REPO}(?:/revision/(?P<rev>[^/]+))?$")),
    ("refs", "GET", re.compile(rf"^/api/datasets/{REPO}/refs$")),
    ("commits", "GET", re.compile(rf"^/api/datasets/{REPO}/commits/(?P<rev>[^/]+)$")),
    ("tree", "GET", re.compile(rf"^/api/datasets/{REPO}/tree/(?P<rev>[^/]+)$")),
    ("preupload", "POST", re.compile(rf"^/api/datasets/{REPO}/preupload/(?P<rev>[^/]+)$")),
    ("commit", "POST", re.compile(rf"^/api/datasets/{REPO}/commit/(?P<rev>[^/]+)$")),
    ("tag", "POST", re.compile(rf"^/api/datasets/{REPO}/tag/(?P<rev>[^/]+)$")),
    ("resolve", "GET", re.compile(rf"^/datasets/{REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra: str) -> None:
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


@dataclass
class Commit:
    id: str
    parent: str | None
    title: str
    files: dict[str, bytes]
    date: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"))


@dataclass
class Repo:
    commits: dict[str, Commit]
    main: str
    tags: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit:
        sha = self.main if revision == "main" else self.tags.get(revision, revision)
        if sha not in self.commits:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return self.commits[sha]

    def history(self) -> list[Commit]:
        commits, sha = [], self.main
        while sha is not None:
            commits.append(self.commits[sha])
            sha = self.commits[sha].parent
        return commits


def blob_id(content: bytes) -> str:
    """The git blob id: what the Hub reports as a regular file's oid and preupload compares with."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


class FakeHub:
    def __init__(self, repos: dict[str, Repo] | None = None) -> None:
        self.repos: dict[str, Repo] = copy.deepcopy(repos or {})
        self.failures: dict[str, int | str] = {}
        self.requests: list[tuple[str, str]] = []  # (step, path) of every request, in order
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fail(self, step: str, how: int | str | None) -> None:
        """Make every request of `step` fail (None heals it)."""
        assert step in {name for name, _, _ in ROUTES}, step
        if how is None:
            self.failures.pop(step, None)
        else:
            self.failures[step] = how

    def steps(self) -> list[str]:
        return [step for step, _ in self.requests]

    # ------------------------------------------------------------------------------------------- endpoints

    def _repo(self, name: str) -> Repo:
        if name not in self.repos:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return self.repos[name]

    def _new_commit(self, repo: Repo | None, parent: str | None, title: str, files: dict[str, bytes]) -> Commit:
        seed = f"{len(repo.commits) if repo else 0} {parent} {title} {sorted(files)}".encode()
        return Commit(hashlib.sha1(seed).hexdigest(), parent, title, files)

    def create_repo(self, body: dict, match: dict, url: str) -> dict:
        name = f"{body['organization']}/{body['name']}"
        if name in self.repos:
            # The Hub's answer carries the url, which create_repo(exist_ok=True) returns.
            raise HubError(409, "You already created this dataset repo", url=f"{url}/datasets/{name}")
        first = self._new_commit(None, None, "initial commit", {".gitattributes": b"*.parquet filter=lfs\n"})
        self.repos[name] = Repo({first.id: first}, first.id)
        return {"url": f"{url}/datasets/{name}", "name": name}

    def validate(self, body: dict, match: dict, url: str) -> dict:
        return {"errors": [], "warnings": []}

    def info(self, body: dict, match: dict, url: str) -> dict:
        repo = self._repo(match["repo"])
        return {"id": match["repo"], "sha": repo.resolve(match["rev"] or "main").id, "private": False}

    def refs(self, body: dict, match: dict, url: str) -> dict:
        repo = self._repo(match["repo"])
        tags = [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": sha} for n, sha in sorted(repo.tags.items())]
        main = {"name": "main", "ref": "refs/heads/main", "targetCommit": repo.main}
        return {"branches": [main], "converts": [], "tags": tags}

    def commits(self, body: dict, match: dict, url: str) -> list:
        repo = self._repo(match["repo"])
        start = repo.resolve(match["rev"]).id
        history = repo.history()
        history = history[[c.id for c in history].index(start) :]
        return [{"id": c.id, "authors": [{"user": "builder"}], "date": c.date, "title": c.title, "message": ""}
                for c in history]  # fmt: skip

    def tree(self, body: dict, match: dict, url: str) -> list:
        files = self._repo(match["repo"]).resolve(match["rev"]).files
        return [{"type": "file", "path": p, "oid": blob_id(c), "size": len(c)} for p, c in sorted(files.items())]

    def preupload(self, body: dict, match: dict, url: str) -> dict:
        files = self._repo(match["repo"]).resolve(unquote(match["rev"])).files
        return {"files": [
            {"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
             "oid": blob_id(files[f["path"]]) if f["path"] in files else None}
            for f in body["files"]
        ]}  # fmt: skip

    def commit(self, body: list, match: dict, url: str) -> dict:
        repo = self._repo(match["repo"])
        head = repo.resolve(unquote(match["rev"]))
        header = body[0]["value"]
        if header.get("parentCommit") not in (None, head.id):
            raise HubError(412, f"parent commit {header['parentCommit']} is not the head of main")
        files = dict(head.files)
        for line in body[1:]:
            if line["key"] == "file":
                files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
            elif line["key"] == "deletedFile":
                if line["value"]["path"] not in files:
                    raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[line["value"]["path"]]
            else:
                raise HubError(400, f"the fake Hub does not take {line['key']}")
        commit = self._new_commit(repo, head.id, header["summary"], files)
        repo.commits[commit.id] = commit
        repo.main = commit.id
        return {"commitOid": commit.id, "commitUrl": f"{url}/datasets/{match['repo']}/commit/{commit.id}"}

    def tag(self, body: dict, match: dict, url: str) -> dict:
        repo = self._repo(match["repo"])
        if body["tag"] in repo.tags:
            raise HubError(409, f"Tag {body['tag']} already exists")
        repo.tags[body["tag"]] = repo.resolve(unquote(match["rev"])).id
        return {}

    def resolve(self, match: dict) -> tuple[dict, bytes]:
        commit = self._repo(match["repo"]).resolve(unquote(match["rev"]))
        path = unquote(match["path"])
        if path not in commit.files:
            raise HubError(404, "Entry not found", "EntryNotFound")
        content = commit.files[path]
        return {"X-Repo-Commit": commit.id, "ETag": f'"{blob_id(content)}"'}, content


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # keep test output clean
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            self.method = method
            path = urlsplit(self.path).path
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            route = next(
                ((step, m.groupdict()) for step, verb, pattern in ROUTES
                 if verb == method.replace("HEAD", "GET") and (m := pattern.match(path))),
                None,
            )  # fmt: skip
            if route is None:
                return self._answer(404, {"error": f"the fake Hub has no {method} {path}"})
            step, match = route
            with hub.lock:
                hub.requests.append((step, path))
                failure = hub.failures.get(step)
                if failure == "drop":
                    self.close_connection = True
                    return None
                if isinstance(failure, int):
                    return self._answer(failure, {"error": f"injected failure at {step}"})
                try:
                    if step == "resolve":
                        headers, content = hub.resolve(match)
                    else:
                        body = _parse(raw, self.headers.get("Content-Type", ""))
                        headers, content = {}, json.dumps(getattr(hub, step)(body, match, hub.url)).encode()
                        headers["Content-Type"] = "application/json"
                except HubError as error:
                    extra = {"X-Error-Code": error.code} if error.code else {}
                    return self._answer(error.status, {"error": str(error), **error.extra}, extra)
                if failure == "lost":
                    self.close_connection = True
                    return None
            self._send(200, content, headers)
            return None

        def _answer(self, status: int, payload: dict, headers: dict | None = None) -> None:
            self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _send(self, status: int, content: bytes, headers: dict) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            if self.method != "HEAD":
                self.wfile.write(content)

    return Handler


def _parse(raw: bytes, content_type: str) -> object:
    if not raw:
        return {}
    if "ndjson" in content_type:
        return [json.loads(line) for line in raw.splitlines() if line.strip()]
    return json.loads(raw)
