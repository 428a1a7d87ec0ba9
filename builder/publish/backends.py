"""Where releases go: a local Hub of bare git repositories (`git`) or the real Hugging Face Hub (`hf`).

Both make one commit holding every file of the release folder and tag it `v<version>`. Neither ever moves or
deletes an existing tag, so a failed or refused publish leaves every earlier version as it was. Every failure
of the repository (refused write, network, Hub outage) is a `PublishError` saying which step failed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from builder.publish.release import PublishError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Head:
    """The commit at the head of `main`: its id and the first line of its message."""

    commit: str
    title: str


class Backend(Protocol):
    """A dataset repository that holds tagged releases. Every method raises `PublishError` when the repository
    cannot be read or written."""

    def location(self) -> str:
        """Where the repository is, for messages."""
        ...

    def tags(self) -> list[str]:
        """Every tag of the repository (empty when it does not exist yet)."""
        ...

    def head(self) -> Head | None:
        """The head of `main` (None when the repository or the branch does not exist yet)."""
        ...

    def read_file(self, revision: str, path: str) -> bytes | None:
        """A file's content at a tag or a commit id, or None when the file is not there."""
        ...

    def publish(self, folder: Path, tag: str, message: str) -> str:
        """Commit exactly the files of `folder` on `main` and tag that commit; returns the commit id.

        Raises:
            PublishError: the tag exists (nothing is changed) or the repository refused the write; the message
                says whether a commit landed untagged.
        """
        ...

    def tag(self, commit: str, tag: str, message: str) -> None:
        """Tag `commit`, which must be the head of `main` (a release whose tag step failed); a new tag only.

        Raises:
            PublishError: the tag exists, `main` moved, or the repository refused the write.
        """
        ...


def release_files(folder: Path) -> list[str]:
    """Relative POSIX paths of every file in a release folder, sorted."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file())


# ------------------------------------------------------------------------------------------------------ git


class GitBackend:
    """One bare repository per dataset at `<root>/datasets/<org>/<name>`: the layout `olah` serves.

    The commit is built straight from the release folder with a private index (no clone, no checkout), and the
    branch and the tag are then updated in one `git update-ref` transaction: both move or neither does, and a
    tag that appeared meanwhile makes the transaction fail instead of being overwritten.
    """

    def __init__(self, root: Path, repo: str) -> None:
        org, name = repo.split("/")
        self.repo = repo
        self.path = Path(root) / "datasets" / org / name

    def location(self) -> str:
        return str(self.path)

    def tags(self) -> list[str]:
        if not self.path.exists():
            return []
        return self._git("tag", "--list").split()

    def head(self) -> Head | None:
        if not self.path.exists():
            return None
        commit = self._git("rev-parse", "--verify", "--quiet", "refs/heads/main", check=False).strip()
        return Head(commit, self._git("log", "-1", "--format=%s", commit).strip()) if commit else None

    def read_file(self, revision: str, path: str) -> bytes | None:
        ref = revision if _is_commit_id(revision) else f"refs/tags/{revision}"
        result = subprocess.run(
            ["git", "--git-dir", str(self.path), "show", f"{ref}:{path}"], capture_output=True, env=_git_env()
        )
        return result.stdout if result.returncode == 0 else None

    def publish(self, folder: Path, tag: str, message: str) -> str:
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "init", "--quiet", "--bare", "--initial-branch=main", str(self.path)], check=True)
        if tag in self.tags():
            raise PublishError(f"{self.repo} already has tag {tag} at {self.path}; pick a new version")
        with tempfile.TemporaryDirectory(prefix="builder-index-") as scratch:
            env = {"GIT_INDEX_FILE": str(Path(scratch) / "index"), "GIT_WORK_TREE": str(folder.resolve())}
            self._git("add", "--all", "--force", ".", env=env, cwd=folder)
            tree = self._git("write-tree", env=env).strip()
        parent = self._git("rev-parse", "--verify", "--quiet", "refs/heads/main", check=False).strip()
        commit = self._git("commit-tree", tree, *(["-p", parent] if parent else []), "-m", message).strip()
        self._update_refs(f"update refs/heads/main {commit} {parent or '0' * 40}", commit, tag, message)
        logger.info("git: %s %s → %s", self.path, tag, commit)
        return commit

    def tag(self, commit: str, tag: str, message: str) -> None:
        self._update_refs(f"verify refs/heads/main {commit}", commit, tag, message)
        logger.info("git: %s %s → %s (tag only)", self.path, tag, commit)

    def _update_refs(self, main: str, commit: str, tag: str, message: str) -> None:
        """One `update-ref` transaction: `main`'s line and the creation of the tag happen together or not at all."""
        tag_object = self._git("mktag", input=_tag_text(commit, tag, message)).strip()
        transaction = f"start\n{main}\ncreate refs/tags/{tag} {tag_object}\nprepare\ncommit\n"
        try:
            self._git("update-ref", "--stdin", input=transaction)
        except PublishError as error:
            raise PublishError(f"could not publish {tag} to {self.path} (nothing changed): {error}") from None

    def _git(self, *args: str, env: dict | None = None, cwd: Path | None = None, input: str | None = None,
             check: bool = True) -> str:  # fmt: skip
        result = subprocess.run(
            ["git", "--git-dir", str(self.path.resolve()), *args],
            capture_output=True,
            text=True,
            env=_git_env(env),
            cwd=cwd,
            input=input,
        )
        if check and result.returncode != 0:
            raise PublishError(f"git {args[0]} failed: {result.stderr.strip()}")
        return result.stdout


def _git_env(extra: dict | None = None) -> dict:
    # The user's global git config (hooks, excludes, signing) must not change what a release contains.
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", **(extra or {})}
    identity = {"GIT_AUTHOR_NAME": "builder", "GIT_AUTHOR_EMAIL": "builder@localhost"}
    identity |= {"GIT_COMMITTER_NAME": "builder", "GIT_COMMITTER_EMAIL": "builder@localhost"}
    return {**identity, **env}


def _tag_text(commit: str, tag: str, message: str) -> str:
    tagger = f"builder <builder@localhost> {int(time.time())} +0000"
    return f"object {commit}\ntype commit\ntag {tag}\ntagger {tagger}\n\n{message}\n"


def _is_commit_id(revision: str) -> bool:
    return len(revision) == 40 and all(c in "0123456789abcdef" for c in revision)


# ------------------------------------------------------------------------------------------------------- hf


class HfBackend:
    """A dataset repository on the Hugging Face Hub, through `huggingface_hub.HfApi`.

    The token comes from the environment (`HF_TOKEN`, or the login `huggingface_hub` stores). `api` is an HfApi
    made by the caller (tests point one at a local server with `HfApi(endpoint=...)`).

    The Hub has no transaction over a branch and a tag: the commit lands first, then the tag is created. When
    the tag step fails, the error names the commit that landed untagged, and the next `publish` of the same
    version finds it at the head of `main` and only tags it.
    """

    def __init__(self, repo: str, private: bool = False, api: Any = None) -> None:
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=os.environ.get("HF_TOKEN"))
        self.repo = repo
        self.private = private
        self.api = api

    def location(self) -> str:
        return f"{self.api.endpoint}/datasets/{self.repo}"

    def tags(self) -> list[str]:
        from huggingface_hub.errors import RepositoryNotFoundError

        def refs() -> list[str]:
            try:
                return [ref.name for ref in self.api.list_repo_refs(self.repo, repo_type="dataset").tags]
            except RepositoryNotFoundError:
                return []

        return self._hub("list the tags of", refs, "nothing was published")

    def head(self) -> Head | None:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        def latest() -> Head | None:
            try:
                commit = self.api.list_repo_commits(self.repo, repo_type="dataset", revision="main")[0]
            except (RepositoryNotFoundError, RevisionNotFoundError):
                return None
            return Head(commit.commit_id, commit.title)

        return self._hub("read the head of main of", latest, "nothing was published")

    def read_file(self, revision: str, path: str) -> bytes | None:
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        def download() -> bytes | None:
            # A private cache: a Hub failure must fail the read, never fall back to a copy cached earlier.
            with tempfile.TemporaryDirectory(prefix="builder-hf-") as cache:
                try:
                    local = self.api.hf_hub_download(
                        self.repo, path, repo_type="dataset", revision=revision, cache_dir=cache
                    )
                except LocalEntryNotFoundError:
                    raise  # the Hub could not be reached (it is an EntryNotFoundError too)
                except EntryNotFoundError:
                    return None
                return Path(local).read_bytes()

        return self._hub(f"read {path} at {revision} of", download, "nothing was published")

    def publish(self, folder: Path, tag: str, message: str) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        untouched = "nothing was published"
        self._hub("create", lambda: self.api.create_repo(
            self.repo, repo_type="dataset", private=self.private, exist_ok=True
        ), untouched)  # fmt: skip
        if tag in self.tags():
            raise PublishError(f"{self.repo} already has tag {tag} on the Hub; pick a new version")
        head = self.head()
        parent = head.commit if head else None
        existing = self._hub("list the files on main of", lambda: self.api.list_repo_files(
            self.repo, repo_type="dataset", revision=parent or "main"
        ), untouched)  # fmt: skip
        files = release_files(folder)
        operations: list[Any] = [CommitOperationAdd(path, str(folder / path)) for path in files]
        # Files of the previous release that this one no longer has (fewer shards, say) must go, or they would
        # match a data_files pattern; the Hub's own .gitattributes stays.
        stale = sorted(set(existing) - set(files) - {".gitattributes"})
        operations += [CommitOperationDelete(path) for path in stale]
        # parent_commit: a commit that lands on main meanwhile makes this one fail instead of being built on a
        # file list that is no longer main's.
        commit = self._hub("commit the release to main of", lambda: self.api.create_commit(
            self.repo, operations=operations, commit_message=message, repo_type="dataset", revision="main",
            parent_commit=parent,
        ), "nothing was tagged; if the commit landed after all, rerunning publish with the same version only "
           "tags it, otherwise it commits again")  # fmt: skip
        self.tag(commit.oid, tag, message)
        logger.info("hf: %s %s → %s", self.repo, tag, commit.oid)
        return commit.oid

    def tag(self, commit: str, tag: str, message: str) -> None:
        untagged = (
            f"commit {commit} landed on main untagged; every earlier version is unchanged. Rerun "
            f"`python -m builder publish --version {tag.removeprefix('v')} --backend hf --repo {self.repo}` to "
            f"tag it (it will not commit again)"
        )
        try:
            self._hub(f"create tag {tag} on", lambda: self.api.create_tag(
                self.repo, tag=tag, tag_message=message, revision=commit, repo_type="dataset"
            ), untagged)  # fmt: skip
        except PublishError:
            if self._tagged(tag) != commit:
                raise
            # The connection failed after the Hub made the tag: the release is complete.
            logger.warning("hf: creating %s failed, but the Hub has it on %s", tag, commit)

    def _tagged(self, tag: str) -> str | None:
        """The commit `tag` points to, or None when it does not exist or the Hub cannot say."""
        try:
            refs = self.api.list_repo_refs(self.repo, repo_type="dataset").tags
        except _hub_errors():
            return None
        return next((ref.target_commit for ref in refs if ref.name == tag), None)

    def _hub(self, doing: str, call: Callable[[], Any], state: str) -> Any:
        """`call()`, with a failure of the Hub or the network raised as a PublishError naming the step, what it
        left behind (`state`) and what to do about it."""
        try:
            return call()
        except _hub_errors() as error:
            raise PublishError(
                f"could not {doing} {self.location()}: {_reason(error)}. {state[0].upper()}{state[1:]}. "
                f"{_advice(error)}"
            ) from error


def _hub_errors() -> tuple[type[BaseException], ...]:
    """What HfApi raises when the Hub or the network fails: its HTTP errors and the transport errors (refused or
    dropped connection, timeout) of the HTTP library it is built on (whose base class HfHubHTTPError extends:
    httpx2's in huggingface_hub 2, requests' before), OSError (offline mode, nothing cached, an unreadable answer)
    and ValueError (an answer that is not the JSON expected, card metadata the Hub rejects)."""
    from huggingface_hub.errors import HfHubHTTPError

    return (HfHubHTTPError.__bases__[0], OSError, ValueError)


def _reason(error: BaseException) -> str:
    """The error in one line; with its cause when the error is not an HTTP answer, which says it all (e.g. the
    HTTP error behind "cannot find the requested files in the local cache")."""
    text = " ".join(str(error).split()).rstrip(".") or "no message"
    cause = " ".join(str(error.__cause__).split()).rstrip(".") if error.__cause__ is not None else ""
    if cause and not hasattr(error, "response") and cause not in text:
        text += f" ({type(error.__cause__).__name__}: {cause})"
    return f"{type(error).__name__}: {text[:600]}"


def _advice(error: BaseException) -> str:
    status = next(
        (getattr(e.response, "status_code", None) for e in (error, error.__cause__) if hasattr(e, "response")), None
    )
    if status == 401:
        return "Check the token: set HF_TOKEN (or run `hf auth login`) to a token with write access."
    if status == 403:
        return "The Hub refused the token: publishing needs write access to this repository; check its permissions."
    if status == 404:
        return "Check the repository name, and that the token can see it."
    if status == 412:
        return "main moved while publishing (another publish?); rerun publish."
    return "The Hub or the network failed; check https://status.huggingface.co and retry."
