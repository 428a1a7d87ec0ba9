"""`python -m builder scenarios ENV.py --state S.json`: the real CLI, sandbox and client on a fixture environment;
only the model behind `--llm-url` is scripted (as in tests/test_pipeline_e2e.py)."""

import json
from pathlib import Path

import polars as pl
import pytest

from builder.cli import main
from builder.records import Scenario
from builder.tables import from_frame
from tests.test_scenarios_graph import verbaliser
from tests.test_stage_scenarios import BANK_STATE

BANK = Path(__file__).parent / "fixtures" / "envs" / "bank.py"
URL = "http://verbaliser.invalid/v1"


@pytest.fixture
def model(monkeypatch):
    scripted = verbaliser()
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: scripted)
    return scripted


pytestmark = pytest.mark.usefixtures("restore_logging")  # `main` adds handlers to the builder logger


def state_file(tmp_path, state=BANK_STATE) -> Path:
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    return path


def scenarios(tmp_path, *options, env=BANK, state=None):
    state = state or state_file(tmp_path)
    args = ["scenarios", str(env), "--state", str(state), "--out", str(tmp_path / "out"), "--profile", "none"]
    return main([*args, "--llm-url", URL, "--set", "llm.max_retries=0", *options])


def test_graph_scenarios_for_one_file_with_progress_and_a_summary(tmp_path, model, capsys):
    assert scenarios(tmp_path, "-n", "2", "--method", "graph") == 0
    captured = capsys.readouterr()
    lines = (tmp_path / "out" / "scenarios.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    records = [Scenario.model_validate({k: v for k, v in row.items() if k != "id"}) for row in rows]
    assert [r.id for r in records] == [row["id"] for row in rows]  # each line carries its record's id
    assert len(records) == 4 and {r.method for r in records} == {"graph"}
    assert all(r.initial_state["customers"]["c3"]["name"] == "Alan Turing" for r in records)  # the given state
    assert all(r.verification.verified for r in records) and len(model.requests) == 2
    assert "bank: 2 slots (2 graph)" in captured.err and "[2/2] slot" in captured.err
    assert "2 verified scenarios (4 records, one per mode)" in captured.out
    assert "graph: 2/2 slots verified, 1.0 model calls" in captured.out
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())["stages"]["scenarios"]
    assert stats["kept"] == 4 and stats["report"]["methods"]["graph"]["verified"] == 2
    assert (tmp_path / "out" / "rejections.jsonl").read_text() == ""


def test_parquet_output_reads_back_as_the_store_table(tmp_path, model, capsys):
    assert scenarios(tmp_path, "-n", "1", "--method", "graph", "--parquet") == 0
    (plain, talk) = from_frame(Scenario, pl.read_parquet(tmp_path / "out" / "scenarios.parquet"))
    assert (plain.mode, talk.mode, plain.method) == ("non_conversational", "conversational", "graph")
    assert not (tmp_path / "out" / "scenarios.jsonl").exists()


def test_no_verified_scenario_exits_1_with_the_rejections(tmp_path, capsys, monkeypatch):
    scripted = verbaliser(lambda request: {"task": "?"})  # never valid
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: scripted)
    assert scenarios(tmp_path, "-n", "1", "--method", "graph", "--set", "scenarios.repair_attempts=0") == 1
    (rejection,) = [json.loads(line) for line in (tmp_path / "out" / "rejections.jsonl").read_text().splitlines()]
    assert rejection["reason"] == "request_invalid"
    assert "rejected slots: request_invalid 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no file", "cannot read"),
        ("no class", "breaks the environment contract"),
        ("not JSON", "is not valid JSON"),
        ("no state", "holds no state"),
        ("state breaks a tool", "does not work in bank"),
    ],
)
def test_bad_inputs_are_clear_errors(tmp_path, model, capsys, case, message):
    env, state = BANK, state_file(tmp_path)
    if case == "no file":
        env = tmp_path / "missing.py"
    elif case == "no class":
        env = tmp_path / "plain.py"
        env.write_text("x = 1\n")
    elif case == "not JSON":
        state.write_text("{accounts")
    elif case == "no state":
        state.write_text("[]")
    else:
        state = state_file(tmp_path, {**BANK_STATE, "accounts": {"acc-1": "closed"}})
    assert scenarios(tmp_path, "--method", "graph", env=env, state=state) == 1
    assert message in capsys.readouterr().err
    assert model.requests == []


def test_the_state_option_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["scenarios", str(BANK)])
    assert stop.value.code == 2 and "--state" in capsys.readouterr().err


def test_an_unreachable_model_is_a_clear_error(tmp_path, capsys):
    options = ["scenarios", str(BANK), "--state", str(state_file(tmp_path)), "--out", str(tmp_path / "out")]
    code = main([*options, "--profile", "none", "--llm-url", "http://127.0.0.1:9/v1", "--set", "llm.max_retries=0",
                 "-n", "1", "--method", "graph"])  # fmt: skip
    assert code == 1
    err = capsys.readouterr().err
    assert "the model is unreachable (http://127.0.0.1:9/v1)" in err and "--llm-url" in err


def test_set_and_config_decide_the_slots_when_n_is_not_given(tmp_path, model, capsys):
    assert scenarios(tmp_path, "--method", "graph", "--set", "scenarios.per_environment=1") == 0
    assert "bank: 1 slots (1 graph)" in capsys.readouterr().err
    config = tmp_path / "config.toml"
    config.write_text("[scenarios]\nper_environment = 3\n")
    assert scenarios(tmp_path, "--method", "graph", "--config", str(config)) == 0
    assert "bank: 3 slots (3 graph)" in capsys.readouterr().err
    # -n is applied before --set, so --set has the last word.
    assert scenarios(tmp_path, "-n", "2", "--method", "graph", "--set", "scenarios.per_environment=1") == 0
    assert "bank: 1 slots (1 graph)" in capsys.readouterr().err
