"""Publishing with the git backend: versions as tags, refusal to overwrite, dry runs, failure safety, resuming a
release whose tag is missing. The hf backend over HTTP is in test_hub_failures.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import load_config
from builder.publish.backends import GitBackend
from builder.publish.publish import export_after_run, export_version, publish
from builder.publish.release import PublishError, next_version, parse_version, previous_version, released_versions
from builder.run.folder import RunFolder

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from release_store import fill_store  # noqa: E402


def make_config(tmp_path: Path, repo: str = "acme/envs"):
    overrides = {
        "store.path": tmp_path / "store",
        "hub.root": tmp_path / "hub",
        "hub.release_root": tmp_path / "release",
        "hub.repo": repo,
    }
    sets = [f"{key}={json.dumps(str(value))}" for key, value in overrides.items()]
    return load_config(None, [*sets, "select.rl_env_fraction=0.3"])


def git(bare: Path, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", str(bare), *args], capture_output=True, text=True, check=True).stdout


def test_versions_are_semver_and_ordered():
    assert parse_version("v1.2.3") == "1.2.3" and parse_version("0.1.0-rc.1") == "0.1.0-rc.1"
    for bad in ("1.2", "01.2.3", "latest", "1.2.3.4"):
        with pytest.raises(PublishError):
            parse_version(bad)
    tags = ["v0.2.0", "v0.10.0", "v0.2.0-rc.1", "other", "v0.9.1"]
    assert released_versions(tags) == ["0.2.0-rc.1", "0.2.0", "0.9.1", "0.10.0"]
    assert previous_version("0.10.0", tags) == "0.9.1" and previous_version("0.1.0", tags) is None


def test_git_publish_two_versions_with_manifest_and_changelog(tmp_path):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    first = publish(config, "0.1.0")
    fill_store(config.store.path, generation=2)
    second = publish(config, "0.2.0")
    bare = tmp_path / "hub" / "datasets" / "acme" / "envs"
    assert sorted(git(bare, "tag", "--list").split()) == ["v0.1.0", "v0.2.0"]
    assert git(bare, "rev-parse", "v0.2.0^{commit}").strip() == second.commit == git(bare, "rev-parse", "main").strip()
    assert git(bare, "rev-parse", "v0.1.0^{commit}").strip() == first.commit
    listed = sorted(git(bare, "ls-tree", "-r", "--name-only", "v0.1.0").split())
    assert listed == sorted(first.files)
    assert "release.json" in listed and "data/sft/train-00000-of-00001.parquet" in listed
    manifest = json.loads(git(bare, "show", "v0.2.0:release.json"))
    assert manifest["previous_version"] == "0.1.0" and manifest["counts"]["sft/train"] == 8
    changes = manifest["changelog"][0]["changes"]
    assert "environments: 1 added, 0 removed (4 now)." in changes and "sft/train: 4 → 8 rows." in changes
    assert [entry["version"] for entry in manifest["changelog"]] == ["0.2.0", "0.1.0"]
    card = git(bare, "show", "v0.2.0:README.md")
    assert "### 0.2.0" in card and "- environments: 1 added, 0 removed (4 now)." in card
    for path, entry in manifest["files"].items():  # content hashes match what git holds
        blob = subprocess.run(["git", "--git-dir", str(bare), "show", f"v0.2.0:{path}"], capture_output=True).stdout
        assert len(blob) == entry["bytes"]


def test_existing_version_is_refused_and_nothing_changes(tmp_path):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    publish(config, "0.1.0")
    bare = tmp_path / "hub" / "datasets" / "acme" / "envs"
    refs = git(bare, "show-ref")
    fill_store(config.store.path, generation=2)
    with pytest.raises(PublishError, match="already has v0.1.0"):
        publish(config, "v0.1.0")
    assert git(bare, "show-ref") == refs
    assert main(["publish", "--version", "0.1.0", "--set", f"store.path={json.dumps(str(config.store.path))}",
                 "--set", f"hub.root={json.dumps(str(config.hub.root))}", "--repo", "acme/envs"]) == 1  # fmt: skip


def test_a_failed_publish_leaves_the_previous_version_intact(tmp_path, monkeypatch):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    publish(config, "0.1.0")
    bare = tmp_path / "hub" / "datasets" / "acme" / "envs"
    # A racing publisher creates v0.2.0 after our checks: the atomic ref update must refuse, not overwrite.
    git(bare, "tag", "v0.2.0", "v0.1.0")
    refs = git(bare, "show-ref")
    monkeypatch.setattr(GitBackend, "tags", lambda self: [])
    fill_store(config.store.path, generation=2)
    with pytest.raises(PublishError, match="nothing changed"):
        publish(config, "0.2.0")
    assert git(bare, "show-ref") == refs  # main and both tags exactly as before


def test_dry_run_writes_nothing(tmp_path, capsys):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = publish(config, "0.1.0", dry_run=True)
    assert result.dry_run and result.commit is None and "README.md" in result.files
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not (tmp_path / "hub").exists() and not (tmp_path / "release").exists()
    args = ["publish", "--version", "0.1.0", "--dry-run", "--set", f"store.path={json.dumps(str(config.store.path))}",
            "--set", f"hub.root={json.dumps(str(config.hub.root))}"]  # fmt: skip
    assert main(args) == 0
    assert "dry run: would publish v0.1.0" in capsys.readouterr().out
    assert not (tmp_path / "hub").exists()


def test_cli_publish_then_export_against_the_previous_version(tmp_path, capsys):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    sets = []
    for key in ("store.path", "hub.root", "hub.release_root"):
        section, name = key.split(".")
        sets += ["--set", f"{key}={json.dumps(str(getattr(getattr(config, section), name)))}"]
    assert main(["publish", "--version", "0.1.0", "--repo", "acme/envs", *sets]) == 0
    assert "published v0.1.0" in capsys.readouterr().out
    fill_store(config.store.path, generation=2)
    assert main(["export", "--version", "0.2.0", "--repo", "acme/envs", *sets]) == 0
    manifest = json.loads((tmp_path / "release" / "0.2.0" / "release.json").read_text())
    assert manifest["previous_version"] == "0.1.0"
    assert main(["publish", "--version", "nope", *sets]) == 1
    assert main(["publish", "--version", "0.3.0", "--repo", "no-slash", *sets]) == 1


def test_a_release_on_main_without_its_tag_is_tagged_not_committed_again(tmp_path):
    """The resume path the hf backend needs after a failed tag step, on git: only the tag is created."""
    config = make_config(tmp_path)
    fill_store(config.store.path)
    first = publish(config, "0.1.0")
    fill_store(config.store.path, generation=2)
    second = publish(config, "0.2.0")
    bare = tmp_path / "hub" / "datasets" / "acme" / "envs"
    git(bare, "tag", "-d", "v0.2.0")  # as if the tag step had failed
    result = publish(config, "0.2.0")
    assert result.tag_only and result.commit == second.commit
    assert git(bare, "rev-list", "--count", "main").strip() == "2"
    assert git(bare, "rev-parse", "v0.2.0^{commit}").strip() == second.commit
    assert git(bare, "rev-parse", "v0.1.0^{commit}").strip() == first.commit
    assert result.manifest == json.loads(git(bare, "show", "v0.2.0:release.json"))


def test_git_tag_only_refuses_when_main_moved(tmp_path):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    first = publish(config, "0.1.0")
    fill_store(config.store.path, generation=2)
    publish(config, "0.2.0")
    backend = GitBackend(config.hub.root, "acme/envs")
    refs = git(backend.path, "show-ref")
    with pytest.raises(PublishError, match="nothing changed"):
        backend.tag(first.commit, "v0.3.0", "Release 0.3.0")  # first.commit is no longer main's head
    assert git(backend.path, "show-ref") == refs
    assert backend.head().title == "Release 0.2.0"
    assert backend.read_file(first.commit, "release.json") == backend.read_file("v0.1.0", "release.json")


@pytest.mark.parametrize("command", [["publish"], ["export"], ["hub", "serve"]])
def test_release_commands_have_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in {"publish": ("--version", "--repo", "--backend", "--dry-run"), "export": ("--version", "--run-dir"),
                   "hub": ("--host", "--port")}[command[0]]:  # fmt: skip
        assert option in out


def test_next_version_follows_the_highest_release():
    assert next_version([]) == "0.1.0" and next_version(["other"]) == "0.1.0"
    assert next_version(["v0.1.0", "v0.3.2", "v0.10.0-rc.1"]) == "0.10.0"  # rc.1 < 0.10.0: the release comes next
    assert next_version(["v1.4.0"]) == "1.5.0"


def test_run_end_export_is_the_next_version_with_its_changelog(tmp_path):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    run_dir = tmp_path / "runs" / "run-1"
    RunFolder(run_dir).open(config)
    stats = run_dir / "stats.json"
    stats.write_text("{}")
    out, manifest = export_after_run(config, stats)  # new repository: first release, the run's candidate
    assert out == run_dir / "release" / "0.1.0" and manifest["previous_version"] is None
    assert manifest["run_id"] == "run-1"
    publish(config, "0.1.0", run_dir=run_dir)
    fill_store(config.store.path, generation=2)
    out, manifest = export_after_run(config, stats)
    assert out == run_dir / "release" / "0.2.0" and (out / "README.md").is_file()
    assert manifest["previous_version"] == "0.1.0"
    assert "environments: 1 added, 0 removed (4 now)." in manifest["changelog"][0]["changes"]


def test_an_empty_store_is_not_released(tmp_path, capsys):
    config = make_config(tmp_path)
    with pytest.raises(PublishError, match="nothing to release: .* holds no accepted environment"):
        export_version(config, "0.1.0")
    sets = [
        f"--set=store.path={json.dumps(str(config.store.path))}",
        f"--set=hub.root={json.dumps(str(config.hub.root))}",
    ]
    assert main(["publish", "--version", "0.1.0", *sets]) == 1
    assert "nothing to release" in capsys.readouterr().err
    assert not (tmp_path / "hub").exists() and not (tmp_path / "release").exists()


def test_run_end_export_survives_an_unreachable_backend(tmp_path, monkeypatch):
    config = make_config(tmp_path)
    fill_store(config.store.path)

    def offline(self):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(GitBackend, "tags", offline)
    out, manifest = export_after_run(config, tmp_path / "no-stats-yet.json")
    assert manifest["version"] == "0.1.0" and (out / "release.json").is_file()


def test_card_template_can_be_replaced_and_bad_placeholders_are_named(tmp_path):
    config = make_config(tmp_path)
    fill_store(config.store.path)
    template = tmp_path / "card.tmpl"
    template.write_text("# $title at $tag\n\nOur own card.\n")
    custom = config.model_copy(update={"hub": config.hub.model_copy(update={"card_template": template})})
    out, _ = export_version(custom, "0.1.0")
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "# envs at v0.1.0\n\nOur own card." in card
    template.write_text("$title $no_such_field\n")
    with pytest.raises(PublishError, match="no_such_field"):
        export_version(custom, "0.1.1")
    missing = config.model_copy(update={"hub": config.hub.model_copy(update={"card_template": tmp_path / "nope"})})
    with pytest.raises(PublishError, match="is not a file"):
        export_version(missing, "0.1.1")
