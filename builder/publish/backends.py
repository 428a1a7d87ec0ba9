"""Where releases go: a local Hub of bare git repositories (`git`) or the real Hugging Face Hub (`hf`).

Both make one commit holding every file of the release folder and tag it `v<version>`. Neither ever moves or
deletes an existing tag, so a failed or refused publish leaves every earlier version as it was.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from builder.publish.release import PublishError

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """A dataset repository that holds tagged releases."""

    def location(self) -> str:
        """Where the repository is, for messages."""
        ...

    def tags(self) -> list[str]:
        """Every tag of the repository (empty when it does not exist yet)."""
        ...

    def read_file(self, tag: str, path: str) -> bytes | None:
        """A file's content at a tag, or None when the file is not there."""
        ...

    def publish(self, folder: Path, tag: str, message: str) -> str:
        """Commit exactly the files of `folder` on `main` and tag that commit; returns the commit id.

        Raises:
            PublishError: the tag exists (nothing is changed) or the repository refused the write.
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

    def read_file(self, tag: str, path: str) -> bytes | None:
        result = subprocess.run(
            ["git", "--git-dir", str(self.path), "show", f"refs/tags/{tag}:{path}"],
            capture_output=True,
            env=_git_env(),
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
        tag_object = self._git("mktag", input=_tag_text(commit, tag, message)).strip()
        transaction = (
            f"start\nupdate refs/heads/main {commit} {parent or '0' * 40}\n"
            f"create refs/tags/{tag} {tag_object}\nprepare\ncommit\n"
        )
        try:
            self._git("update-ref", "--stdin", input=transaction)
        except PublishError as error:
            raise PublishError(f"could not publish {tag} to {self.path} (nothing changed): {error}") from None
        logger.info("git: %s %s → %s", self.path, tag, commit)
        return commit

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


# ------------------------------------------------------------------------------------------------------- hf


class HfBackend:
    """A dataset repository on the Hugging Face Hub, through `huggingface_hub.HfApi`.

    The token comes from the environment (`HF_TOKEN`, or the login `huggingface_hub` stores). `api` may be any
    object with HfApi's methods, which is how tests record the calls without a network.
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
        if not self.api.repo_exists(self.repo, repo_type="dataset"):
            return []
        return [ref.name for ref in self.api.list_repo_refs(self.repo, repo_type="dataset").tags]

    def read_file(self, tag: str, path: str) -> bytes | None:
        from huggingface_hub.errors import EntryNotFoundError

        try:
            local = self.api.hf_hub_download(self.repo, path, repo_type="dataset", revision=tag)
        except EntryNotFoundError:
            return None
        return Path(local).read_bytes()

    def publish(self, folder: Path, tag: str, message: str) -> str:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        self.api.create_repo(self.repo, repo_type="dataset", private=self.private, exist_ok=True)
        if tag in self.tags():
            raise PublishError(f"{self.repo} already has tag {tag} on the Hub; pick a new version")
        files = release_files(folder)
        existing = self.api.list_repo_files(self.repo, repo_type="dataset", revision="main")
        operations: list[Any] = [CommitOperationAdd(path, str(folder / path)) for path in files]
        # Files of the previous release that this one no longer has (fewer shards, say) must go, or they would
        # match a data_files pattern; the Hub's own .gitattributes stays.
        stale = sorted(set(existing) - set(files) - {".gitattributes"})
        operations += [CommitOperationDelete(path) for path in stale]
        commit = self.api.create_commit(
            self.repo, operations=operations, commit_message=message, repo_type="dataset", revision="main"
        )
        self.api.create_tag(self.repo, tag=tag, tag_message=message, revision=commit.oid, repo_type="dataset")
        logger.info("hf: %s %s → %s", self.repo, tag, commit.oid)
        return commit.oid
