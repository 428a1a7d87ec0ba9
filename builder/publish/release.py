"""Release versions, the release manifest and the changelog.

Versions are semantic versions (`1.2.3`, `1.2.3-rc.1`) published as git tags `v1.2.3`. Each release carries
`release.json`: its version, the previous version, the config hash and run id, content hashes of every file, the
ids it contains (so the next release can say what changed) and the changelog history.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from builder.errors import OperatorError

MANIFEST = "release.json"
MANIFEST_VERSION = 1

_SEMVER = re.compile(r"^v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$")


class PublishError(OperatorError):
    """A release cannot be exported or published as asked (bad or existing version, backend failure)."""


def parse_version(text: str) -> str:
    """The version without a leading `v`, after checking it is a semantic version.

    Raises:
        PublishError: `text` is not `MAJOR.MINOR.PATCH` with an optional `-prerelease`.
    """
    if not _SEMVER.match(text.strip()):
        raise PublishError(f"version {text!r} is not a semantic version like 0.1.0 or 1.2.0-rc.1")
    return text.strip().removeprefix("v")


def tag_of(version: str) -> str:
    return f"v{parse_version(version)}"


def version_key(version: str) -> tuple:
    """Sort key with semver precedence: 1.0.0-rc.1 < 1.0.0 < 1.0.1."""
    major, minor, patch, pre = _SEMVER.match(version).groups()  # type: ignore[union-attr]
    if pre is None:
        return (int(major), int(minor), int(patch), 1, ())
    parts = tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in pre.split("."))
    return (int(major), int(minor), int(patch), 0, parts)


def released_versions(tags: Iterable[str]) -> list[str]:
    """The versions among a repository's tags (other tags ignored), oldest first."""
    versions = [tag[1:] for tag in tags if tag.startswith("v") and _SEMVER.match(tag)]
    return sorted(versions, key=version_key)


def previous_version(version: str, tags: Iterable[str]) -> str | None:
    """The highest released version below `version`, the one its changelog is written against."""
    below = [v for v in released_versions(tags) if version_key(v) < version_key(version)]
    return below[-1] if below else None


def next_version(tags: Iterable[str]) -> str:
    """The version a new release gets by default: 0.1.0 first, then the next minor of the highest release (or
    the release a highest pre-release leads to: 0.3.0 after 0.3.0-rc.1)."""
    versions = released_versions(tags)
    if not versions:
        return "0.1.0"
    major, minor, patch, pre = _SEMVER.match(versions[-1]).groups()  # type: ignore[union-attr]
    return f"{major}.{minor}.{patch}" if pre else f"{major}.{int(minor) + 1}.0"


def file_hashes(root: Path) -> dict[str, dict]:
    """`{relative path: {sha256, bytes}}` of every file under `root` except the manifest itself."""
    hashes = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        hashes[path.relative_to(root).as_posix()] = {"sha256": digest.hexdigest(), "bytes": path.stat().st_size}
    return hashes


def data_hash(hashes: dict[str, dict]) -> str:
    """One hash over the data files only: equal for two releases with the same rows, whatever the card says."""
    lines = [f"{path} {entry['sha256']}" for path, entry in sorted(hashes.items()) if path.startswith("data/")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def changes(previous: dict | None, contents: dict[str, list[str]], counts: dict[str, int]) -> list[str]:
    """What changed since the previous release, as short human-readable lines.

    `contents` maps `environments` and `scenarios` to their ids in this release; `counts` maps `config/split`
    to row counts. `previous` is the previous release's manifest (None for the first release).
    """
    if previous is None:
        return ["First release."]
    lines = []
    for name in ("environments", "scenarios"):
        before, after = set(previous.get("contents", {}).get(name, [])), set(contents.get(name, []))
        if after - before or before - after:
            lines.append(f"{name}: {len(after - before)} added, {len(before - after)} removed ({len(after)} now).")
    for key in sorted(set(counts) | set(previous.get("counts", {}))):
        old, new = previous.get("counts", {}).get(key, 0), counts.get(key, 0)
        if old != new:
            lines.append(f"{key}: {old} → {new} rows.")
    return lines or ["No change in the data (card or metadata only)."]


def build_manifest(
    *,
    version: str,
    previous: dict | None,
    root: Path,
    config_hash: str,
    builder_version: str,
    repo: str,
    contents: dict[str, list[str]],
    counts: dict[str, int],
    history: list[dict],
    run_id: str | None = None,
) -> dict:
    """The release manifest written to `release.json` once every other file of the release exists; `run_id` is
    the run folder it was exported from (None: exported from the store alone)."""
    hashes = file_hashes(root)
    return {
        "manifest_version": MANIFEST_VERSION,
        "repo": repo,
        "version": version,
        "tag": tag_of(version),
        "previous_version": previous["version"] if previous else None,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "builder_version": builder_version,
        "config_hash": config_hash,
        "run_id": run_id,
        "data_sha256": data_hash(hashes),
        "counts": counts,
        "contents": contents,
        "changelog": history,
        "files": hashes,
    }


def history_with(previous: dict | None, version: str, lines: list[str]) -> list[dict]:
    """The changelog history of a new release: its own entry first, then the previous release's history."""
    earlier = previous.get("changelog", []) if previous else []
    return [{"version": version, "changes": lines}, *earlier]
