"""`python -m builder import`: EnvScaler's released format and BFCL-style classes, through the real CLI, executor,
sandbox, Parquet tables and store; the audit; the path on to rollout, select and export with a scripted agent;
hostile imported code contained.

Fixtures (tests/fixtures/imports/, written by make_envscaler.py) need the import contract: EnvScaler's classes
have TypedDicts and `__init__(self, init_config)`, BFCL's use getattr/vars and untyped parameters. Only
classes/counter_api.py passes the strict contract.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import polars as pl
import pytest

from builder.cli import main
from builder.config import SandboxConfig
from builder.envs.checks import checks_from_scenario, run_checks
from builder.llm import ScriptedModel
from builder.llm.scripted import text_reply, tool_reply
from builder.sandbox.runtime import Sandbox
from builder.stages.imports.sources import SourceError, read_envscaler
from builder.store import Store

FIXTURES = Path(__file__).parent / "fixtures" / "imports"
ENVS = FIXTURES / "envscaler_envs.json"
RL = FIXTURES / "envscaler_rl_scenarios.json"
SFT = FIXTURES / "envscaler_sft_scenarios.json"


pytestmark = pytest.mark.usefixtures("restore_logging")  # `main` adds handlers to the builder logger


def run_import(root: Path, *args: str, until: str | None = "verify") -> int:
    overrides = {"store.path": root / "store", "hub.root": root / "hub", "hub.release_root": root / "release",
                 "sandbox.call_timeout_s": 2, "llm.url": "http://agent.invalid/v1"}  # fmt: skip
    options = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    stop = ["--until", until] if until else []
    return main(["import", *args, "--profile", "none", "--run-dir", str(root / "run"), *options, *stop])


def audit_of(root: Path) -> dict:
    return json.loads((root / "run" / "audit.json").read_text())


def test_envscaler_import_reverifies_and_audits(tmp_path, capsys):
    assert run_import(tmp_path, "envscaler", str(ENVS), "--scenarios", str(RL), str(SFT)) == 0
    printed = capsys.readouterr().out
    assert "tools crashing on valid input: 1" in printed and "scenarios whose checks cannot fail" in printed
    audit = audit_of(tmp_path)
    assert audit["environments"] == {"read": 4, "unreadable": {}, "accepted": 2, "rejected": {"gates_failed": 2}}
    assert [e["env"] for e in audit["not_loading"]["items"]] == ["env_3_rl"]  # the broken class
    assert [(e["env"], e["tool"]) for e in audit["crashing_tools"]["items"]] == [("env_4_sft", "average_price")]
    assert audit["scenarios"]["rejected"] == {"already_solved": 1, "check_invalid": 1, "no_checks": 1}
    assert audit["scenarios"]["kept"] == audit["scenarios"]["unverified_solvability"] == 2
    raising = {(e["scenario"], e["error"].split(":")[0]) for e in audit["raising_checks"]["items"]}
    assert ("env_1_rl-task_2", "raised") in raising  # the check that raises (KeyError on the initial state)
    assert audit["scenarios_whose_checks_cannot_fail"]["items"] == [{"scenario": "env_1_rl-task_3"}]
    assert audit["lint_problems"]["init_arguments"] == 4 and audit["source"]["revision"].startswith("sha256:")

    store = Store(tmp_path / "store")
    envs = {env.provenance.origin.ref: env for env in store.environments()}
    assert set(envs) == {"env_1_rl", "env_2_sft"} and all(env.status == "accepted" for env in envs.values())
    assert envs["env_1_rl"].provenance.origin.split == "rl" and envs["env_2_sft"].provenance.origin.split == "train"
    assert envs["env_1_rl"].class_name == "WarehouseInventory" and envs["env_1_rl"].contract == "import"
    assert [t["function"]["name"] for t in envs["env_1_rl"].tools] == ["get_item", "remove_stock", "list_items"]
    scenarios = {s.provenance.origin.ref: s for s in store.scenarios()}
    assert set(scenarios) == {"env_1_rl-task_1", "env_1_rl-task_2"}
    kept = scenarios["env_1_rl-task_1"]
    assert kept.verification.unverified_solvability and not kept.gold_actions and kept.verification.checks_on_initial
    assert scenarios["env_1_rl-task_2"].verification.check_errors == {0: "raised: KeyError: 'C'"}

    # The adapted check reads EnvScaler's `initial_state` global: it passes only when A lost exactly 2 units.
    specs = checks_from_scenario(kept.checks)
    done = json.loads(json.dumps(kept.initial_state))
    done["items"]["A"]["stock"] -= 2
    with Sandbox(SandboxConfig()) as sandbox:
        assert run_checks(sandbox, specs, kept.initial_state, done).solved
        assert not run_checks(sandbox, specs, kept.initial_state, kept.initial_state).solved


def test_rerun_resumes_and_a_different_source_is_refused(tmp_path, capsys):
    # Every environment brings scenarios, so none asks the (unreachable) model for more.
    assert run_import(tmp_path, "envscaler", str(ENVS), "--scenarios", str(RL), str(SFT)) == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "run").glob("*.parquet")}
    assert run_import(tmp_path, "envscaler", str(ENVS), "--scenarios", str(RL), str(SFT)) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").glob("*.parquet")} == first
    capsys.readouterr()
    assert run_import(tmp_path, "envscaler", str(ENVS), "--scenarios", str(RL)) == 1
    assert "use a new --run-dir" in capsys.readouterr().err


def test_a_datasets_folder_reads_like_the_file(tmp_path):
    folder = tmp_path / "EnvScaler-191-Env"
    folder.mkdir()
    rows = json.loads(ENVS.read_text())
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    source = read_envscaler(str(folder))
    assert [env.ref for env in source.envs] == [row["env_id"] for row in rows]
    assert source.envs[0].code == rows[0]["env_class_code"] and source.revision.startswith("sha256:")


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "holds no rows"), ("[]", "holds no rows"), ("{not json", "neither JSON nor JSON Lines")],
)
def test_unreadable_sources_are_refused(tmp_path, content, message):
    path = tmp_path / "envs.json"
    path.write_text(content)
    with pytest.raises(SourceError, match=message):
        read_envscaler(str(path))
    with pytest.raises(SourceError, match="neither a file"):
        read_envscaler(str(tmp_path / "missing.json"))


def test_bad_rows_are_rejected_with_reasons(tmp_path):
    envs = tmp_path / "envs.json"
    envs.write_text(json.dumps([{"env_id": "env_9_rl"}, json.loads(ENVS.read_text())[0]]))
    scenarios = tmp_path / "scenarios.json"
    rows = [
        {"env_id": "env_1_rl", "task_id": "t1", "init_config": "{oops", "task": "x"},
        {"env_id": "env_1_rl", "task_id": "t2", "init_config": "[1]", "task": "x"},
        {"env_id": "env_7_rl", "task_id": "t3", "init_config": "{}", "task": "x"},
    ]
    scenarios.write_text(json.dumps(rows))
    source = read_envscaler(str(envs), [str(scenarios)])
    assert {(s.ref, s.reason) for s in source.skipped} == {
        ("env_9_rl", "bad_row"),
        ("t1", "bad_row"),
        ("t2", "bad_row"),
        ("t3", "env_missing"),
    }
    assert run_import(tmp_path, "envscaler", str(envs), "--scenarios", str(scenarios), until="import") == 0
    assert audit_of(tmp_path)["environments"]["unreadable"] == {"bad_row": 3, "env_missing": 1}


def test_bfcl_style_classes_with_a_default_state_file(tmp_path):
    assert run_import(tmp_path, "classes", str(FIXTURES / "classes"), until="vet") == 0
    envs = {env.provenance.origin.ref.rsplit("/", 1)[-1]: env for env in Store(tmp_path / "store").environments()}
    assert set(envs) == {"counter_api.py", "message_api.py"}
    api = envs["message_api.py"]
    assert api.class_name == "MessageAPI" and api.contract == "import"  # the helper class Message is not it
    send = next(t["function"] for t in api.tools if t["function"]["name"] == "send_message")
    assert send["parameters"]["required"] == ["receiver_id", "message"]  # `urgent` has a default
    assert "Carol" in api.code  # message_api.state.json applied after the constructor
    assert json.loads(api.state_schema and json.dumps(api.state_schema))["type"] == "object"
    with Sandbox(SandboxConfig()) as sandbox:
        from builder.envs.session import Session

        with Session(sandbox, api.code, contract="import") as session:
            assert session.snapshot()["user_map"]["Carol"] == "USR003"
            assert session.call("send_message", {"receiver_id": "USR002", "message": "hi"}).result == {
                "sent_status": True
            }
    assert audit_of(tmp_path)["lint_problems"]["forbidden_name"] >= 2  # getattr and vars: reported, not refused


def test_a_bad_state_file_is_rejected(tmp_path):
    shutil.copy(FIXTURES / "classes" / "counter_api.py", tmp_path / "api.py")
    (tmp_path / "api.state.json").write_text("[1, 2]")
    assert run_import(tmp_path / "out", "classes", str(tmp_path / "api.py"), until="import") == 0
    assert audit_of(tmp_path / "out")["environments"]["unreadable"] == {"bad_state_file": 1}


def test_hostile_imported_code_is_contained(tmp_path):
    """No lint refuses anything first under the import contract: the sandbox alone stops every attempt."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    hostile = tmp_path / "exfiltrate.py"
    port = listener.getsockname()[1]
    marker = tmp_path / "marker"
    hostile.write_text(
        (FIXTURES / "hostile" / "exfiltrate.py").read_text().replace("/tmp/builder-import-attack-marker", str(marker))
    )
    (tmp_path / "exfiltrate.state.json").write_text(json.dumps({"stolen": {"port": port}}))
    assert run_import(tmp_path / "out", "classes", str(hostile), until="vet") == 0
    audit = audit_of(tmp_path / "out")
    assert audit["environments"]["rejected"] == {"gates_failed": 1}
    crashed = {entry["tool"] for entry in audit["crashing_tools"]["items"]}
    assert {"write_marker", "connect", "spin"} <= crashed  # spawn only gets a failed os.system: see the marker
    assert not marker.exists() and not Path("x").exists()
    with pytest.raises(TimeoutError):
        listener.accept()
    listener.close()


# ------------------------------------------------------------------------------------- import → release


def agent(request):
    """Plays the warehouse: sample 0 removes 2 bolts (solves it), sample 1 removes 1 (fails), then stops."""
    if any(m.role == "tool" for m in request.messages):
        return text_reply("Task Completed")
    quantity = 2 if request.sample_index == 0 else 1
    return tool_reply(("remove_stock", {"item_id": "A", "quantity": quantity}))


def test_import_then_rollout_select_and_export(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: ScriptedModel(agent))
    rows = [row for row in json.loads(RL.read_text()) if row["task_id"] == "env_1_rl-task_1"]
    scenarios = tmp_path / "rl.json"
    scenarios.write_text(json.dumps(rows))
    assert run_import(tmp_path, "envscaler", str(ENVS), "--scenarios", str(scenarios),
                      "--set", "rollout.samples_per_scenario=2", until=None) == 0  # fmt: skip
    assert "release candidate" in capsys.readouterr().out
    trajectories = Store(tmp_path / "store").trajectories()
    assert sorted(t.solved for t in trajectories) == [False, True]
    assert all(not t.collateral for t in trajectories)  # no gold: no collateral guard
    selections = Store(tmp_path / "store").read("selections")
    assert [(s.kind, s.split) for s in selections] == [("rl", "rl")]  # env_1_rl stays in the rl split
    release = next((tmp_path / "run" / "release").iterdir())  # the run's own candidate
    published = pl.read_parquet(next(release.rglob("scenarios/rl*.parquet")))
    assert published["provenance"][0]["origin"]["ref"] == "env_1_rl-task_1"


def test_the_same_scenario_twice_is_rejected_as_a_duplicate(tmp_path):
    row = next(row for row in json.loads(RL.read_text()) if row["task_id"] == "env_1_rl-task_1")
    scenarios = tmp_path / "rl.json"
    scenarios.write_text(json.dumps([row, {**row, "task_id": "env_1_rl-task_9"}]))
    # The SFT file gives the other environments scenarios, so none asks the (unreachable) model for more.
    assert run_import(tmp_path / "once", "envscaler", str(ENVS), "--scenarios", str(scenarios), str(SFT)) == 0
    alone = tmp_path / "alone.json"
    alone.write_text(json.dumps([row]))
    assert run_import(tmp_path / "alone", "envscaler", str(ENVS), "--scenarios", str(alone), str(SFT)) == 0
    twice, once = audit_of(tmp_path / "once")["scenarios"], audit_of(tmp_path / "alone")["scenarios"]
    assert twice["kept"] == once["kept"] and twice["rejected"] == {**once["rejected"], "duplicate": 1}
