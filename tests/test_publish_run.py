"""Publishing a run's release: `--run-dir RUN` alone uses the run's config and store, `--config` takes the run's
config.json, each run has its own release candidate, and nothing replaces another run's candidate or publishes
other data or another config than the run's without `--force`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import config_hash, load_config
from builder.publish.backends import GitBackend
from builder.publish.card import hub_endpoint, hub_note
from builder.publish.publish import export_after_run, export_version
from builder.publish.release import PublishError
from builder.run.folder import RunFolder

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from release_store import fill_store  # noqa: E402


def make_run(root: Path, name: str, *sets: str, store: Path | None = None) -> tuple[Path, object]:
    """A finished run folder under `root/runs/` made with its own store, Hub and split settings (not the
    defaults), its store filled and its release candidate exported, as `python -m builder run` leaves it."""
    overrides = {
        "store.path": store or root / f"{name}-store",
        "hub.root": root / "hub",
        "hub.release_root": root / "release",
        "hub.repo": "acme/envs",
    }
    config = load_config(
        None, [*(f"{key}={json.dumps(str(value))}" for key, value in overrides.items()), *sets], "none"
    )
    run_dir = root / "runs" / name
    RunFolder(run_dir).open(config)
    (run_dir / "stats.json").write_text('{"stages": {}}\n')
    if not config.store.path.exists():
        fill_store(config.store.path)
    export_after_run(config, run_dir / "stats.json")
    return run_dir, config


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """The publish runs from another folder, where the defaults (./envs_store, ./hub) hold nothing."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def test_a_run_made_with_its_own_store_and_splits_is_published_through_run_dir_alone(tmp_path, elsewhere, capsys):
    run_dir, config = make_run(tmp_path, "run-own", "select.rl_env_fraction=0.3")
    candidate = json.loads((run_dir / "release" / "0.1.0" / "release.json").read_text())
    assert main(["publish", "--version", "0.1.0", "--run-dir", str(run_dir)]) == 0
    assert "published v0.1.0" in capsys.readouterr().out
    published = json.loads(GitBackend(config.hub.root, "acme/envs").read_file("v0.1.0", "release.json"))
    assert published["config_hash"] == config_hash(config) == candidate["config_hash"]
    assert published["data_sha256"] == candidate["data_sha256"] and published["counts"] == candidate["counts"]
    assert published["run_id"] == "run-own"
    assert not (elsewhere / "envs_store").exists() and not (elsewhere / "release").exists()


def test_config_json_of_a_run_is_a_config_file(tmp_path, elsewhere, capsys):
    run_dir, config = make_run(tmp_path, "run-json", "select.rl_env_fraction=0.3")
    assert load_config(run_dir / "config.json", [], "none") == config
    assert load_config(run_dir / "config.json", [], "auto") == config  # complete: no profile key survives it
    args = ["--config", str(run_dir / "config.json"), "--run-dir", str(run_dir)]
    assert main(["publish", "--version", "0.1.0", *args]) == 0
    assert main(["config", "--config", str(run_dir / "config.json")]) == 0
    assert f"config hash {config_hash(config)}" in capsys.readouterr().out
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["config", "--config", str(tmp_path / "broken.json")]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_a_config_other_than_the_runs_is_refused_unless_forced(tmp_path, elsewhere, capsys):
    run_dir, _ = make_run(tmp_path, "run-hash", "select.rl_env_fraction=0.3")
    other = ["publish", "--version", "0.1.0", "--run-dir", str(run_dir), "--set", "select.rl_env_fraction=0.6"]
    assert main(other) == 1
    assert "was made with" in capsys.readouterr().err
    assert GitBackend(tmp_path / "hub", "acme/envs").tags() == []
    # Store and Hub settings do not change a run's output: another repository is fine.
    assert main(["publish", "--version", "0.1.0", "--run-dir", str(run_dir), "--set", "hub.repo=acme/other"]) == 0
    # Forced, the other config is published (into the run's folder, replacing its candidate).
    assert main([*other, "--force"]) == 0
    assert (
        json.loads((run_dir / "release" / "0.1.0" / "release.json").read_text())["config_hash"]
        != (json.loads((run_dir / "run.json").read_text())["config_hash"])
    )


def test_two_runs_in_one_folder_keep_their_own_candidates(tmp_path, elsewhere):
    first, first_config = make_run(tmp_path, "run-a", "select.rl_env_fraction=0.3")
    second, second_config = make_run(tmp_path, "run-b", "select.rl_env_fraction=0.6")
    one = json.loads((first / "release" / "0.1.0" / "release.json").read_text())
    two = json.loads((second / "release" / "0.1.0" / "release.json").read_text())
    assert (one["run_id"], two["run_id"]) == ("run-a", "run-b")
    assert one["config_hash"] == config_hash(first_config) != two["config_hash"] == config_hash(second_config)
    # A plain export into a folder that holds another run's release is refused, and the folder left as it was.
    with pytest.raises(PublishError, match=r"holds the release 0.1.0 of run run-a .* pass --force"):
        _export_into(second_config, first / "release")
    assert json.loads((first / "release" / "0.1.0" / "release.json").read_text()) == one


def _export_into(config, release_root: Path):
    hub = config.hub.model_copy(update={"release_root": release_root})
    return export_version(config.model_copy(update={"hub": hub}), "0.1.0")


def test_a_plain_export_replaces_its_own_but_not_another_configs(tmp_path):
    base = {"store.path": tmp_path / "store", "hub.root": tmp_path / "hub", "hub.release_root": tmp_path / "rel"}
    sets = [f"{key}={json.dumps(str(value))}" for key, value in base.items()]
    fill_store(tmp_path / "store")
    config = load_config(None, [*sets, "select.rl_env_fraction=0.3"], "none")
    other = load_config(None, [*sets, "select.rl_env_fraction=0.6"], "none")
    export_version(config, "0.1.0")
    export_version(config, "0.1.0")  # the same config again: its own export, replaced
    with pytest.raises(PublishError, match="holds the release 0.1.0 of config .* pass --force"):
        export_version(other, "0.1.0")
    out, manifest = export_version(other, "0.1.0", force=True)
    assert json.loads((out / "release.json").read_text())["config_hash"] == config_hash(other)


def test_publishing_a_run_whose_store_changed_since_its_candidate_is_refused(tmp_path, elsewhere, capsys):
    run_dir, config = make_run(tmp_path, "run-moved", "select.rl_env_fraction=0.3")
    fill_store(config.store.path, generation=2)  # e.g. another run wrote to the same store since
    args = ["publish", "--version", "0.1.0", "--run-dir", str(run_dir)]
    assert main(args) == 1
    assert "the store changed since the release candidate" in capsys.readouterr().err
    assert GitBackend(config.hub.root, "acme/envs").tags() == []
    assert main([*args, "--force"]) == 0


def test_export_with_run_dir_writes_the_runs_candidate(tmp_path, elsewhere, capsys):
    run_dir, _ = make_run(tmp_path, "run-export", "select.rl_env_fraction=0.3")
    assert main(["export", "--version", "0.1.0", "--run-dir", str(run_dir)]) == 0
    assert f"to {run_dir / 'release' / '0.1.0'}" in capsys.readouterr().out
    assert main(["publish", "--version", "0.1.0", "--run-dir", str(tmp_path / "nowhere")]) == 1
    assert "is not a run folder" in capsys.readouterr().err


def test_the_card_says_which_hub_to_point_datasets_at(tmp_path):
    fill_store(tmp_path / "store")
    base = {"store.path": tmp_path / "store", "hub.root": tmp_path / "hub", "hub.release_root": tmp_path / "rel"}
    sets = [f"{key}={json.dumps(str(value))}" for key, value in base.items()]
    config = load_config(None, [*sets, "hub.port=8123"], "none")
    out, _ = export_version(config, "0.1.0")
    card = (out / "README.md").read_text()
    assert "export HF_ENDPOINT=http://127.0.0.1:8123" in card and "python -m builder hub serve" in card
    assert "pip install builder-envs" in card and "builder-envs[openenv]" in card and "pip install builder`" not in card
    hf = config.hub.model_copy(update={"backend": "hf"})
    assert hub_endpoint(hf) is None and hub_endpoint(hf, "git") == "http://127.0.0.1:8123"
    assert "set `HF_ENDPOINT` to its address" in hub_note(None) and "Hugging Face Hub" in hub_note(None)
