"""A small in-memory Hugging Face Hub for tests.

It speaks the part of the Hub HTTP API that the real ``huggingface_hub`` client uses to create a repo,
commit files, make branches and download files, so push and pull can be tested offline with the real
client. Only the standard library is used.

What it models:

* repositories (models, datasets, spaces) with git-like history: every commit has a 40-hex sha and a
  parent, branches point to commits, files are resolved by branch name or by commit sha (full or a
  unique prefix of at least 7 characters);
* a new repository starts, as on the Hub, with one commit holding ``.gitattributes``;
* users and bearer tokens: writes need a token of the namespace's owner (or of a member of the
  organization); a private repository is invisible (404 ``RepoNotFound``) without such a token;
* errors in the Hub's form: the status code, an ``X-Error-Code`` header (``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound``) and a JSON body ``{"error": ...}``.

Every file is stored as a regular git blob: the preupload route answers ``uploadMode: "regular"`` for
every file, so the client never takes the LFS or Xet path. ETags are git blob shas, as on the Hub for
files stored in git.

Routes (``{type}`` is ``models``, ``datasets`` or ``spaces``; ``{repo}`` is ``namespace/name``; the
download routes put ``datasets/`` or ``spaces/`` before ``{repo}`` for those types):

====== ============================================== ==========================================
POST   /api/repos/create                               create_repo (409 if it exists)
POST   /api/repos/delete                               delete_repo
GET    /api/whoami-v2                                  whoami
POST   /api/validate-yaml                              README front-matter check (always valid)
GET    /api/{type}/{repo}                              repo_info at ``main``
GET    /api/{type}/{repo}/revision/{rev}               repo_info at a revision
GET    /api/{type}/{repo}/tree/{rev}[/{path}]          list_repo_tree (``recursive``)
GET    /api/{type}/{repo}/refs                         list_repo_refs
GET    /api/{type}/{repo}/commits/{rev}                list_repo_commits
POST   /api/{type}/{repo}/preupload/{rev}              upload modes: always ``regular``
POST   /api/{type}/{repo}/commit/{rev}                 create_commit (NDJSON, ``create_pr=1``)
POST   /api/{type}/{repo}/branch/{branch}              create_branch (409 if it exists)
DELETE /api/{type}/{repo}/branch/{branch}              delete_branch
HEAD   /{repo}/resolve/{rev}/{path}                    file metadata (ETag, X-Repo-Commit, size)
GET    /{repo}/resolve/{rev}/{path}                    file content, with ``Range`` support
====== ============================================== ==========================================

Example::

    with HubServer() as hub:            # 127.0.0.1, a free port
        token = hub.add_user("alice")
        # point HF_ENDPOINT at hub.url before importing huggingface_hub
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import re
import secrets
import threading
from collections import namedtuple
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["HubServer"]

REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
GITATTRIBUTES = b"*.bin filter=lfs diff=lfs merge=lfs -text\n*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
_HEX_PREFIX = re.compile(r"^[0-9a-f]{7,40}$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")

#: One served request: its method, raw path (with query), response status and ``Range`` header.
Request = namedtuple("Request", ["method", "path", "status", "range"])


def git_blob_sha(content: bytes) -> str:
    """The git object id of a blob, which the Hub uses as the ETag of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _header_safe(text: str) -> str:
    """HTTP header values are latin-1 on one line; keep messages readable whatever they hold."""
    return text.encode("ascii", "replace").decode().replace("\r", " ").replace("\n", " ").replace('"', "'")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")


class HubHTTPError(Exception):
    """Raised inside a handler; turned into an error response in the Hub's form."""

    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = headers or {}


@dataclass
class Commit:
    sha: str
    parent: str | None
    files: dict[str, str]  # path -> blob sha
    title: str
    message: str
    author: str
    date: str


@dataclass
class Repo:
    repo_type: str
    repo_id: str
    private: bool
    author: str
    created_at: str
    branches: dict[str, str] = field(default_factory=dict)  # branch (or refs/pr/N) -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)
    next_pr: int = 1


class HubState:
    """Users, repositories, commits and blobs, guarded by one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.tokens: dict[str, str] = {}  # token -> user name
        self.orgs: dict[str, set[str]] = {}  # user name -> organizations it can write to
        self.repos: dict[tuple[str, str], Repo] = {}
        self.blobs: dict[str, bytes] = {}
        self._counter = itertools.count()

    # users -----------------------------------------------------------------------------------
    def add_user(self, name: str, orgs: tuple[str, ...] | list[str] = (), token: str | None = None) -> str:
        token = token or "hf_" + secrets.token_hex(16)
        with self.lock:
            self.tokens[token] = name
            self.orgs.setdefault(name, set()).update(orgs)
        return token

    def can_write(self, user: str | None, namespace: str) -> bool:
        return user is not None and (user == namespace or namespace in self.orgs.get(user, set()))

    # repos -----------------------------------------------------------------------------------
    def get_repo(self, repo_type: str, repo_id: str, user: str | None) -> Repo:
        repo = self.repos.get((repo_type, repo_id))
        if repo is None or (repo.private and not self.can_write(user, repo_id.split("/")[0])):
            raise HubHTTPError(404, "Repository not found", "RepoNotFound")
        return repo

    def check_write(self, repo: Repo, user: str | None) -> None:
        if user is None:
            raise HubHTTPError(401, "You must be authenticated to write to this repository")
        if not self.can_write(user, repo.repo_id.split("/")[0]):
            raise HubHTTPError(403, f"You don't have the rights to write to {repo.repo_id}")

    def new_commit(self, repo: Repo, parent: str | None, files: dict[str, str], title: str, message: str,
                   author: str) -> Commit:
        seed = json.dumps([repo.repo_type, repo.repo_id, parent, sorted(files.items()), title, message,
                           next(self._counter)])
        commit = Commit(hashlib.sha1(seed.encode()).hexdigest(), parent, files, title, message, author, _now())
        repo.commits[commit.sha] = commit
        return commit

    def resolve(self, repo: Repo, revision: str) -> str:
        """A branch name or a (prefix of a) commit sha -> the commit sha."""
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        if _HEX_PREFIX.match(revision):
            matches = [sha for sha in repo.commits if sha.startswith(revision)]
            if len(matches) == 1:
                return matches[0]
        raise HubHTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")


class HubServer:
    """The test Hub: a :class:`ThreadingHTTPServer` on ``127.0.0.1`` in a daemon thread.

    Args:
        port: the port to listen on; 0 picks a free one.
        user: the name of a first user, whose token is :attr:`token`.

    Attributes:
        url: the endpoint, e.g. ``http://127.0.0.1:54321`` (what ``HF_ENDPOINT`` must be).
        token: a write token of :attr:`user`.
        requests: a :data:`Request` ``(method, path, status, range)`` for every request served, for
            tests that count calls or check that a download resumed.
    """

    def __init__(self, port: int = 0, user: str = "tester") -> None:
        self.state = HubState()
        self.user = user
        self.token = self.state.add_user(user)
        self.requests: list[Request] = []
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None
        self._interruptions: dict[str, int] = {}  # file path -> bytes to send before dropping the connection

    def add_user(self, name: str, orgs: tuple[str, ...] | list[str] = ()) -> str:
        """Create a user (member of ``orgs``) and return a new write token for it."""
        return self.state.add_user(name, orgs)

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # helpers for tests -------------------------------------------------------------------------
    def interrupt_download(self, path: str, after_bytes: int) -> None:
        """Make the next full GET of a file at ``path`` (any repo) stop after ``after_bytes`` bytes and
        drop the connection, as a flaky network would: the client should resume with a Range request."""
        with self.state.lock:
            self._interruptions[path] = after_bytes

    def branch_sha(self, repo_id: str, branch: str = "main", repo_type: str = "model") -> str:
        with self.state.lock:
            return self.state.repos[(repo_type, repo_id)].branches[branch]


def _make_handler(server: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        hub = server

    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every response carries a Content-Length
    server_version = "TestHub/1.0"
    timeout = 30  # idle keep-alive connections are dropped after this many seconds
    # Send each response in one segment: headers and body written apart meet delayed ACKs (~40 ms each).
    disable_nagle_algorithm = True
    wbufsize = 1 << 16
    hub: HubServer

    # plumbing ----------------------------------------------------------------------------------
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence the default stderr log
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        self._response: tuple | None = None
        try:
            split = urlsplit(self.path)
            self.query = {k: v[-1] for k, v in parse_qs(split.query).items()}
            self.raw_path = split.path
            body = self._read_body()
            self.user = self._authenticate()
            with self.hub.state.lock:  # handlers only compute the response; it is sent after unlocking
                self._route(method, body)
        except HubHTTPError as err:
            headers = dict(err.headers)
            if err.error_code:
                headers["X-Error-Code"] = err.error_code
            headers["X-Error-Message"] = _header_safe(err.message)
            self._send_json({"error": err.message}, status=err.status, headers=headers)
        except Exception as err:  # a bug in the test server: answer 500 rather than hang the client
            self._send_json({"error": f"test hub error: {type(err).__name__}: {err}"}, status=500)
        status = self._response[0] if self._response else 500
        self.hub.requests.append(Request(method, self.path, status, self.headers.get("Range")))
        self._write_response(*self._response)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _authenticate(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if not auth.lower().startswith("bearer "):
            return None
        token = auth[7:].strip()
        user = self.hub.state.tokens.get(token)
        if user is None:
            raise HubHTTPError(401, "Invalid credentials in Authorization header")
        return user

    def _send(self, status: int, body: bytes, headers: dict | None = None,
              content_type: str = "application/json", body_limit: int | None = None) -> None:
        """Set the response; ``body_limit`` sends only that many bytes of the body, then hangs up."""
        self._response = (status, body, headers or {}, content_type, body_limit)

    def _write_response(self, status: int, body: bytes, headers: dict, content_type: str,
                        body_limit: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body if body_limit is None else body[:body_limit])
        self.wfile.flush()
        if body_limit is not None:
            self.close_connection = True

    def _send_json(self, payload, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _json_body(self, body: bytes) -> dict:
        try:
            return json.loads(body or b"{}")
        except ValueError:
            raise HubHTTPError(400, "Request body is not valid JSON") from None

    # routing -----------------------------------------------------------------------------------
    def _route(self, method: str, body: bytes) -> None:
        parts = self.raw_path.strip("/").split("/")
        if parts[:1] == ["api"]:
            if method == "POST" and parts[1:] == ["repos", "create"]:
                return self._create_repo(self._json_body(body))
            if method in ("POST", "DELETE") and parts[1:] == ["repos", "delete"]:
                return self._delete_repo(self._json_body(body))
            if method == "GET" and parts[1:] == ["whoami-v2"]:
                return self._whoami()
            if method == "POST" and parts[1:] == ["validate-yaml"]:
                return self._send_json({"errors": [], "warnings": []})
            if len(parts) >= 4 and parts[1] in REPO_TYPES:
                repo = self.hub.state.get_repo(REPO_TYPES[parts[1]], f"{parts[2]}/{parts[3]}", self.user)
                return self._repo_api(method, repo, parts[4:], body)
            if len(parts) == 3 and parts[1] in REPO_TYPES:  # a repo id without a namespace
                raise HubHTTPError(404, "Repository not found", "RepoNotFound")
            raise HubHTTPError(404, f"No such API route: {method} {self.raw_path}")

        # /{prefix}{namespace}/{name}/resolve/{revision}/{path...}
        repo_type = "model"
        if parts[0] in ("datasets", "spaces"):
            repo_type = REPO_TYPES[parts[0]]
            parts = parts[1:]
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            repo = self.hub.state.get_repo(repo_type, f"{parts[0]}/{parts[1]}", self.user)
            return self._resolve(repo, unquote(parts[3]), unquote("/".join(parts[4:])))
        if method in ("GET", "HEAD") and len(parts) >= 3 and parts[1] == "resolve":  # no namespace
            raise HubHTTPError(404, "Repository not found", "RepoNotFound")
        raise HubHTTPError(404, f"No such route: {method} {self.raw_path}")

    def _repo_api(self, method: str, repo: Repo, rest: list[str], body: bytes) -> None:
        state = self.hub.state
        action = rest[0] if rest else ""
        if method == "GET" and not rest:
            return self._repo_info(repo, "main")
        if method == "GET" and action == "revision" and len(rest) >= 2:
            return self._repo_info(repo, unquote("/".join(rest[1:])))
        if method == "GET" and action == "tree" and len(rest) >= 2:
            return self._tree(repo, unquote(rest[1]), unquote("/".join(rest[2:])))
        if method == "GET" and action == "refs":
            return self._refs(repo)
        if method == "GET" and action == "commits" and len(rest) >= 2:
            return self._commits(repo, unquote(rest[1]))
        if method == "POST" and action == "preupload" and len(rest) >= 2:
            state.check_write(repo, self.user)
            return self._preupload(repo, unquote(rest[1]), self._json_body(body))
        if method == "POST" and action == "commit" and len(rest) >= 2:
            state.check_write(repo, self.user)
            return self._commit(repo, unquote("/".join(rest[1:])), body)
        if action == "branch" and len(rest) >= 2 and method in ("POST", "DELETE"):
            state.check_write(repo, self.user)
            branch = unquote("/".join(rest[1:]))
            if method == "DELETE":
                if branch not in repo.branches:
                    raise HubHTTPError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
                if branch == "main":
                    raise HubHTTPError(403, "Cannot delete the main branch")
                del repo.branches[branch]
                return self._send_json({})
            return self._create_branch(repo, branch, self._json_body(body))
        raise HubHTTPError(404, f"No such API route: {method} {self.raw_path}")

    # API handlers ------------------------------------------------------------------------------
    def _create_repo(self, payload: dict) -> None:
        state = self.hub.state
        if self.user is None:
            raise HubHTTPError(401, "You must be authenticated to create a repository")
        name = payload.get("name") or ""
        namespace = payload.get("organization") or self.user
        if not re.fullmatch(r"[\w.-]{1,96}", name) or not re.fullmatch(r"[\w.-]{1,96}", namespace):
            raise HubHTTPError(400, f"Invalid repository name: {namespace}/{name}")
        if not state.can_write(self.user, namespace):
            raise HubHTTPError(403, f"You don't have the rights to create a repository under {namespace}")
        repo_type = payload.get("type") or "model"
        if repo_type not in URL_PREFIXES:
            raise HubHTTPError(400, f"Invalid repository type: {repo_type}")
        repo_id = f"{namespace}/{name}"
        url = f"{self.hub.url}/{URL_PREFIXES[repo_type]}{repo_id}"
        if (repo_type, repo_id) in state.repos:
            return self._send_json({"error": "You already created this repo", "url": url}, status=409)
        # Older clients send "private": bool, newer ones "visibility": "private" | "public".
        private = bool(payload.get("private")) or payload.get("visibility") == "private"
        repo = Repo(repo_type, repo_id, private, namespace, _now())
        blob = git_blob_sha(GITATTRIBUTES)
        state.blobs[blob] = GITATTRIBUTES
        first = state.new_commit(repo, None, {".gitattributes": blob}, "initial commit", "", self.user)
        repo.branches["main"] = first.sha
        state.repos[(repo_type, repo_id)] = repo
        self._send_json({"url": url, "name": repo_id, "id": repo_id})

    def _delete_repo(self, payload: dict) -> None:
        state = self.hub.state
        namespace = payload.get("organization") or self.user or ""
        repo_type = payload.get("type") or "model"
        repo = state.get_repo(repo_type, f"{namespace}/{payload.get('name')}", self.user)
        state.check_write(repo, self.user)
        del state.repos[(repo.repo_type, repo.repo_id)]
        self._send_json({})

    def _whoami(self) -> None:
        if self.user is None:
            raise HubHTTPError(401, "Invalid credentials in Authorization header")
        orgs = [{"name": org, "type": "org"} for org in sorted(self.hub.state.orgs.get(self.user, ()))]
        self._send_json({"type": "user", "name": self.user, "fullname": self.user, "orgs": orgs,
                         "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": "write"}}})

    def _repo_info(self, repo: Repo, revision: str) -> None:
        sha = self.hub.state.resolve(repo, revision)
        commit = repo.commits[sha]
        with_blobs = self.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for path, blob in sorted(commit.files.items()):
            sibling: dict = {"rfilename": path}
            if with_blobs:
                sibling.update(size=len(self.hub.state.blobs[blob]), blobId=blob)
            siblings.append(sibling)
        self._send_json({
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24], "id": repo.repo_id,
            "modelId": repo.repo_id, "author": repo.author, "sha": sha, "lastModified": commit.date,
            "createdAt": repo.created_at, "private": repo.private, "gated": False, "disabled": False,
            "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
        })

    def _tree(self, repo: Repo, revision: str, path: str) -> None:
        sha = self.hub.state.resolve(repo, revision)
        files = repo.commits[sha].files
        path = path.strip("/")
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        if path in files:
            raise HubHTTPError(404, f"{path} is a file, not a folder", "EntryNotFound",
                               headers={"X-Repo-Commit": sha})
        prefix = f"{path}/" if path else ""
        below = {p[len(prefix):]: blob for p, blob in files.items() if p.startswith(prefix)}
        if path and not below:
            raise HubHTTPError(404, f"{path} does not exist on {revision}", "EntryNotFound",
                               headers={"X-Repo-Commit": sha})
        entries: dict[str, dict] = {}
        for rel, blob in sorted(below.items()):
            segments = rel.split("/")
            for depth in range(1, len(segments)):  # the folders on the way
                folder = prefix + "/".join(segments[:depth])
                if (recursive or depth == 1) and folder not in entries:
                    entries[folder] = {"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                       "size": 0, "path": folder}
            if recursive or len(segments) == 1:
                entries[prefix + rel] = {"type": "file", "oid": blob, "size": len(self.hub.state.blobs[blob]),
                                         "path": prefix + rel}
        self._send_json(list(entries.values()))

    def _refs(self, repo: Repo) -> None:
        branches, prs = [], []
        for name, sha in sorted(repo.branches.items()):
            if name.startswith("refs/pr/"):
                prs.append({"name": name, "ref": name, "targetCommit": sha})
            else:
                branches.append({"name": name, "ref": f"refs/heads/{name}", "targetCommit": sha})
        payload = {"branches": branches, "converts": [], "tags": []}
        if self.query.get("include_prs"):
            payload["pullRequests"] = prs
        self._send_json(payload)

    def _commits(self, repo: Repo, revision: str) -> None:
        sha: str | None = self.hub.state.resolve(repo, revision)
        history = []
        while sha is not None:
            commit = repo.commits[sha]
            history.append({"id": commit.sha, "title": commit.title, "message": commit.message,
                            "authors": [{"user": commit.author}], "date": commit.date})
            sha = commit.parent
        self._send_json(history)

    def _preupload(self, repo: Repo, revision: str, payload: dict) -> None:
        current: dict[str, str] = {}
        if revision in repo.branches or not self.query.get("create_pr"):
            current = repo.commits[self.hub.state.resolve(repo, revision)].files
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": current.get(f["path"])}
                 for f in payload.get("files", [])]
        self._send_json({"files": files, "commitOid": repo.branches.get(revision)})

    def _create_branch(self, repo: Repo, branch: str, payload: dict) -> None:
        if branch in repo.branches:
            raise HubHTTPError(409, f"Reference already exists: refs/heads/{branch}")
        if _HEX_PREFIX.fullmatch(branch) and len(branch) == 40:
            raise HubHTTPError(400, "A branch name cannot be a commit sha")
        start = payload.get("startingPoint") or "main"
        repo.branches[branch] = self.hub.state.resolve(repo, start)
        self._send_json({})

    def _commit(self, repo: Repo, revision: str, body: bytes) -> None:
        state = self.hub.state
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError:
            raise HubHTTPError(400, "Commit payload is not valid NDJSON") from None
        if not lines or lines[0].get("key") != "header":
            raise HubHTTPError(400, "The first NDJSON line of a commit must be its header")
        header = lines[0]["value"]
        if revision not in repo.branches:
            # The Hub only commits onto branches; a commit sha or an unknown name is refused.
            raise HubHTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        head = repo.branches[revision]
        parent_commit = header.get("parentCommit")
        if parent_commit and not head.startswith(parent_commit):
            raise HubHTTPError(412, f"A commit has happened since {parent_commit}; {revision} is now at {head}")
        create_pr = self.query.get("create_pr") in ("1", "true")
        files = dict(repo.commits[head].files)
        for line in lines[1:]:
            key, value = line.get("key"), line.get("value", {})
            path = value.get("path", "").strip("/")
            if key == "file":
                if value.get("encoding", "base64") != "base64":
                    raise HubHTTPError(400, f"Unsupported encoding {value.get('encoding')!r}")
                content = base64.b64decode(value.get("content", ""))
                blob = git_blob_sha(content)
                state.blobs[blob] = content
                files[path] = blob
            elif key == "deletedFile":
                if path not in files:
                    raise HubHTTPError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                del files[path]
            elif key == "deletedFolder":
                doomed = [p for p in files if p.startswith(path + "/")]
                if not doomed:
                    raise HubHTTPError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                for p in doomed:
                    del files[p]
            elif key in ("lfsFile", "xetFile"):
                raise HubHTTPError(400, f"This test hub stores every file in git; {key} is not supported "
                                        "(it answers uploadMode 'regular' to preupload)")
            else:
                raise HubHTTPError(400, f"Unknown commit operation {key!r}")
        title = header.get("summary") or "Update files"
        commit = state.new_commit(repo, head, files, title, header.get("description") or "", self.user or "")
        repo_url = f"{self.hub.url}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}"
        result = {"success": True, "commitOid": commit.sha, "commitUrl": f"{repo_url}/commit/{commit.sha}",
                  "hookOutput": ""}
        if create_pr:
            number = repo.next_pr
            repo.next_pr += 1
            repo.branches[f"refs/pr/{number}"] = commit.sha
            result["pullRequestUrl"] = f"{repo_url}/discussions/{number}"
        else:
            repo.branches[revision] = commit.sha
        self._send_json(result)

    # file download -----------------------------------------------------------------------------
    def _resolve(self, repo: Repo, revision: str, path: str) -> None:
        sha = self.hub.state.resolve(repo, revision)
        blob = repo.commits[sha].files.get(path)
        if blob is None:
            raise HubHTTPError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
        content = self.hub.state.blobs[blob]
        size = len(content)
        headers = {"ETag": f'"{blob}"', "X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                   "Content-Disposition": f'inline; filename="{_header_safe(path.rsplit("/", 1)[-1])}"'}
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            match = _RANGE.match(wanted.strip())
            if match is None or not any(match.groups()):
                raise HubHTTPError(416, f"Unsupported range {wanted!r}", headers={"Content-Range": f"bytes */{size}"})
            first, last = match.groups()
            if first == "":  # the last N bytes
                start, end = max(size - int(last), 0), size - 1
            else:
                start, end = int(first), min(int(last), size - 1) if last else size - 1
            if start >= size or start > end:
                raise HubHTTPError(416, f"Range {wanted!r} not satisfiable",
                                   headers={"Content-Range": f"bytes */{size}"})
            content = content[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
            status = 206
        cut = self.hub._interruptions.pop(path, None) if self.command == "GET" and status == 200 else None
        # With an interruption pending: announce the whole file, send part of it, hang up.
        self._send(status, content, headers, content_type="application/octet-stream", body_limit=cut)
