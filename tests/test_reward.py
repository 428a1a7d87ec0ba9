"""The published reward: one definition (`builder.envs.checks.published_reward`) with the collateral guard stored
as a check (`builder.envs.guard`), the same number through every path that grades, the reward audit's cases
(`builder.envs.audit`), and `python -m builder reward`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import SandboxConfig
from builder.envs.audit import audit_reward
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.guard import (
    GUARD_ITEM,
    allowed_paths,
    blank_fields,
    collateral,
    guard_source,
    is_guard,
    stored_blank,
)
from builder.envs.schema import inspect_source
from builder.envs.session import Session
from builder.envs.trainer import LiveEnvironment
from builder.records import Action
from builder.rollout.reward import gold_paths, grade, with_guard
from builder.sandbox.runtime import Sandbox
from tests.fixtures.scenarios import BANK_CHECKS, BANK_GOLD, BANK_STATE, bank_scenario, environment

pytestmark = pytest.mark.usefixtures("restore_logging")

BANK = Path(__file__).parent / "fixtures" / "envs" / "bank.py"
ALREADY_TRUE = (
    "def check(initial_state, final_state):\n    return final_state['accounts']['acc-1']['frozen'] is False\n"
)
# A clinic whose bookings are keyed by slot; `note` may be a string or null, `at` is an ISO date-time.
CLINIC = '''"""A clinic's appointment slots."""


class ClinicEnv:
    """Slots keyed by id; each booking is logged."""

    def __init__(self):
        self.slots = {}
        self.log = []

    def book(self, slot_id: str, patient: str, at: str, note: str | None = None) -> dict:
        """Book a slot.

        Args:
            slot_id: The slot, e.g. "s1".
            patient: Who comes.
            at: When, ISO 8601 date-time.
            note: A note for the doctor, or null for none.

        Returns:
            {"success": true} or {"success": false, "error": ...}.
        """
        slot = self.slots.get(slot_id)
        if slot is None:
            return {"success": False, "error": f"no slot {slot_id}"}
        slot.update(patient=patient, at=at, note=note)
        self.log.append(slot_id)
        return {"success": True}
'''
CLINIC_STATE = {
    "slots": {
        "s1": {"patient": "", "at": "", "note": None},
        "s2": {"patient": "", "at": "", "note": None},
        "s3": {"patient": "", "at": "", "note": None},
    },
    "log": [],
}
CLINIC_GOLD = (
    Action(name="book", arguments={"slot_id": "s1", "patient": "Ana", "at": "2025-02-11T09:20:00", "note": ""}),
    Action(name="book", arguments={"slot_id": "s2", "patient": "Bo", "at": "2025-02-11T10:00:00", "note": ""}),
)
BOOKED = "def check(initial_state, final_state):\n    return final_state['slots']['s1']['patient'] == 'Ana'\n"
BOOKED_BO = "def check(initial_state, final_state):\n    return final_state['slots']['s2']['patient'] == 'Bo'\n"
# Checks a capable model writes that test the gold's incidental choices rather than the task.
EXACT_TIME = (
    "def check(initial_state, final_state):\n    return final_state['slots']['s1']['at'] == '2025-02-11T09:20:00'\n"
)
EMPTY_NOTE = "def check(initial_state, final_state):\n    return final_state['slots']['s1']['note'] == ''\n"
LOG_ORDER = "def check(initial_state, final_state):\n    return final_state['log'] == ['s1', 's2']\n"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(call_timeout_s=5.0, kill_grace_s=1.0, memory_mb=256)) as runtime:
        yield runtime


def run_calls(sandbox, code, state, calls) -> dict:
    with Session(sandbox, code, state) as session:
        for call in calls:
            session.call(call.name, call.arguments)
        return session.snapshot()


def guarded_bank_checks(sandbox) -> list[str]:
    return with_guard(BANK_CHECKS, gold_paths(sandbox, BANK.read_text(), BANK_STATE, BANK_GOLD))


# ------------------------------------------------------------------------------------------ the definition


def reward_of(sandbox, checks, final) -> float:
    return published_reward(sandbox, checks_from_scenario(checks), BANK_STATE, final).reward


def test_doing_nothing_scores_exactly_zero_and_the_gold_one(sandbox):
    checks = guarded_bank_checks(sandbox)
    assert reward_of(sandbox, checks, BANK_STATE) == 0.0
    gold_final = run_calls(sandbox, BANK.read_text(), BANK_STATE, BANK_GOLD)
    verdict = published_reward(sandbox, checks_from_scenario(checks), BANK_STATE, gold_final)
    assert (verdict.reward, verdict.solved, verdict.guarded, verdict.counted) == (1.0, True, True, (True, True, False))


def test_a_check_already_true_on_the_initial_state_pays_nothing_but_breaking_it_costs_everything(sandbox):
    checks = [*guarded_bank_checks(sandbox), ALREADY_TRUE]
    assert reward_of(sandbox, checks, BANK_STATE) == 0.0  # it holds, but doing nothing earns no credit for it
    half = json.loads(json.dumps(BANK_STATE))
    half["accounts"]["acc-2"]["balance"] += 300  # one of the two counted checks
    assert reward_of(sandbox, checks, half) == 0.5
    frozen = json.loads(json.dumps(half))
    frozen["accounts"]["acc-1"]["frozen"] = True  # an invariant the task kept true is broken
    assert reward_of(sandbox, checks, frozen) == 0.0


def test_collateral_damage_zeroes_the_reward_through_the_guard_check(sandbox):
    checks = guarded_bank_checks(sandbox)
    assert is_guard(checks[-1]) and not any(is_guard(c) for c in checks[:-1])
    extra = [*BANK_GOLD, Action(name="freeze_account", arguments={"account_id": "acc-3"})]
    final = run_calls(sandbox, BANK.read_text(), BANK_STATE, extra)
    verdict = published_reward(sandbox, checks_from_scenario(checks), BANK_STATE, final)
    assert verdict.checks[0].passed and verdict.checks[1].passed  # the task's own checks cannot see it
    assert (verdict.guarded, verdict.reward, verdict.solved) == (False, 0.0, False)


def test_the_guard_allows_what_the_gold_changes_and_nothing_else():
    source = guard_source(["accounts.acc-1.balance", "transfers"])
    namespace: dict = {}
    exec(compile(source, "guard", "exec"), namespace)  # the test's own source, not generated code
    check = namespace["check"]
    state = {"accounts": {"acc-1": {"balance": 1}, "acc-2": {"balance": 2}}, "transfers": []}
    moved = {"accounts": {"acc-1": {"balance": 0}, "acc-2": {"balance": 2}}, "transfers": [{"id": "t1"}]}
    assert check(state, state) and check(state, moved)
    assert not check(state, {**moved, "accounts": {"acc-1": {"balance": 0}, "acc-2": {"balance": 3}}})
    assert allowed_paths(state, moved) == ["accounts.acc-1.balance", "transfers"]


def test_a_record_the_gold_creates_gets_no_value_the_gold_left_empty():
    """Teacher-16's review: an invented phone number on a new guest profile and an end date nobody asked for on
    a new schedule earned 1.0; the gold left both empty."""
    state = {"guests": {"G-1": {"name": "Leila", "phone": "+34 600"}}, "bookings": {}}
    gold = {"guests": {**state["guests"], "G-2": {"name": "Nadia", "phone": "", "diet": None}},
            "bookings": {"B-1": {"guests": ["G-1", "G-2"], "notes": ""}}}  # fmt: skip
    blank = blank_fields(state, gold)
    assert blank == [[["guests", "G-2"], ["phone", "diet"]], [["bookings", "B-1"], ["notes"]]]
    namespace: dict = {}
    exec(compile(guard_source(allowed_paths(state, gold), blank), "guard", "exec"), namespace)  # the test's source
    check = namespace["check"]
    assert check(state, gold) and check(state, state)
    invented_phone = {**gold, "guests": {**gold["guests"], "G-2": {"name": "Nadia", "phone": "+34 611", "diet": None}}}
    assert not check(state, invented_phone)
    assert collateral(state, invented_phone, allowed_paths(state, gold), blank) == ["guests.G-2.phone"]
    # What a stored scenario's guard says is read back for the trajectory's report; an older guard has none.
    assert stored_blank(["def check(i, f):\n    return True\n", guard_source([], blank)]) == blank
    assert stored_blank([guard_source([])]) == [] and stored_blank([]) == []


# ------------------------------------------------------------------------------- one number through every path


def test_the_same_calls_get_the_same_reward_through_every_path(sandbox, tmp_path, capsys):
    """Rollout grading, the trainer API (which the OpenEnv adapter uses), the verifiers adapter's grading and the
    CLI give one trajectory the same reward: here a partial one, and one with collateral damage."""
    from builder.adapters.verifiers import ScenarioData
    from builder.adapters.verifiers import grade as verifiers_grade

    env = environment("bank")
    scenario = bank_scenario().model_copy(update={"checks": tuple(guarded_bank_checks(sandbox))})
    partial = [Action(name="transfer", arguments={"source": "acc-1", "target": "acc-2", "amount": 200})]
    damage = [*BANK_GOLD, Action(name="freeze_account", arguments={"account_id": "acc-2"})]
    for calls, expected in ((partial, 0.0), (BANK_GOLD, 1.0), (damage, 0.0), ([], 0.0)):
        final = run_calls(sandbox, env.code, BANK_STATE, calls)
        rollout = grade(sandbox, scenario.checks, BANK_STATE, final, None, now=scenario.now, seed=scenario.seed)
        live = LiveEnvironment(env.model_dump(), json.loads(scenario.model_dump_json()), sandbox)
        live.reset()
        for call in calls:
            live.call(call.name, call.arguments)
        trainer = live.reward()
        live.close()
        data = ScenarioData(
            scenario_id=scenario.id, env_id=env.id, code=env.code, initial_state=BANK_STATE,
            checks=list(scenario.checks), now=scenario.now,
        )  # fmt: skip
        verifiers = verifiers_grade(data, final)
        (tmp_path / "s.json").write_text(scenario.model_dump_json())
        (tmp_path / "c.json").write_text(json.dumps([call.model_dump() for call in calls]))
        capsys.readouterr()
        code = main(["reward", str(BANK), "--scenario", str(tmp_path / "s.json"), "--calls", str(tmp_path / "c.json"),
                     "--json", "--profile", "none"])  # fmt: skip
        cli = json.loads(capsys.readouterr().out)["reward"]
        assert code == 0 and rollout.reward == trainer == verifiers == cli == expected, calls


# ---------------------------------------------------------------------------------------------- the audit


def clinic_audit(sandbox, *checks: str):
    tools = inspect_source(CLINIC).tools
    final = run_calls(sandbox, CLINIC, CLINIC_STATE, CLINIC_GOLD)
    guarded = [*checks, guard_source(allowed_paths(CLINIC_STATE, final))]
    return audit_reward(sandbox, CLINIC, CLINIC_STATE, guarded, CLINIC_GOLD, tools)


def test_a_sound_scenario_passes_every_case(sandbox):
    audit = clinic_audit(sandbox, BOOKED, BOOKED_BO)
    assert audit.reason is None, audit
    assert audit.outcomes == {"nothing": "pass", "gold": "pass", "collateral": "pass", "order": "pass",
                              "spelling": "pass"}  # fmt: skip
    assert audit.rewards["nothing"] == 0 and audit.rewards["gold"] == 1 and audit.rewards["collateral"] < 1


def test_a_check_true_on_the_initial_state_alone_is_a_reward_for_nothing(sandbox):
    already = "def check(initial_state, final_state):\n    return 's3' in final_state['slots']\n"
    audit = clinic_audit(sandbox, already)  # every check holds before any call: the task is already solved
    assert (audit.reason, audit.rewards["nothing"]) == ("reward_for_nothing", 1.0)


def test_checks_on_the_golds_incidental_choices_fail_the_audit(sandbox):
    assert clinic_audit(sandbox, BOOKED, EXACT_TIME).reason == "spelling_sensitive"
    assert clinic_audit(sandbox, BOOKED, EMPTY_NOTE).reason == "spelling_sensitive"
    assert clinic_audit(sandbox, BOOKED, LOG_ORDER).reason == "order_sensitive"


def test_a_scenario_without_a_guard_rewards_collateral_and_fails_the_audit(sandbox):
    tools = inspect_source(CLINIC).tools
    audit = audit_reward(sandbox, CLINIC, CLINIC_STATE, [BOOKED, BOOKED_BO], CLINIC_GOLD, tools)
    assert (audit.reason, audit.outcomes["collateral"]) == ("collateral_rewarded", "fail")


def test_a_gold_the_checks_do_not_reward_fails_the_audit(sandbox):
    wrong = "def check(initial_state, final_state):\n    return final_state['slots']['s1']['patient'] == 'Cy'\n"
    assert clinic_audit(sandbox, wrong).reason == "gold_not_rewarded"


# ------------------------------------------------------------------------------------------- the command


def write(tmp_path, name, value) -> str:
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


def test_the_command_prints_each_check_and_derives_the_guard_of_an_older_scenario(tmp_path, capsys):
    scenario = write(tmp_path, "s.json", bank_scenario().model_dump_json())  # made before the guard existed
    calls = write(tmp_path, "c.json", [{"name": "transfer", "arguments": {"source": "acc-1", "target": "acc-2",
                                                                         "amount": 300}}])  # fmt: skip
    assert main(["reward", str(BANK), "--scenario", scenario, "--calls", calls, "--profile", "none"]) == 0
    out = capsys.readouterr().out
    assert "pass  [counted] Has acc-2 balance increased by 300 cents" in out
    assert "pass  [guard] (collateral guard derived from the gold)" in out and "reward 1.000 (solved)" in out


def test_a_published_row_with_json_text_columns_is_read(tmp_path, capsys, sandbox):
    row = json.loads(bank_scenario().model_dump_json())
    row["initial_state"] = json.dumps(row["initial_state"])
    row["gold_actions"] = [{"name": a["name"], "arguments": json.dumps(a["arguments"])} for a in row["gold_actions"]]
    row["checks"] = guarded_bank_checks(sandbox)
    row["checklist"] = [*row["checklist"], GUARD_ITEM]
    scenario, calls = write(tmp_path, "row.json", row), write(tmp_path, "c.json", [])
    assert main(["reward", str(BANK), "--scenario", scenario, "--calls", calls, "--json", "--profile", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["reward"] == 0.0 and [c["guard"] for c in report["checks"]] == [False, False, True]


@pytest.mark.parametrize(
    ("scenario", "calls", "env", "message"),
    [
        ("not json", [], BANK, "is not valid JSON"),
        ([1, 2], [], BANK, "expected one scenario as a JSON object"),
        ({"task": "x"}, [], BANK, "is not a scenario"),
        (None, [{"name": "rob_bank", "arguments": {}}], BANK, "calls ['rob_bank'], not tools of bank.py"),
        (None, {"name": "transfer"}, BANK, "expected a JSON list"),
        (None, [], Path(__file__).parent / "fixtures" / "envs" / "library.py", "a scenario of another environment"),
    ],
)
def test_bad_input_exits_1_with_a_clear_error(tmp_path, capsys, scenario, calls, env, message):
    scenario = write(tmp_path, "s.json", bank_scenario().model_dump_json() if scenario is None else scenario)
    calls = write(tmp_path, "c.json", calls)
    assert main(["reward", str(env), "--scenario", scenario, "--calls", calls, "--profile", "none"]) == 1
    assert message in capsys.readouterr().err


def test_collateral_also_comes_from_other_tools_on_records_the_gold_never_names(sandbox):
    """When re-aiming the gold's own writes is refused (a booked slot, a past date), the audit tries one call of each
    tool on the records the gold does not name: any write outside the task is collateral (teacher-9: the case ran on
    3 of 18 slots before, 24 of 32 rows after)."""
    from builder.envs.audit import _other_tool_variants

    tools = inspect_source(BANK.read_text()).tools
    extra = [variant[-1] for variant in _other_tool_variants(BANK_GOLD, tools, BANK_STATE)]
    variants = {call.name: call.arguments for call in extra}
    assert variants["freeze_account"] == {"account_id": "acc-3"}  # acc-1 and acc-2 are the task's
    frozen = {**BANK_STATE, "accounts": {**BANK_STATE["accounts"], "acc-3": {**BANK_STATE["accounts"]["acc-3"]}}}
    audit = audit_reward(sandbox, BANK.read_text(), frozen, guarded_bank_checks(sandbox), BANK_GOLD, tools)
    assert audit.outcomes["collateral"] == "pass" and audit.rewards["collateral"] == 0.0
