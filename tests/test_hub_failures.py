"""The hf backend over real HTTP: the real `HfApi` against a local fake Hub (tests/fake_hub.py) that fails at a
chosen step. Every failure is a PublishError naming the step; earlier tags never change; a release whose commit
landed but whose tag did not is finished by publishing the same version again, without a second commit."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from huggingface_hub import HfApi

from builder.cli import main
from builder.publish.backends import HfBackend
from builder.publish.publish import publish
from builder.publish.release import PublishError

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from fake_hub import Commit, FakeHub  # noqa: E402
from release_store import fill_store  # noqa: E402
from test_publish import make_config  # noqa: E402


@pytest.fixture(scope="module")
def first_release(tmp_path_factory):
    """A store (generation 1) and a Hub holding it as v0.1.0, made once: each test starts from copies."""
    tmp_path = tmp_path_factory.mktemp("first")
    config = make_config(tmp_path)
    fill_store(config.store.path)
    with FakeHub() as hub:
        publish(config, "0.1.0", target=backend(hub))
    return config.store.path, hub.repos


@pytest.fixture
def release(tmp_path, first_release):
    config = make_config(tmp_path)
    shutil.copytree(first_release[0], config.store.path)
    return config


@pytest.fixture
def hub():
    with FakeHub() as server:
        yield server


@pytest.fixture
def published(first_release):
    """A Hub that has v0.1.0; the store is still generation 1."""
    with FakeHub(first_release[1]) as server:
        yield server


def backend(hub: FakeHub) -> HfBackend:
    return HfBackend("acme/envs", api=HfApi(endpoint=hub.url, token="hf_test"))


def state(hub: FakeHub) -> tuple[dict, list[str]]:
    """The tags and main's history (titles, newest first): what a failure must leave as it was."""
    repo = hub.repos["acme/envs"]
    return dict(repo.tags), [commit.title for commit in repo.history()]


def test_two_versions_are_one_commit_and_one_tag_each(hub, release):
    first = publish(release, "0.1.0", target=backend(hub))
    assert hub.steps() == [
        "refs", "commits",  # publish: the tags, then main's head (is this release already there, untagged?)
        "create_repo", "refs", "commits", "tree", "validate", "preupload", "commit", "tag",
    ]  # fmt: skip
    fill_store(release.store.path, generation=2)
    second = publish(release, "0.2.0", target=backend(hub))
    tags, history = state(hub)
    assert tags == {"v0.1.0": first.commit, "v0.2.0": second.commit}
    assert history == ["Release 0.2.0", "Release 0.1.0", "initial commit"]
    files = hub.repos["acme/envs"].commits[second.commit].files
    assert sorted(files) == sorted([".gitattributes", *second.files])
    manifest = json.loads(files["release.json"])
    assert manifest == second.manifest and manifest["previous_version"] == "0.1.0"
    with pytest.raises(PublishError, match="already has v0.2.0"):
        publish(release, "0.2.0", target=backend(hub))


def test_files_the_new_release_no_longer_has_are_deleted(hub, tmp_path):
    hf = backend(hub)
    old, new = tmp_path / "old", tmp_path / "new"
    for folder, shard in ((old, "train-00000-of-00002.parquet"), (new, "train-00000-of-00001.parquet")):
        (folder / "data" / "sft").mkdir(parents=True)
        (folder / "README.md").write_text(folder.name)
        (folder / "data" / "sft" / shard).write_bytes(b"rows")
    hf.publish(old, "v1.0.0", "Release 1.0.0")
    commit = hf.publish(new, "v1.1.0", "Release 1.1.0")
    files = hub.repos["acme/envs"].commits[commit].files
    assert sorted(files) == [".gitattributes", "README.md", "data/sft/train-00000-of-00001.parquet"]
    assert hf.read_file("v1.0.0", "data/sft/train-00000-of-00002.parquet") == b"rows"
    assert hf.read_file("v1.1.0", "data/sft/train-00000-of-00002.parquet") is None  # not there: None, no error


# Every step up to the commit: nothing is published, and once the Hub is back the same publish succeeds.
# huggingface_hub retries 5xx and dropped connections with back-off (~23 s) on tree, commits, preupload and
# resolve, so those fail with a 4xx here.
BEFORE_THE_TAG = [
    ("refs", 500, "could not list the tags of", "The Hub or the network failed"),
    ("refs", "drop", "could not list the tags of", "RemoteProtocolError"),
    ("resolve", 403, "could not read release.json at v0.1.0 of", "write access"),
    ("commits", 403, "could not read the head of main of", "write access"),
    ("create_repo", 500, "could not create", "The Hub or the network failed"),
    ("tree", 404, "could not list the files on main of", "Check the repository name"),
    ("preupload", 401, "could not commit the release to main of", "HF_TOKEN"),
    ("commit", 500, "could not commit the release to main of", "The Hub or the network failed"),
    ("commit", "drop", "could not commit the release to main of", "RemoteProtocolError"),
]


@pytest.mark.parametrize(("step", "how", "failed", "advice"), BEFORE_THE_TAG)
def test_a_failure_before_the_tag_publishes_nothing(published, release, step, how, failed, advice):
    fill_store(release.store.path, generation=2)
    before = state(published)
    published.fail(step, how)
    with pytest.raises(PublishError) as error:
        publish(release, "0.2.0", target=backend(published))
    message = str(error.value)
    assert message.startswith(failed) and f"{published.url}/datasets/acme/envs: " in message and advice in message
    assert "Nothing was published" in message or "Nothing was tagged" in message
    assert state(published) == before
    published.fail(step, None)
    second = publish(release, "0.2.0", target=backend(published))
    assert not second.tag_only and second.manifest["previous_version"] == "0.1.0"
    assert state(published) == ({**before[0], "v0.2.0": second.commit}, ["Release 0.2.0", *before[1]])


@pytest.mark.parametrize("how", [500, 403, "drop"])
def test_a_failed_tag_names_the_commit_and_the_rerun_only_tags_it(published, release, how):
    fill_store(release.store.path, generation=2)
    first = published.repos["acme/envs"].tags["v0.1.0"]
    published.fail("tag", how)
    with pytest.raises(PublishError) as error:
        publish(release, "0.2.0", target=backend(published))
    landed = published.repos["acme/envs"].main
    message = str(error.value)
    assert message.startswith("could not create tag v0.2.0 on")
    assert f"Commit {landed} landed on main untagged" in message
    assert "python -m builder publish --version 0.2.0 --backend hf --repo acme/envs" in message
    assert state(published) == ({"v0.1.0": first}, ["Release 0.2.0", "Release 0.1.0", "initial commit"])
    assert json.loads(backend(published).read_file("v0.1.0", "release.json"))["version"] == "0.1.0"

    # Still failing: the rerun tries the tag alone, and says the same.
    published.requests.clear()
    with pytest.raises(PublishError, match=f"Commit {landed} landed on main untagged"):
        publish(release, "0.2.0", target=backend(published))
    assert published.steps()[-2:] == ["tag", "refs"] and "commit" not in published.steps()

    published.fail("tag", None)
    published.requests.clear()
    second = publish(release, "0.2.0", target=backend(published))
    assert second.tag_only and second.commit == landed
    assert "commit" not in published.steps() and "preupload" not in published.steps()
    assert state(published) == (
        {"v0.1.0": first, "v0.2.0": landed},
        ["Release 0.2.0", "Release 0.1.0", "initial commit"],
    )
    # The local release folder is what the tag holds, created_at included.
    tagged = backend(published).read_file("v0.2.0", "release.json")
    assert (release.hub.release_root / "0.2.0" / "release.json").read_bytes() == tagged
    assert second.manifest == json.loads(tagged) and second.manifest["previous_version"] == "0.1.0"


def test_a_failed_tag_listing_on_the_rerun_changes_nothing(published, release):
    published.fail("tag", 500)
    with pytest.raises(PublishError, match="landed on main untagged"):
        publish(release, "0.2.0", target=backend(published))
    published.fail("tag", None)
    before = state(published)
    published.fail("refs", 503)
    with pytest.raises(PublishError, match="could not list the tags of .*Nothing was published"):
        publish(release, "0.2.0", target=backend(published))
    assert state(published) == before


def test_a_commit_whose_answer_was_lost_is_tagged_by_the_rerun(published, release):
    published.fail("commit", "lost")  # the Hub commits, then the connection drops before the answer
    with pytest.raises(PublishError, match="if the commit landed after all, rerunning publish"):
        publish(release, "0.2.0", target=backend(published))
    landed = published.repos["acme/envs"].main
    published.fail("commit", None)
    result = publish(release, "0.2.0", target=backend(published))
    assert result.tag_only and result.commit == landed
    assert state(published)[1] == ["Release 0.2.0", "Release 0.1.0", "initial commit"]


def test_an_untagged_release_with_other_content_is_not_tagged(published, release):
    """The store changed between the failed publish and the rerun: the rerun publishes what it now exports."""
    published.fail("tag", 500)
    with pytest.raises(PublishError, match="landed on main untagged"):
        publish(release, "0.2.0", target=backend(published))
    stale = published.repos["acme/envs"].main
    published.fail("tag", None)
    fill_store(release.store.path, generation=2)
    result = publish(release, "0.2.0", target=backend(published))
    assert not result.tag_only and result.commit not in (stale, None)
    tags, history = state(published)
    assert tags["v0.2.0"] == result.commit and history[:3] == ["Release 0.2.0", "Release 0.2.0", "Release 0.1.0"]
    manifest = json.loads(published.repos["acme/envs"].commits[result.commit].files["release.json"])
    assert manifest["counts"]["sft/train"] == 8


@pytest.mark.parametrize("manifest", [None, b"not json", b"[]"])
def test_a_head_titled_like_the_release_but_without_its_manifest_is_built_upon(published, release, manifest):
    repo = published.repos["acme/envs"]
    files = {".gitattributes": b""} | ({"release.json": manifest} if manifest is not None else {})
    repo.commits["f" * 40] = Commit("f" * 40, repo.main, "Release 0.2.0", files)
    repo.main = "f" * 40
    result = publish(release, "0.2.0", target=backend(published))
    assert not result.tag_only and repo.commits[result.commit].parent == "f" * 40
    assert repo.tags["v0.2.0"] == result.commit == repo.main


def test_a_tag_made_before_its_answer_was_lost_completes_the_release(published, release):
    published.fail("tag", "lost")  # the Hub creates the tag, then the connection drops
    result = publish(release, "0.2.0", target=backend(published))
    assert published.steps()[-2:] == ["tag", "refs"]  # the tag step failed; the tags say it was made
    assert published.repos["acme/envs"].tags["v0.2.0"] == result.commit == published.repos["acme/envs"].main


def test_a_dry_run_reports_the_untagged_release_and_writes_nothing(published, release):
    published.fail("tag", 500)
    with pytest.raises(PublishError):
        publish(release, "0.2.0", target=backend(published))
    published.fail("tag", None)
    before = state(published)
    result = publish(release, "0.2.0", dry_run=True, target=backend(published))
    assert result.dry_run and result.tag_only and result.commit == published.repos["acme/envs"].main
    assert state(published) == before


def test_the_cli_reports_hub_failures_and_finishes_a_half_landed_release(published, release, monkeypatch, capsys):
    import builder.publish.publish as publish_module

    # The CLI's backend, with its HfApi pointed at the fake Hub (HF_ENDPOINT is read when huggingface_hub loads).
    monkeypatch.setattr(publish_module, "HfBackend", lambda repo, private: backend(published))
    sets = [f"--set=store.path={json.dumps(str(release.store.path))}",
            f"--set=hub.release_root={json.dumps(str(release.hub.release_root))}"]  # fmt: skip
    args = ["publish", "--version", "0.2.0", "--backend", "hf", "--repo", "acme/envs", *sets]
    published.fail("tag", 500)
    assert main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not create tag v0.2.0 on") and "landed on main untagged" in err
    assert "unexpected error" not in err and "Traceback" not in err
    published.fail("tag", None)
    assert main([*args, "--dry-run"]) == 0
    landed = published.repos["acme/envs"].main
    assert f"dry run: would tag commit {landed}, already on main, as v0.2.0" in capsys.readouterr().out
    assert main(args) == 0
    assert f"tagged commit {landed}, already on main" in capsys.readouterr().out
    assert published.repos["acme/envs"].tags["v0.2.0"] == landed
    published.fail("refs", "drop")
    assert main(args) == 1
    assert capsys.readouterr().err.startswith("error: could not list the tags of")


def test_an_unreachable_hub_is_a_publish_error(release):
    from builder.publish.server import free_port

    offline = HfBackend("acme/envs", api=HfApi(endpoint=f"http://127.0.0.1:{free_port()}", token="hf_test"))
    with pytest.raises(PublishError, match="could not list the tags of .*ConnectError.*the network failed"):
        publish(release, "0.1.0", target=offline)
