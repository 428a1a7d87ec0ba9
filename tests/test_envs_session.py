"""Sessions, checks, the `env` commands and the trainer API, against the hand-made fixture environments."""

import io
import json
import time
from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.checks import CheckSpec, checks_from_file, run_checks
from builder.envs.commands import env_check, env_replay, env_schema
from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError, diff_states
from builder.envs.trainer import (
    LiveEnvironment,
    python_type,
    trl_environment_factories,
    trl_prompt_row,
    trl_reward,
)
from builder.sandbox.runtime import Sandbox, SandboxUnavailable

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
BANK = (FIXTURES / "bank.py").read_text()
LIBRARY = (FIXTURES / "library.py").read_text()
FAST = SandboxConfig(call_timeout_s=0.5, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def raw_session(sandbox, body, state=None):
    """A session on a one-tool class `T.go()` that skips the lint (to exercise the runtime itself)."""
    source = (
        "import time, itertools, collections\nclass T:\n    def __init__(self):\n        self.n = 0\n"
        "    def go(self) -> object:\n" + "".join(f"        {line}\n" for line in body.splitlines())
    )
    tool = {"type": "function", "function": {"name": "go", "description": "",
            "parameters": {"type": "object", "properties": {}, "required": []}}}  # fmt: skip
    return Session(sandbox, source, state, interface=EnvInterface(class_name="T", tools=(tool,)))


def test_state_round_trip_and_diff(sandbox):
    state = {"accounts": {"x": {"owner": "c9", "balance": 7, "kind": "savings", "frozen": False}}, "extra": [1]}
    with Session(sandbox, BANK, state) as session:
        before = session.snapshot()
        assert before["accounts"] == state["accounts"] and before["extra"] == [1]
        assert before["daily_limit"] == 50000  # __init__ defaults stay unless the state overrides them
        assert session.call("freeze_account", {"account_id": "x"}).result == {"success": True}
        changes = diff_states(before, session.snapshot())
    assert changes == [{"path": "accounts.x.frozen", "before": False, "after": True}]


def test_tool_errors_are_results(sandbox):
    with Session(sandbox, BANK, {}) as session:
        cases = [
            ("nope", "{}", "unknown_tool"),
            ("transfer", "{not json", "bad_arguments"),
            ("transfer", {"source": "acc-1"}, "bad_arguments"),
            ("get_account", {"account_id": "acc-1", "extra": 1}, "bad_arguments"),
            ("get_account", {"account_id": 5}, "bad_arguments"),
        ]
        for name, arguments, kind in cases:
            result = session.call(name, arguments)
            assert not result.ok and result.error_kind == kind and result.content().startswith("Error: ")
        assert session.call("transfer", '{"source": "acc-1", "target": "acc-2", "amount": 5}').ok


def test_raising_hanging_and_crashing_tools_keep_the_session_usable(sandbox):
    with raw_session(
        sandbox,
        "self.n += 1\nif self.n == 2:\n    raise ValueError('boom')\n"
        "if self.n == 3:\n    while True:\n        pass\n"
        "if self.n == 4:\n    import ctypes\n    ctypes.string_at(0)\nreturn self.n",
    ) as s:
        assert s.call("go").result == 1
        raised = s.call("go")
        assert raised.error_kind == "raised" and "ValueError: boom" in raised.error
        assert s.call("go").error_kind == "timeout"  # soft timeout: the worker survives
        crashed = s.call("go")
        assert crashed.error_kind == "crashed"
        # A fresh worker replayed the calls that completed (timed-out and fatal calls are not replayed).
        assert s.snapshot() == {"n": 2}


def test_hung_tool_that_ignores_signals_is_killed_at_the_deadline(sandbox):
    body = "while True:\n    try:\n        sum(range(10**12))\n    except BaseException:\n        pass"
    with raw_session(sandbox, body) as session:
        started = time.monotonic()
        result = session.call("go")
        elapsed = time.monotonic() - started
    assert result.error_kind == "timeout" and 0.9 <= elapsed < 3.0


def test_non_json_and_huge_results(sandbox):
    for body, kind in [("return object()", "not_json"), ("return float('nan')", "not_json"),
                       ("d = {}\nd['d'] = d\nreturn d", "not_json"), ("return 'x' * (8 << 20)", "too_large"),
                       ("return b'bytes'", "not_json")]:  # fmt: skip
        with raw_session(sandbox, body) as session:
            assert session.call("go").error_kind == kind, body
            assert session.snapshot() == {"n": 0}


def test_non_json_state_and_load_failures(sandbox):
    with raw_session(sandbox, "self.n = {1, 2}\nreturn 1") as session:
        session.call("go")
        with pytest.raises(SessionError):
            session.snapshot()
    with pytest.raises(SessionError) as error:
        Session(sandbox, BANK.replace("self.transfers = []", "self.transfers = 1 / 0"))
    assert error.value.kind == "load_failed" and "ZeroDivisionError" in str(error.value)


def test_crashed_zygote_is_replaced():
    with Sandbox(FAST) as runtime:
        import os
        import signal

        os.kill(runtime.zygote_pid, signal.SIGKILL)
        time.sleep(0.1)
        with Session(runtime, BANK) as session:
            assert session.call("list_accounts", {"owner": "c1"}).result == ["acc-1", "acc-2"]


def test_hundreds_of_sessions_at_once(sandbox):
    sessions = [Session(sandbox, LIBRARY, {}) for _ in range(200)]
    try:
        for i, session in enumerate(sessions):
            assert session.call("borrow", {"member_id": "m1", "book_id": "b1", "days": 1 + i % 20}).ok
        assert all(s.snapshot()["books"]["b1"]["copies"] == 1 for s in sessions)
    finally:
        for session in sessions:
            session.close()


def test_checks_and_reward(sandbox):
    checks = [
        CheckSpec(name="moved", source="def check(i, f):\n    return f['value'] == i['value'] + 1\n"),
        CheckSpec(name="truthy", source="def check(i, f):\n    return 1\n"),
        CheckSpec(name="raises", source="def check(i, f):\n    return f['missing']\n"),
        CheckSpec(name="hangs", source="def check(i, f):\n    while True:\n        pass\n"),
        CheckSpec(name="crashes", source="import ctypes\ndef check(i, f):\n    ctypes.string_at(0)\n"),
        CheckSpec(name="false", source="def check(i, f):\n    return False\n"),
        CheckSpec(name="after", source="def check(i, f):\n    return isinstance(f, dict)\n"),
    ]
    verdict = run_checks(sandbox, checks, {"value": 1}, {"value": 2})
    outcome = {c.name: (c.passed, (c.error or "").split(":")[0]) for c in verdict.checks}
    assert outcome == {
        "moved": (True, ""), "truthy": (False, "not_bool"), "raises": (False, "raised"),
        "hangs": (False, "timeout"), "crashes": (False, "crashed"), "false": (False, ""), "after": (True, ""),
    }  # fmt: skip
    assert verdict.reward == pytest.approx(2 / 7) and not verdict.solved
    assert run_checks(sandbox, checks[:1], {"value": 1}, {"value": 2}).solved


def test_refuses_when_layers_are_missing():
    with pytest.raises(SandboxUnavailable, match="no_such_layer"):
        Sandbox(SandboxConfig(required_layers=("seccomp", "no_such_layer")))


def test_env_schema_and_check_commands(tmp_path):
    out = io.StringIO()
    assert env_schema(FIXTURES / "bank.py", out=out) == 0
    assert [t["function"]["name"] for t in json.loads(out.getvalue())][0] == "get_account"
    out = io.StringIO()
    assert env_check(FIXTURES / "library.py", as_json=True, config=FAST, out=out) == 0
    assert json.loads(out.getvalue())["ok"] is True
    flaky = tmp_path / "flaky.py"
    # uuid4 and the date-time clock are deterministic in the sandbox; the performance counter is not.
    stamped = BANK.replace('transfer_id = f"t{len(self.transfers) + 1}"', "transfer_id = str(time.perf_counter_ns())")
    flaky.write_text(stamped.replace("from typing", "import time\nfrom typing").replace("amount <= 0 or", "False and"))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"customers": {}}))
    out = io.StringIO()
    assert env_check(flaky, state_path=state, as_json=True, config=FAST, out=out) == 1
    report = json.loads(out.getvalue())
    assert {p["code"] for p in report["problems"]} >= {"nondeterministic"}
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n")
    assert env_check(broken, config=FAST, out=io.StringIO()) == 1


def test_env_replay_command(tmp_path):
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "calls.json").write_text(json.dumps([
        {"name": "transfer", "arguments": {"source": "acc-1", "target": "acc-2", "amount": 250}},
        {"name": "get_account", "arguments": {"account_id": "acc-2"}},
        {"name": "explode", "arguments": {}},
    ]))  # fmt: skip
    (tmp_path / "checks.py").write_text(
        "def check_moved(initial_state, final_state):\n"
        "    before, after = initial_state['accounts']['acc-2'], final_state['accounts']['acc-2']\n"
        "    return after['balance'] == before['balance'] + 250\n"
        "def check_frozen(initial_state, final_state):\n    return final_state['accounts']['acc-1']['frozen']\n"
    )
    out = io.StringIO()
    code = env_replay(FIXTURES / "bank.py", tmp_path / "state.json", tmp_path / "calls.json",
                      tmp_path / "checks.py", as_json=True, config=FAST, out=out)  # fmt: skip
    report = json.loads(out.getvalue())
    assert code == 0 and set(report) == {"results", "final_state", "checks", "reward"}
    assert report["results"][0] == {"name": "transfer", "result": {"success": True, "transfer_id": "t1"}}
    assert report["results"][1]["result"]["account"]["balance"] == 750
    assert "unknown tool" in report["results"][2]["error"]
    assert [(c["name"], c["passed"]) for c in report["checks"]] == [("check_moved", True), ("check_frozen", False)]
    assert report["reward"] == 0.5
    assert checks_from_file((tmp_path / "checks.py").read_text())[1].function == "check_frozen"


SCENARIO = {
    "id": "scenario-1", "env_id": "bank-v0", "task": "Move 1.00 from acc-1 to acc-2.",
    "initial_state": json.dumps({"accounts": {
        "acc-1": {"owner": "c1", "balance": 100, "kind": "checking", "frozen": False},
        "acc-2": {"owner": "c1", "balance": 0, "kind": "savings", "frozen": False}}}),
    "checks": ["def check(initial_state, final_state):\n    return final_state['accounts']['acc-2']['balance'] == 100",
               "def check(initial_state, final_state):\n    return len(final_state['transfers']) == 1\n"],
}  # fmt: skip


def test_live_environment(sandbox):
    env = LiveEnvironment({"code": BANK}, SCENARIO, sandbox)
    assert env.reset() == SCENARIO["task"] and len(env.tools) == 4
    assert env.reward() == 0.0
    content = env.call("transfer", {"source": "acc-1", "target": "acc-2", "amount": 100})
    assert json.loads(content) == {"success": True, "transfer_id": "t1"}
    assert env.reward() == 1.0 and env.solved()
    env.reset()
    assert env.state()["accounts"]["acc-2"]["balance"] == 0 and env.reward() == 0.0
    env.close()


def test_trl_adapter(sandbox):
    environment = {"env_id": "bank-v0", "code": BANK, "name": "bank", "domain": "finance", "description": "Accounts."}
    factories = trl_environment_factories([environment], [SCENARIO], sandbox)
    row = trl_prompt_row(SCENARIO, environment)
    assert row["environment"] == "bank-v0" and row["scenario_id"] == "scenario-1"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"] == SCENARIO["task"]
    assert "bank (finance): Accounts." in row["prompt"][0]["content"]
    assert trl_prompt_row(SCENARIO)["prompt"] == [{"role": "user", "content": SCENARIO["task"]}]
    cls = factories[row["environment"]]
    env = cls()
    assert env.reset(**{**SCENARIO, **row}) is None  # TRL passes every column of the row
    assert "insufficient funds" in env.transfer(source="acc-1", target="acc-2", amount=1000)
    env.transfer(source="acc-1", target="acc-2", amount=100, memo="rent")
    assert trl_reward([[{"role": "assistant", "content": "Moved 1.00."}]], [env]) == [1.0]
    import inspect

    signature = inspect.signature(cls.transfer)
    assert list(signature.parameters) == ["self", "source", "target", "amount", "memo"]
    assert signature.parameters["memo"].default == "" and "Args:" in cls.transfer.__doc__
    assert python_type({"anyOf": [{"type": "string", "enum": ["a"]}, {"type": "null"}]}) is not None
    try:
        from transformers.utils import get_json_schema
    except ImportError:
        return
    derived = get_json_schema(cls.transfer)["function"]["parameters"]
    assert derived["required"] == ["source", "target", "amount"]
    assert derived["properties"]["amount"]["type"] == "integer"
