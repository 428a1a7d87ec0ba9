"""The deterministic world inside the sandbox: a frozen clock at the episode's `now`, `random` and `uuid` from its
seed (builder/sandbox/world.py), and the places that pass `now` on (checks, probe, commands, trainer, prompts)."""

import io
import json
import uuid
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import SandboxConfig
from builder.envs.checks import CheckSpec, run_checks
from builder.envs.commands import env_check, env_replay
from builder.envs.probe import probe_environment
from builder.envs.schema import EnvInterface
from builder.envs.session import Session
from builder.envs.trainer import LiveEnvironment, trl_environment_factory, trl_prompt_row
from builder.records import Environment, Scenario, scenario_seed
from builder.rollout.user_sim import UserSimulator
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, derive_seed, describe_now, parse_now
from builder.stages.rollout import system_prompt
from tests.fixtures.scenarios import verification

FAST = SandboxConfig(call_timeout_s=0.5, kill_grace_s=0.5, memory_mb=256)
FIXTURES = Path(__file__).parent / "fixtures" / "envs"

# Written the way a capable model writes tools: long methods that stamp with the clock and draw ids and picks.
ORDERS = (FIXTURES / "orders.py").read_text()


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def episode(sandbox, now=DEFAULT_NOW, seed=0, source=ORDERS, interface=None):
    """Two orders in one session: the results and the final state."""
    with Session(sandbox, source, {}, interface, now=now, seed=seed) as session:
        first = session.call("place_order", {"customer": "ada", "item": "kettle"})
        second = session.call("place_order", {"customer": "bo", "item": "lamp", "quantity": 2})
        return [first.result, second.result], session.snapshot()


def test_the_fixture_is_a_long_generated_style_method():
    body = ORDERS.split("def place_order")[1].split("def list_orders")[0]
    assert len(body.splitlines()) >= 60 and "uuid.uuid4()" in body and "DateTime.now()" in body


def test_same_now_and_seed_give_identical_results_and_states(sandbox):
    results, state = episode(sandbox, "2024-03-14T10:30:00", seed=7)
    assert all(r["success"] for r in results), results
    again = episode(sandbox, "2024-03-14T10:30:00", seed=7)
    assert again == (results, state)
    first, second = (r["order"] for r in results)
    assert first["order_id"] != second["order_id"] and first["batch"] != second["batch"]  # still unique
    assert first["shelf"] != second["shelf"]  # each unseeded Random gets the next seed of the episode


def test_every_clock_reads_the_episodes_now(sandbox):
    (result, _), _ = episode(sandbox, "2031-12-31T23:59:59")
    order = result["order"]
    assert order["placed_at"] == "2031-12-31T23:59:59" and order["placed_utc"] == "2031-12-31T23:59:59+00:00"
    assert order["utcnow"] == "2031-12-31T23:59" and order["stamp"] == "2031-12-31 23:59:59"
    assert order["epoch"] == parse_now("2031-12-31T23:59:59").timestamp() == 1956527999
    assert order["epoch_ns"] == 1956527999 * 10**9 and order["local"] == [2031, 12, 31, 23, 59, 59]
    assert order["ctime"] == "Wed Dec 31 23:59:59 2031" and order["deliver_on"] == "2032-01-02"
    assert order["in_a_week"] == "Wednesday 07 January 2032" and order["parsed_back"] is True
    assert uuid.UUID(order["batch"]).time == (1956527999 * 10**7) + 0x01B21DD213814000  # uuid1 on the clock too


def test_another_now_gives_other_stamps_and_the_same_ids(sandbox):
    (early, _), _ = episode(sandbox, "2024-06-01T09:00:00")
    (late, _), _ = episode(sandbox, "2025-01-15T18:45:30")
    assert early["order"]["placed_at"] == "2024-06-01T09:00:00" and late["order"]["placed_at"] == "2025-01-15T18:45:30"
    assert early["order"]["order_id"] == late["order"]["order_id"]  # ids come from the seed, not the clock


def test_another_seed_gives_other_ids_and_picks(sandbox):
    (zero, _), _ = episode(sandbox, seed=0)
    (one, _), _ = episode(sandbox, seed=1)
    assert zero["order"]["order_id"] != one["order"]["order_id"] and zero["order"]["score"] != one["order"]["score"]
    assert zero["order"]["placed_at"] == one["order"]["placed_at"] == DEFAULT_NOW


def test_the_probe_passes_clock_and_uuid_code_and_still_catches_a_duration_clock(sandbox):
    probe = probe_environment(sandbox, ORDERS, {}, now="2024-03-14T10:30:00")
    assert probe.problems == () and probe.results[1].result["orders"][0]["placed_at"] == "2024-03-14T10:30:00"
    probe = probe_environment(sandbox, (FIXTURES / "nondeterministic.py").read_text())
    assert [p.code for p in probe.problems] == ["nondeterministic"]


def test_checks_run_at_the_given_now(sandbox):
    source = (
        "import datetime\n\ndef check(initial_state, final_state):\n"
        "    return datetime.date.today().isoformat() == final_state['day'] and datetime.datetime.now().hour == 18\n"
    )
    spec = [CheckSpec(name="today", source=source)]
    assert run_checks(sandbox, spec, {}, {"day": "2030-01-02"}, now="2030-01-02T18:00:00").solved
    assert not run_checks(sandbox, spec, {}, {"day": "2030-01-02"}).solved  # the default now is another day
    with pytest.raises(ValueError, match="ISO 8601"):
        run_checks(sandbox, spec, {}, {}, now="tomorrow")


@pytest.mark.parametrize(
    "now",
    ["tomorrow", "2024-06-01", "2024-06-01 09:00", "2024-02-30T10:00:00", "2024-06-01T09:00:00Z", "0001-01-01T00:00"],
)
def test_a_bad_now_is_refused_before_any_worker_starts(sandbox, now):
    with pytest.raises(ValueError, match="now"):
        Session(sandbox, ORDERS, {}, now=now)


def test_world_helpers():
    assert parse_now("2024-06-01T09:00").isoformat() == "2024-06-01T09:00:00"
    assert describe_now("2024-03-14T10:30:00") == "2024-03-14T10:30:00 (Thursday)"
    assert derive_seed("env-1", "2024-06-01T09:00:00") == derive_seed("env-1", "2024-06-01T09:00:00")
    assert derive_seed("env-1", "a") != derive_seed("env-1", "b") and 0 <= derive_seed("x") < 2**63
    assert scenario_seed("env-1", "2024-06-01T09:00:00") == derive_seed("env-1", "2024-06-01T09:00:00")


# ------------------------------------------------------------------------------------- hostile code (no lint)

GO = {"type": "function", "function": {"name": "go", "description": "", "parameters": {"type": "object"}}}


def unlinted(sandbox, body: str, now: str = DEFAULT_NOW):
    source = "import datetime, time, random, uuid\nclass T:\n    def go(self) -> object:\n" + "".join(
        f"        {line}\n" for line in body.splitlines()
    )
    with Session(sandbox, source, {}, EnvInterface(class_name="T", tools=(GO,)), now=now) as session:
        return session.call("go")


def test_the_patched_classes_hide_no_real_clock(sandbox):
    body = (
        "D, d = datetime.datetime, datetime.date\n"
        "class Mine(D):\n    pass\n"
        "routes = [D.now(), D.today(), D.__base__.today(), D.__mro__[1].today(), type(D.now()).now(), Mine.now(),\n"
        "          d.today(), D.fromtimestamp(time.time()), super(D, D).today(), Mine.__base__.now()]\n"
        "return [type(r).__name__ + ' ' + r.isoformat() for r in routes] + [D.__base__.__name__]"
    )
    result = unlinted(sandbox, body, now="2024-03-14T10:30:00")
    assert result.ok, result
    assert result.result == ["datetime 2024-03-14T10:30:00"] * 2 + ["date 2024-03-14"] * 2 + [
        "datetime 2024-03-14T10:30:00", "Mine 2024-03-14T10:30:00", "date 2024-03-14",
        "datetime 2024-03-14T10:30:00", "datetime 2024-03-14T10:30:00", "datetime 2024-03-14T10:30:00", "date",
    ]  # fmt: skip


def test_rebinding_the_clock_stays_in_its_own_episode(sandbox):
    body = (
        "try:\n    datetime.datetime.now = lambda: 0\nexcept TypeError:\n    pass\n"
        "time.time = lambda: 0.0\nrandom.seed = lambda *a: None\nuuid.uuid4 = lambda: 'x'\nreturn time.time()"
    )
    assert unlinted(sandbox, body).result == 0.0
    after = unlinted(sandbox, "return [time.time(), datetime.datetime.now().isoformat(), str(uuid.uuid4())[:8]]")
    fresh = unlinted(sandbox, "return [time.time(), datetime.datetime.now().isoformat(), str(uuid.uuid4())[:8]]")
    assert after.result == fresh.result and after.result[1] == DEFAULT_NOW


def test_the_known_limit_is_not_silent(sandbox):
    # The originals stay reachable through the replacement's globals (linted code may not touch dunders): a tool
    # that reads the real clock that way differs between two runs, which the determinism gates report.
    body = "return datetime.datetime.now.__func__.__globals__['_real_clock_gettime_ns'](time.CLOCK_REALTIME)"
    first, second = unlinted(sandbox, body), unlinted(sandbox, body)
    assert first.ok and first.result != second.result


# ---------------------------------------------------------------------------------- commands, trainer, prompts


def test_env_commands_take_now(tmp_path, sandbox):
    path = tmp_path / "orders.py"
    path.write_text(ORDERS)
    out = io.StringIO()
    assert env_check(path, as_json=True, config=FAST, out=out, now="2024-03-14T10:30:00") == 0
    report = json.loads(out.getvalue())
    assert report["ok"] and report["calls"][0]["result"]["order"]["placed_at"] == "2024-03-14T10:30:00"
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "calls.json").write_text(
        json.dumps([{"name": "place_order", "arguments": {"customer": "a", "item": "b"}}])
    )
    (tmp_path / "checks.py").write_text(
        "import datetime\ndef check_today(initial_state, final_state):\n"
        "    now = datetime.datetime.now().isoformat()\n"
        "    return all(o['placed_at'] == now for o in final_state['orders'].values())\n"
    )
    out = io.StringIO()
    code = env_replay(path, tmp_path / "state.json", tmp_path / "calls.json", tmp_path / "checks.py", as_json=True,
                      config=FAST, out=out, now="2030-05-05T05:05:05")  # fmt: skip
    report = json.loads(out.getvalue())
    assert code == 0 and report["reward"] == 1.0
    assert report["results"][0]["result"]["order"]["placed_at"] == "2030-05-05T05:05:05"


def test_cli_refuses_a_bad_now(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["env", "check", str(tmp_path / "x.py"), "--now", "next week"])
    assert exit_.value.code == 2 and "ISO 8601" in capsys.readouterr().err


def scenario(now: str, mode: str = "non_conversational") -> Scenario:
    return Scenario(
        provenance={"config_hash": "h"}, env_id="env-orders", mode=mode, initial_state={}, now=now,
        task="Order a kettle for ada.", user={"profile": "p", "known_up_front": "k", "reveal_when_asked": "r",
                                              "ending": "e"} if mode == "conversational" else None,
        checklist=("Has an order?",), checks=("def check(initial_state, final_state):\n    return True\n",),
        gold_actions=(), difficulty="easy", verification=verification((), 1),
    )  # fmt: skip


def test_trainer_episodes_run_at_the_rows_now_with_the_scenario_seed(sandbox):
    row = {**scenario("2024-03-14T10:30:00").model_dump(mode="json"), "scenario_id": scenario("2024-03-14T10:30:00").id}
    live = LiveEnvironment({"code": ORDERS}, row, sandbox)
    live.reset()
    placed = json.loads(live.call("place_order", {"customer": "a", "item": "b"}))["order"]
    assert placed["placed_at"] == "2024-03-14T10:30:00" and live.seed == scenario_seed("env-orders", row["now"])
    live.close()
    Factory = trl_environment_factory({"code": ORDERS}, [row], sandbox)
    instance = Factory()
    instance.reset(**trl_prompt_row(row))
    assert json.loads(instance.place_order(customer="a", item="b"))["order"]["order_id"] == placed["order_id"]
    instance.reset(scenario_id=row["scenario_id"], now="2025-02-02T02:02:02")  # the row's now wins
    assert json.loads(instance.place_order(customer="a", item="b"))["order"]["placed_at"] == "2025-02-02T02:02:02"
    instance._live.close()


def test_agent_and_user_prompts_tell_the_scenarios_now():
    env = Environment(
        provenance={"config_hash": "h"}, plan_id="p", name="orders", class_name="OrderDeskEnv", description="d",
        domain="shop", code=ORDERS, tools=[], state_schema={}, status="accepted",
    )  # fmt: skip
    for mode in ("non_conversational", "conversational"):
        text, _ = system_prompt(env, mode, "2024-03-14T10:30:00")
        assert "2024-03-14T10:30:00 (Thursday)" in text and "$now" not in text
    row = trl_prompt_row(scenario("2024-03-14T10:30:00").model_dump(mode="json"), env.model_dump(mode="json"))
    assert row["now"] == "2024-03-14T10:30:00" and "2024-03-14T10:30:00 (Thursday)" in row["prompt"][0]["content"]
    user = UserSimulator(None, scenario("2024-03-14T10:30:00", "conversational"), ["place_order"], sampling=None)
    assert "Today is 2024-03-14T10:30:00 (Thursday)" in user.system
