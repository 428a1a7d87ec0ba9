"""Export a release folder from the store, and publish it to a backend as a tagged version.

`export_release` writes a release folder (data shards, plots, card, manifest) atomically: a run's release goes
to `<run folder>/release/<version>/` (`release_folder`), so every run has its own candidate, and any other to
`<hub.release_root>/<version>/`. An export never silently replaces a folder that holds another run's (or another
config's) release. `publish` checks the version is new, exports, then makes one commit and one tag on the
backend; publishing a run's version refuses data other than its candidate's (the store changed since). With
`dry_run` it exports into a temporary folder, reports what would be published and writes nothing. A release
whose commit landed but whose tag did not (the Hub has no transaction over both) is finished by publishing the
same version again: its commit is found at the head of `main` and only tagged.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from builder import __version__
from builder.config import BuildConfig, config_hash
from builder.llm.weights import chatml_tools_template
from builder.publish.backends import Backend, GitBackend, HfBackend, release_files
from builder.publish.card import CHAT_TEMPLATE, TEMPLATE, CardInputs, hub_endpoint, render_card
from builder.publish.export import build_tables, write_tables
from builder.publish.plots import write_plots
from builder.publish.release import (
    MANIFEST,
    PublishError,
    build_manifest,
    changes,
    history_with,
    next_version,
    parse_version,
    previous_version,
    tag_of,
)
from builder.publish.tokens import sft_token_stats
from builder.stats import load_stats
from builder.store import Store

logger = logging.getLogger(__name__)

RUN_STATE = "run.json"  # a run folder's state, written by builder.run.folder (its run_id and config hash)


@dataclass(frozen=True)
class PublishResult:
    """What a publish did (or, for a dry run, would do)."""

    version: str
    tag: str
    location: str
    commit: str | None
    files: tuple[str, ...]
    manifest: dict
    dry_run: bool
    tag_only: bool = False  # the release was already on main, untagged: only the tag was (or would be) created


def make_backend(config: BuildConfig, backend: str | None = None, repo: str | None = None) -> Backend:
    """The backend named by `backend` (default `hub.backend`) for `repo` (default `hub.repo`)."""
    name, repo = backend or config.hub.backend, repo or config.hub.repo
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", repo):
        raise PublishError(f"repository {repo!r} is not ORG/NAME")
    if name == "git":
        return GitBackend(config.hub.root, repo)
    if name == "hf":
        return HfBackend(repo, private=config.hub.private)
    raise PublishError(f"unknown backend {name!r}; backends are git and hf")


def run_id_of(run_dir: Path) -> str:
    """The id of the run in `run_dir` (its run.json), which names the run's releases.

    Raises:
        PublishError: `run_dir` is not a run folder.
    """
    try:
        state = json.loads((Path(run_dir) / RUN_STATE).read_text())
    except (OSError, ValueError):
        raise PublishError(f"{run_dir} is not a run folder (no readable {RUN_STATE})") from None
    return str(state.get("run_id") or Path(run_dir).name)


def release_folder(config: BuildConfig, version: str, run_dir: Path | None = None) -> Path:
    """Where `version` is exported: `<run_dir>/release/<version>/` for a run's release (its candidate), else
    `<hub.release_root>/<version>/`."""
    return Path(run_dir) / "release" / version if run_dir is not None else config.hub.release_root / version


def export_release(
    config: BuildConfig,
    version: str,
    out: Path,
    *,
    repo: str | None = None,
    previous: dict | None = None,
    stats_path: Path | None = None,
    run_id: str | None = None,
    force: bool = False,
    same_data: bool = False,
    backend: str | None = None,
) -> dict:
    """Write the release folder `out` and return its manifest; it is built beside `out` and renamed into place,
    so a failed export leaves no half-written folder.

    `previous` is the previous release's manifest, for the changelog; `stats_path` a run's stats.json, for the
    card's per-stage table; `run_id` the run the release is made from (recorded in release.json); `backend`
    where it will be published (default hub.backend: the card says which Hub to load it from). An existing
    `out` is replaced only when it holds a release of the same run and config hash, and, with `same_data`,
    the same data; `force` replaces it in any case.

    Raises:
        PublishError: nothing to release, a bad card template, or `out` holds another release (see above).
    """
    version, repo = parse_version(version), repo or config.hub.repo
    store = Store(config.store.path, lock_timeout_s=config.store.lock_timeout_s)
    frames = {name: store.read_frame(name) for name in ("environments", "scenarios", "trajectories", "selections")}
    tables = build_tables(
        frames["environments"], frames["scenarios"], frames["trajectories"], frames["selections"],
        config.select.rl_env_fraction,
    )  # fmt: skip
    if not any(frame.height for frame in tables["environments"].values()):
        raise PublishError(
            f"nothing to release: the store {config.store.path} holds no accepted environment "
            f"({frames['environments'].height} stored in all); run the pipeline through evaluate first"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        manifest = _write_release(
            config, version, repo, scratch, frames, tables, previous, stats_path, run_id=run_id, backend=backend
        )
        if not force:
            _check_replaceable(out, manifest, same_data=same_data)
        if out.exists():
            shutil.rmtree(out)
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return manifest


def _write_release(
    config: BuildConfig,
    version: str,
    repo: str,
    root: Path,
    frames: dict[str, pl.DataFrame],
    tables: dict[str, dict[str, pl.DataFrame]],
    previous: dict | None,
    stats_path: Path | None,
    *,
    run_id: str | None,
    backend: str | None,
) -> dict:
    """Data shards, chat template, plots, card, then the manifest (last, since it hashes every other file)."""
    files = write_tables(tables, root, max_shard_bytes=int(config.hub.max_shard_mb * 2**20))
    shutil.copyfile(chatml_tools_template(), root / CHAT_TEMPLATE)
    tokens = sft_token_stats(tables["sft"]["train"])
    counts = {f"{c}/{s}": f.num_examples for (c, s), f in files.items()}
    contents = {
        "environments": sorted(pl.concat(list(tables["environments"].values()))["env_id"].to_list()),
        "scenarios": sorted(pl.concat(list(tables["scenarios"].values()))["scenario_id"].to_list()),
    }
    history = history_with(previous, version, changes(previous, contents, counts))
    inputs = CardInputs(
        repo=repo,
        version=version,
        previous_version=previous["version"] if previous else None,
        config_hash=config_hash(config),
        builder_version=__version__,
        license=config.hub.license,
        config=config,
        tables=tables,
        files=files,
        plots=write_plots(tables, root, tokens),
        history=history,
        stats=load_stats(stats_path) if stats_path else {},
        export_counts=export_counts(frames, tables),
        tokens=tokens,
        endpoint=hub_endpoint(config.hub, backend),
    )
    template = config.hub.card_template or TEMPLATE
    if not template.is_file():
        raise PublishError(f"hub.card_template {template} is not a file")
    (root / "README.md").write_text(render_card(inputs, template), encoding="utf-8")
    manifest = build_manifest(
        version=version,
        previous=previous,
        root=root,
        config_hash=config_hash(config),
        builder_version=__version__,
        repo=repo,
        contents=contents,
        counts=counts,
        history=history,
        run_id=run_id,
    )
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def _check_replaceable(out: Path, new: dict, *, same_data: bool) -> None:
    """Refuse to replace `out` when it holds a release other than `new`: another run's or another config's, or,
    with `same_data`, other data (the store changed since `out` was exported and shown)."""
    try:
        old = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return  # nothing there, or no readable release: nothing to lose
    ours = (new.get("run_id"), new["config_hash"])
    theirs = (old.get("run_id"), old.get("config_hash"))
    if theirs != ours:
        raise PublishError(
            f"{out} holds the release {old.get('version')} of {_origin(*theirs)}, and this export is of "
            f"{_origin(*ours)}; it was left as it is. Export elsewhere (another --run-dir or hub.release_root), "
            "or pass --force to replace it"
        )
    if same_data and old.get("data_sha256") != new["data_sha256"]:
        raise PublishError(
            f"the store changed since the release candidate {out} was exported (data {old.get('data_sha256')} "
            f"then, {new['data_sha256']} now), so this is not the release that was reviewed; it was left as it "
            "is. Inspect a new candidate with `export` first, or pass --force to publish the store as it is now"
        )


def _origin(run_id: str | None, digest: str | None) -> str:
    return f"run {run_id} (config {digest})" if run_id else f"config {digest} (no run)"


def export_counts(frames: dict[str, pl.DataFrame], tables: dict[str, dict[str, pl.DataFrame]]) -> dict[str, dict]:
    """Kept and dropped by reason at export: which stored rows did not make it into the release, and why."""
    envs = frames["environments"]
    env_dropped = envs.filter(pl.col("status") != "accepted")["status"].value_counts()
    trajectories = frames["trajectories"]
    published_envs = set(pl.concat(list(tables["environments"].values()))["env_id"].to_list())
    train_envs = set(tables["environments"]["train"]["env_id"].to_list())
    dropped = {"environment_not_accepted": 0, "environment_in_rl_split": 0, "unsolved": 0}
    for row in trajectories.select("env_id", "solved").to_dicts():
        if row["env_id"] not in published_envs:
            dropped["environment_not_accepted"] += 1
        elif row["env_id"] not in train_envs:
            dropped["environment_in_rl_split"] += 1
        elif not row["solved"]:
            dropped["unsolved"] += 1
    kept = tables["sft"]["train"].height  # the rest are solved train rows select left out (too short, too long)
    dropped["not_selected"] = max(0, trajectories.height - kept - sum(dropped.values()))
    return {
        "environments": {
            "in": envs.height,
            "kept": len(published_envs),
            "dropped": {f"status_{row['status']}": row["count"] for row in env_dropped.to_dicts()},
        },
        "sft": {"in": trajectories.height, "kept": kept, "dropped": dropped},
    }


def publish(
    config: BuildConfig,
    version: str,
    *,
    repo: str | None = None,
    backend: str | None = None,
    dry_run: bool = False,
    stats_path: Path | None = None,
    target: Backend | None = None,
    run_dir: Path | None = None,
    force: bool = False,
) -> PublishResult:
    """Export the store as `version` and publish it; refuses a version the repository already has.

    The release folder is `release_folder(config, version, run_dir)` (a temporary folder for a dry run, removed
    after). A run's release must be its candidate: when that folder already holds one, a store that changed
    since (other data) or another run's or config's release there is refused unless `force`.
    When the head of `main` already is this release, untagged (an earlier publish's tag step failed), only the
    tag is created (`tag_only`). `target` overrides the backend made from the config (tests pass one pointed at
    a local Hub).

    Raises:
        PublishError: the version is invalid or already published, or the backend failed; the message names the
            step, and the commit when one landed untagged.
    """
    version, repo = parse_version(version), repo or config.hub.repo
    tag, message = tag_of(version), f"Release {version}"
    target = target or make_backend(config, backend, repo)
    tags = target.tags()
    if tag in tags:
        raise PublishError(f"{repo} already has {tag} at {target.location()}; versions are immutable, pick a new one")
    previous = _previous_manifest(target, previous_version(version, tags))
    scratch = Path(tempfile.mkdtemp(prefix="builder-dry-run-")) if dry_run else None
    out = scratch / version if scratch else release_folder(config, version, run_dir)
    run_id = run_id_of(run_dir) if run_dir is not None else None
    try:
        manifest = export_release(
            config, version, out, repo=repo, previous=previous, stats_path=stats_path, run_id=run_id, force=force,
            same_data=run_dir is not None, backend=backend,
        )  # fmt: skip
        files = tuple(release_files(out))
        landed = _landed_release(target, message, manifest)
        if landed is not None:
            # The release folder becomes exactly what is on main (the export differs only in its created_at).
            commit, raw = landed
            (out / MANIFEST).write_bytes(raw)
            manifest = json.loads(raw)
            if not dry_run:
                target.tag(commit, tag, message)
        else:
            commit = None if dry_run else target.publish(out, tag, message)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return PublishResult(version, tag, target.location(), commit, files, manifest, dry_run, landed is not None)


def _landed_release(target: Backend, message: str, manifest: dict) -> tuple[str, bytes] | None:
    """The head of `main` and its manifest when they are this very release, committed by an earlier publish whose
    tag step failed: the head's message is the release's, and its manifest equals the new export's but for the
    time it was made. Anything else on main (another version, other content, a later commit) is None."""
    head = target.head()
    if head is None or head.title != message:
        return None
    raw = target.read_file(head.commit, MANIFEST)
    try:
        landed = json.loads(raw) if raw is not None else None
    except ValueError:
        landed = None
    if not isinstance(landed, dict):
        return None
    ignored = {"created_at"}
    if {k: v for k, v in landed.items() if k not in ignored} != {k: v for k, v in manifest.items() if k not in ignored}:
        logger.warning(
            "main's head %s is an untagged %r with other content; publishing this export on top of it",
            head.commit, message,
        )  # fmt: skip
        return None
    logger.info("main's head %s is this release, committed by an earlier publish; tagging it", head.commit)
    return head.commit, raw


def export_version(
    config: BuildConfig,
    version: str,
    repo: str | None = None,
    backend: str | None = None,
    stats_path: Path | None = None,
    *,
    run_dir: Path | None = None,
    force: bool = False,
) -> tuple[Path, dict]:
    """Export `version` to `release_folder(config, version, run_dir)` with its changelog against the repository's
    previous version (read from the backend), without publishing; returns the folder and the manifest."""
    version, repo = parse_version(version), repo or config.hub.repo
    target = make_backend(config, backend, repo)
    previous = _previous_manifest(target, previous_version(version, target.tags()))
    out = release_folder(config, version, run_dir)
    run_id = run_id_of(run_dir) if run_dir is not None else None
    manifest = export_release(
        config, version, out, repo=repo, previous=previous, stats_path=stats_path, run_id=run_id, force=force,
        backend=backend,
    )  # fmt: skip
    return out, manifest


def export_after_run(config: BuildConfig, stats_path: Path) -> tuple[Path, dict]:
    """The release candidate a finished `run` leaves: the store exported as the repository's next version, into
    the run's own folder (`<run folder>/release/<version>/`, the run folder being the one holding `stats_path`),
    so two runs never write the same candidate.

    The version is the next minor after the highest one the backend has (0.1.0 for a new repository); when the
    backend cannot be reached (e.g. the real Hub from an offline node) the candidate is exported as if the
    repository were new, and `publish` later rewrites it against the real previous version.
    """
    target = make_backend(config)
    try:
        tags = target.tags()
    except Exception as error:  # noqa: BLE001 - any backend failure only costs the changelog base here
        logger.warning("could not read the versions of %s (%s); exporting as a first release", config.hub.repo, error)
        tags = []
    version = next_version(tags)
    previous = _previous_manifest(target, previous_version(version, tags)) if tags else None
    run_dir = Path(stats_path).parent
    out = release_folder(config, version, run_dir)
    run_id = run_id_of(run_dir) if (run_dir / RUN_STATE).exists() else run_dir.name
    return out, export_release(config, version, out, previous=previous, stats_path=stats_path, run_id=run_id)


def _previous_manifest(target: Backend, version: str | None) -> dict | None:
    if version is None:
        return None
    raw = target.read_file(tag_of(version), MANIFEST)
    if raw is None:
        logger.warning("%s has no %s; the changelog starts afresh", tag_of(version), MANIFEST)
        return None
    return json.loads(raw)
