"""The local Hub end to end: publish two versions with the git backend, serve them with a real olah server, and
load every config and split by tag over HTTP with `datasets`, as a trainer would against the real Hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from builder.publish.publish import publish
from builder.publish.server import LocalHub

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from release_store import fill_store  # noqa: E402
from test_publish import make_config  # noqa: E402

pytestmark = pytest.mark.integration

# Runs in a fresh interpreter: HF_ENDPOINT must be set before huggingface_hub or datasets is imported.
CLIENT = textwrap.dedent(
    """
    import json, sys
    from datasets import load_dataset
    from builder.publish.loading import load_pinned
    from builder.publish.release import PublishError

    out = {}
    for version in ("v0.1.0", "v0.2.0"):
        for config in ("environments", "scenarios", "sft"):
            loaded = load_dataset("acme/envs", config, revision=version)
            out[f"{version}/{config}"] = {
                split: {"rows": data.num_rows, "features": data.features.to_dict(),
                        "ids": sorted(data[data.column_names[0]])}
                for split, data in loaded.items()
            }
    pinned = load_pinned("acme/envs", "sft", "0.1.0", split="train")
    out["pinned"] = {"rows": pinned.num_rows, "messages": pinned[0]["messages"][2]}
    try:
        load_pinned("acme/envs", "sft", "9.9.9")
        out["missing"] = "loaded"
    except PublishError as error:
        out["missing"] = str(error)
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hub")
    config = make_config(tmp_path)
    fill_store(config.store.path)
    publish(config, "0.1.0")
    fill_store(config.store.path, generation=2)
    publish(config, "0.2.0")
    with LocalHub(config.hub.root) as hub:
        yield hub, tmp_path


def test_every_config_and_split_loads_by_tag_over_http(served):
    hub, tmp_path = served
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    result = subprocess.run(
        [sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=240,
        cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rows = {key: {split: data["rows"] for split, data in value.items()} for key, value in out.items() if "/" in key}
    assert rows == {
        "v0.1.0/environments": {"train": 2, "rl": 1},
        "v0.1.0/scenarios": {"train": 4, "rl": 2},
        "v0.1.0/sft": {"train": 4},
        "v0.2.0/environments": {"train": 2, "rl": 2},
        "v0.2.0/scenarios": {"train": 4, "rl": 4},
        "v0.2.0/sft": {"train": 8},
    }
    golden = json.loads((Path(__file__).parent / "golden" / "export_features.json").read_text())
    for key, value in out.items():
        if "/" in key:
            for data in value.values():
                assert list(data["features"].items()) == [tuple(pair) for pair in golden[key.split("/")[1]]]
    v1, v2 = out["v0.1.0/environments"]["rl"]["ids"], out["v0.2.0/environments"]["rl"]["ids"]
    assert set(v1) < set(v2) and len(v2) == len(v1) + 1  # flight_desk joined the rl split in 0.2.0
    assert out["v0.1.0/environments"]["train"]["ids"] == out["v0.2.0/environments"]["train"]["ids"]
    assert set(out["v0.1.0/sft"]["train"]["ids"]) < set(out["v0.2.0/sft"]["train"]["ids"])
    assert out["pinned"]["rows"] == 4 and out["pinned"]["messages"]["tool_calls"][0]["id"] == "call-1"
    assert "has no tag v9.9.9" in out["missing"] and "v0.1.0, v0.2.0" in out["missing"]

    # Offline, the pinned loader serves exactly the cached tag, and refuses a tag it never saw (where plain
    # load_dataset would fall back to "the latest cached version").
    offline = textwrap.dedent(
        """
        import json
        from builder.publish.loading import load_pinned
        sft = load_pinned("acme/envs", "sft", "0.1.0", split="train")
        try:
            load_pinned("acme/envs", "sft", "0.3.0")
            missing = "loaded"
        except Exception as error:
            missing = type(error).__name__
        print(json.dumps({"rows": sft.num_rows, "missing": missing}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", offline], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
        timeout=240, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"rows": 4, "missing": "LocalEntryNotFoundError"}


def test_the_server_stops_and_frees_its_port(tmp_path):
    import urllib.request

    hub = LocalHub(tmp_path / "empty").start()
    pid = hub.process.pid
    hub.stop()
    assert hub.process is None
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{hub.url}/api/datasets/a/b/refs", timeout=2)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_cli_hub_serve_answers_and_stops_olah_on_sigterm(served):
    import signal
    import urllib.request

    from builder.publish.server import free_port

    hub, tmp_path = served
    port = free_port()
    args = ["-m", "builder", "hub", "serve", "--port", str(port), "--set", f"hub.root={json.dumps(str(hub.root))}"]
    process = subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[1],
    )  # fmt: skip
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[1].strip() == "datasets: acme/envs"
        assert lines[2].strip() == f"export HF_ENDPOINT=http://127.0.0.1:{port}"
        olah_pid = int(lines[0].split("olah pid ")[1].split(")")[0])
        refs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/datasets/acme/envs/refs", timeout=10))
        assert sorted(tag["name"] for tag in refs["tags"]) == ["v0.1.0", "v0.2.0"]
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert not Path(f"/proc/{olah_pid}").exists()
