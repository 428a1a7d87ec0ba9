"""Load a pinned release for training, failing loudly instead of silently using another version.

`datasets.load_dataset(repo, config, revision=tag)` falls back to "the latest cached version" when the Hub
lookup fails (offline, or a missing tag on some servers), whatever the tag. Here the tag is checked first, the
snapshot for exactly that tag is downloaded (or found in the cache by its tag), its data files are checked
against the release manifest, and the local snapshot is loaded.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from builder.publish.release import MANIFEST, PublishError, tag_of


def pinned_snapshot(
    repo_id: str,
    config: str,
    version: str,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """The local snapshot folder of `repo_id` at tag `v<version>` with the card, manifest and `config`'s files.

    The folder's name is the commit sha the tag resolved to; record it with your training run.

    Raises:
        PublishError: the tag does not exist, or a file does not match the release manifest.
    """
    from huggingface_hub import HfApi, constants, snapshot_download

    tag = tag_of(version)
    if not constants.HF_HUB_OFFLINE:
        refs = HfApi(endpoint=endpoint, token=token).list_repo_refs(repo_id, repo_type="dataset")
        tags = sorted(ref.name for ref in refs.tags)
        if tag not in tags:
            raise PublishError(f"{repo_id} has no tag {tag}; its tags are: {', '.join(tags) or 'none'}")
    path = Path(
        snapshot_download(
            repo_id,
            repo_type="dataset",
            revision=tag,
            allow_patterns=["README.md", MANIFEST, f"data/{config}/*"],
            endpoint=endpoint,
            token=token,
            cache_dir=cache_dir,
        )
    )
    verify_snapshot(path, config)
    return path


def verify_snapshot(path: Path, config: str) -> None:
    """Check every data file of `config` against the sha256 in `release.json` (and that none is missing)."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise PublishError(f"{path} has no {MANIFEST}: not a builder release, or an incomplete download")
    files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
    for relative, entry in files.items():
        if not relative.startswith(f"data/{config}/"):
            continue
        local = path / relative
        if not local.exists():
            raise PublishError(f"{relative} of the release is missing from {path}")
        if hashlib.sha256(local.read_bytes()).hexdigest() != entry["sha256"]:
            raise PublishError(f"{relative} in {path} does not match the release manifest")


def load_pinned(
    repo_id: str,
    config: str,
    version: str,
    *,
    split: str | None = None,
    endpoint: str | None = None,
    token: str | None = None,
    cache_dir: Path | None = None,
) -> Any:
    """`load_dataset` of exactly release `version` of `repo_id`: a `DatasetDict`, or a `Dataset` for `split`.

    Works against the real Hub and a local Hub (`endpoint`, or `HF_ENDPOINT`), and offline from the cache when
    that exact tag was downloaded before; anything else raises instead of returning other data.
    """
    from datasets import load_dataset

    path = pinned_snapshot(repo_id, config, version, endpoint=endpoint, token=token, cache_dir=cache_dir)
    return load_dataset(str(path), config, split=split)
