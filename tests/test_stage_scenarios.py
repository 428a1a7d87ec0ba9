"""The scenarios stage with a scripted model over the hand-written fixture environments and a real sandbox."""

import ast
import json
import re
from pathlib import Path

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.envs.guard import GUARD_ITEM, is_guard
from builder.envs.schema import inspect_source
from builder.envs.state_schema import generated_state_schema, infer_schema, reference_problems
from builder.evidence import Ablation
from builder.llm import ChatRequest, ScriptedModel
from builder.llm.connect import client_for
from builder.records import Environment, Scenario
from builder.reports import ScenariosReport
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.state import attribute_problems, size_problems
from builder.stages.scenarios.verify import lint_check
from builder.stats import StageStats
from builder.store import Store
from builder.tables import to_row
from builder.views.budget import prompt_budgets
from tests.fixtures.run_tables import pipeline_stage

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
# Deadlines with room for a loaded CI machine; the hanging-check test still ends within a few seconds.
FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def environment(name: str, status: str = "accepted", state_schema: dict | None = None) -> Environment:
    code = (FIXTURES / f"{name}.py").read_text()
    interface = inspect_source(code)
    return Environment(
        provenance={"config_hash": "hash"},
        plan_id=f"plan-{name}",
        name=name,
        class_name=interface.class_name,
        description=f"The {name} fixture.",
        domain="test",
        code=code,
        tools=list(interface.tools),
        state_schema=state_schema or {},  # empty: the stage infers it from the class's default state
        status=status,
    )


LIBRARY_SCHEMA = {
    "books": {"type": "object", "additionalProperties": {
        "type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "copies": {"type": "integer"}},
        "required": ["title", "author", "copies"]}},
    "members": {"type": "object", "additionalProperties": {
        "type": "object", "properties": {"name": {"type": "string"}, "max_loans": {"type": "integer"},
                                         "fines_cents": {"type": "integer"}},
        "required": ["name", "max_loans", "fines_cents"]}},
    "loans": {"type": "array", "items": {
        "type": "object", "properties": {"member_id": {"type": "string"}, "book_id": {"type": "string"},
                                         "due": {"type": "string"}, "returned": {"type": "boolean"}},
        "required": ["member_id", "book_id", "due", "returned"]}},
    "today": {"type": "string"},
}  # fmt: skip

NOW = "2024-03-14T10:30:00"  # the scripted model's "today" for every state
BANK_STATE = {
    "customers": {"c1": {"name": "Ada Lovelace", "tier": "gold"}, "c2": {"name": "Grace Hopper", "tier": "basic"},
                  "c3": {"name": "Alan Turing", "tier": "basic"}},
    "accounts": {"acc-1": {"owner": "c1", "balance": 10000, "kind": "checking", "frozen": False},
                 "acc-2": {"owner": "c1", "balance": 500, "kind": "savings", "frozen": False},
                 "acc-3": {"owner": "c2", "balance": 2500, "kind": "checking", "frozen": False},
                 "acc-4": {"owner": "c3", "balance": 0, "kind": "savings", "frozen": False}},
    "transfers": [],
    "daily_limit": 50000,
}  # fmt: skip
MOVED_IN = "Has acc-2's balance increased by 3000 cents?"
MOVED_OUT = "Has acc-1's balance decreased by 3000 cents?"
FROZEN = "Has account acc-2 been frozen?"
TASK = {
    "task": "I'm Ada Lovelace, customer c1. Move 30.00 from my checking account acc-1 to my savings account acc-2, "
    "then freeze the savings account.",
    "difficulty": "medium",
    "user_profile": "Ada, a busy engineer who writes short messages.",
    "known_up_front": "Wants to move 30.00 to savings and freeze the savings account.",
    "reveal_when_asked": "Accounts acc-1 (checking) and acc-2 (savings); customer id c1.",
    "ending": "Says thanks and stops once both are confirmed.",
    "checklist": [MOVED_IN, MOVED_OUT, FROZEN],
}
CHECKS = {
    MOVED_IN: "def check(initial_state, final_state):\n"
    "    return final_state['accounts']['acc-2']['balance'] == initial_state['accounts']['acc-2']['balance'] + 3000\n",
    MOVED_OUT: "def check(initial_state, final_state):\n"
    "    return final_state['accounts']['acc-1']['balance'] == initial_state['accounts']['acc-1']['balance'] - 3000\n",
    FROZEN: "def check(initial_state, final_state):\n    return final_state['accounts']['acc-2']['frozen'] is True\n",
}
GOLD = [
    {"name": "list_accounts", "arguments": {"owner": "c1"}},
    {"name": "get_account", "arguments": {"account_id": "acc-1"}},
    {"name": "transfer", "arguments": {"source": "acc-1", "target": "acc-2", "amount": 3000}},
    {"name": "freeze_account", "arguments": {"account_id": "acc-2"}},
]


def schema_name(request: ChatRequest) -> str:
    return request.response_format["json_schema"]["name"] if request.response_format else ""


def replies(values: list):
    """Successive replies, one per request; the last one repeats."""
    queue = list(values)
    return lambda: queue.pop(0) if len(queue) > 1 else queue[0]


def scripted(state=BANK_STATE, task=TASK, checks=CHECKS, gold=(GOLD,)):
    """A model answering the four requests of the stage; `state`, `task` and `gold` may be lists of successive
    replies (for repairs), `checks` maps a checklist item to its code (or a list of successive codes)."""
    states, golds = replies([state] if isinstance(state, dict) else state), replies(list(gold))
    tasks = replies(task if isinstance(task, list) else [task])
    check_queues = {item: replies(code if isinstance(code, list) else [code]) for item, code in checks.items()}

    def answer(request: ChatRequest):
        name = schema_name(request)
        if name == "InitialState":
            state = states()
            return json.dumps(state if "now" in state else {"now": NOW, "state": state})
        if name == "TaskDraft":
            return json.dumps(tasks())
        if name == "GoldSolution":
            return json.dumps({"actions": golds()})
        if name == "CheckCodes":
            return json.dumps({"checks": [check_queues[item]() for item in checklist_of(request)]})
        if name == "CheckCode":  # a repair: the refused item is quoted in the last message
            item = re.search(r"^Check \d+ \((.*)\) was refused", request.messages[-1].content, re.M)[1]
            return json.dumps({"code": check_queues[ast.literal_eval(item)]()})
        raise AssertionError(f"unexpected request {name!r}")

    return ScriptedModel(answer)


def checklist_of(request: ChatRequest) -> list[str]:
    """The items of a CheckCodes request, from its numbered "## Checklist" section."""
    section = request.messages[1].content.rsplit("## Checklist (", 1)[1].split("\n", 1)[1]
    return [line.split(". ", 1)[1] for line in section.splitlines()]


def context(tmp_path, model, sandbox, *overrides):
    plain = "scenarios.families={plain=1}"  # the families have their tests (tests/test_scenario_families.py)
    config = load_config(None, [f'store.path="{tmp_path / "store"}"', "scenarios.per_environment=1", plain, *overrides])
    llm = client_for(config.llm, model, model_id="m")
    return StageContext(
        config,
        "hash",
        tmp_path,
        StageStats("scenarios", report=ScenariosReport()),
        llm=llm,
        open_sandbox=lambda: sandbox,
    )


def requests_of(model, name):
    return [r for r in model.requests if schema_name(r) == name]


async def test_good_scenario_is_kept_in_both_modes_with_its_evidence(tmp_path, sandbox):
    model = scripted()
    results = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    plain, talk = results
    assert isinstance(plain, Scenario) and (plain.mode, talk.mode) == ("non_conversational", "conversational")
    assert plain.user is None and talk.user.reveal_when_asked.startswith("Accounts acc-1")
    assert plain.initial_state["accounts"]["acc-3"]["balance"] == 2500 and plain.initial_state == talk.initial_state
    assert [a.name for a in plain.gold_actions] == [g["name"] for g in GOLD]
    # The task's checks, then the collateral guard derived from what the gold changed (builder.envs.guard).
    assert plain.checks[:-1] == tuple(CHECKS[item] for item in TASK["checklist"]) and is_guard(plain.checks[-1])
    assert plain.checklist == (*TASK["checklist"], GUARD_ITEM)
    evidence = plain.verification
    assert evidence.verified and evidence.checks_on_final == (True, True, True, True)
    assert evidence.checks_on_initial == (False, False, False, True)
    assert evidence.state_changing_calls == (2, 3)
    assert evidence.negative_control == (
        Ablation(removed=2, name="transfer", failing_checks=(0, 1)),
        Ablation(removed=3, name="freeze_account", failing_checks=(2,)),
    )
    assert evidence.vacuous_checks == () and evidence.repairs == ()
    assert {"path": "accounts.acc-2.frozen", "before": False, "after": True} in evidence.gold_state_changes
    stored = json.loads(to_row(plain)["verification"])  # the keys, in the order the untyped evidence had them
    assert list(stored) == [
        "verified", "scenario_group", "gold", "state_changing_calls", "gold_state_changes", "checks_on_initial",
        "checks_on_final", "negative_control", "vacuous_checks", "model_difficulty", "state_repairs", "repairs",
    ]  # fmt: skip
    assert list(stored["gold"][0]) == ["name", "ok", "state_changed", "result"]
    assert stored["negative_control"][0] == {"removed": 2, "name": "transfer", "failing_checks": [0, 1]}
    assert [(call.name, call.ok, call.state_changed) for call in evidence.gold] == [
        ("list_accounts", True, False), ("get_account", True, False),
        ("transfer", True, True), ("freeze_account", True, True),
    ]  # fmt: skip
    assert plain.difficulty == "medium"  # two state changes, four calls
    assert plain.provenance.parent_ids == (environment("bank").id,)
    assert plain.provenance.prompt_version.count("@") == 5  # state, writers' system message, task, check, gold


async def test_not_accepted_environments_are_rejected(tmp_path, sandbox):
    with pytest.raises(Rejected) as verdict:
        await scenarios(environment("bank", status="candidate"), context(tmp_path, scripted(), sandbox))
    assert verdict.value.rejection.reason == "not_accepted"


async def test_state_that_breaks_a_tool_is_repaired_then_rejected(tmp_path, sandbox):
    # The schema accepts any string for `today`, but borrow() cannot parse this one: a tool raises on the state.
    state = {
        "books": {f"b{i}": {"title": f"Book {i}", "author": "A. Author", "copies": 2} for i in range(3)},
        "members": {f"m{i}": {"name": f"Member {i}", "max_loans": 2, "fines_cents": 0} for i in range(3)},
        "loans": [{"member_id": "m1", "book_id": f"b{i}", "due": "2024-05-20", "returned": False} for i in range(3)],
        "today": "the first of May",
    }
    model = scripted(state=state)
    env = environment("library", state_schema=LIBRARY_SCHEMA)
    (rejection,) = await scenarios(env, context(tmp_path, model, sandbox, "scenarios.repair_attempts=1"))
    assert rejection.reason == "state_load_failed" and "borrow" in rejection.detail
    assert rejection.subject_id == f"{env.id}/scenario-0"
    first, second = requests_of(model, "InitialState")
    assert "borrow" in second.messages[-1].content and "refused" in second.messages[-1].content
    assert requests_of(model, "TaskDraft") == []
    # The state schema went to the model as the structured-output schema, after the scenario's `now`.
    schema = first.response_format["json_schema"]["schema"]
    assert schema["required"] == ["now", "state"] and list(schema["properties"]) == ["now", "state"]
    state = schema["$defs"][schema["properties"]["state"]["$ref"].rsplit("/", 1)[-1]]
    assert state["required"] == ["books", "members", "loans", "today"] and state["additionalProperties"] is False


def test_state_gates_count_records_and_follow_references():
    state = {"members": {"m1": {"name": "x"}}, "loans": [{"member_id": "m9", "book_id": "b1"}],
             "books": {"b1": {"title": "t"}}, "today": "2024-05-01"}  # fmt: skip
    schema = generated_state_schema({}, state)
    assert schema["properties"]["members"] == infer_schema(state["members"])
    assert size_problems(state, schema, 2) == [
        f"{name} holds 1 records; give it at least 2 realistic records" for name in ("members", "loans", "books")
    ]
    assert reference_problems(state) == ["loans[0].member_id = 'm9' is not a known member"]
    assert attribute_problems({"members": {}, "patrons": {}}, state) == [
        "patrons is not an attribute of the environment (it has: books, loans, members, today)"
    ]
    # A bare object schema is refined from the default state; a detailed one is kept as given.
    given = generated_state_schema(
        {"members": {"type": "object"}, "today": {"type": "string", "format": "date"}}, state
    )
    assert given["properties"]["members"]["additionalProperties"]["properties"] == {"name": {"type": "string"}}
    assert given["properties"]["today"] == {"type": "string", "format": "date"}
    # The default state is the ground truth of which attributes exist: undeclared ones are inferred and required.
    assert given["required"] == ["members", "loans", "books", "today"]
    assert given["properties"]["books"] == infer_schema(state["books"])
    # The code stage's form: records keyed by id, only the key required; every field becomes required (on a copy).
    record = {
        "type": "object",
        "properties": {"id": {"type": "string"}, "name": {"type": "string"}},
        "required": ["id"],
    }
    planned = {"type": "object", "properties": {"members": {"type": "object", "additionalProperties": record}}}
    members = generated_state_schema(planned, {})["properties"]["members"]
    assert members["additionalProperties"]["required"] == ["id", "name"] and record["required"] == ["id"]


async def test_state_with_dangling_references_is_rejected(tmp_path, sandbox):
    state = {
        "books": {f"b{i}": {"title": f"Book {i}", "author": "A. Author", "copies": 2} for i in range(3)},
        "members": {f"m{i}": {"name": f"Member {i}", "max_loans": 2, "fines_cents": 0} for i in range(3)},
        "loans": [{"member_id": "m7", "book_id": f"b{i}", "due": "2024-05-20", "returned": False} for i in range(3)],
        "today": "2024-05-01",
    }
    env = environment("library", state_schema=LIBRARY_SCHEMA)
    (rejection,) = await scenarios(
        env, context(tmp_path, scripted(state=state), sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "state_inconsistent" and "m7" in rejection.detail


async def test_task_already_solved_by_its_initial_state_gets_a_new_task_then_is_rejected(tmp_path, sandbox):
    done = "Has acc-1 a balance of 10000?"
    task = {**TASK, "checklist": [done]}
    code = "def check(initial_state, final_state):\n    return initial_state['accounts']['acc-1']['balance'] == 10000\n"
    checks = {done: code}
    model = scripted(task=task, checks=checks)
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=1")
    )
    assert rejection.reason == "already_solved"
    first, second = requests_of(model, "TaskDraft")
    assert "refused" in second.messages[-1].content and "already passes" in second.messages[-1].content


async def test_gold_calling_a_missing_tool_is_repaired_with_the_error_fed_back(tmp_path, sandbox):
    wrong = [{"name": "wire_money", "arguments": {"source": "acc-1"}}, *GOLD]
    model = scripted(gold=[wrong, GOLD])
    plain, _ = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert plain.verification.repairs == ("gold_call_failed",)
    assert [a.name for a in plain.gold_actions] == [g["name"] for g in GOLD]
    feedback = requests_of(model, "GoldSolution")[1].messages[-1].content
    assert "unknown tool 'wire_money'" in feedback


async def test_gold_that_fails_the_checks_is_rejected(tmp_path, sandbox):
    # 30 cents instead of 30.00: a value the task gives (so the task is not underspecified), misread.
    short = [{**g, "arguments": {**g["arguments"], "amount": 30}} if g["name"] == "transfer" else g for g in GOLD]
    model = scripted(gold=[short])
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "gold_fails_checks"
    assert "check 1: returned False" in rejection.detail and "check 2: returned False" in rejection.detail
    assert "check 3" not in rejection.detail


async def test_gold_with_a_change_no_check_needs_fails_the_negative_control(tmp_path, sandbox):
    extra = [*GOLD, {"name": "freeze_account", "arguments": {"account_id": "acc-1"}}]
    model = scripted(gold=[extra])
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "negative_control_failed"
    assert "without call 5 (freeze_account) every check still passes" in rejection.detail


async def test_vacuous_check_is_kept_and_reported(tmp_path, sandbox):
    always = "Has the bank still got accounts?"
    task = {**TASK, "checklist": [*TASK["checklist"], always]}
    checks = {**CHECKS, always: "def check(initial_state, final_state):\n    return len(final_state['accounts']) > 0\n"}
    plain, _ = await scenarios(environment("bank"), context(tmp_path, scripted(task=task, checks=checks), sandbox))
    assert plain.verification.vacuous_checks == (3,)
    assert plain.verification.checks_on_initial == (False, False, False, True, True)  # and the guard's


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("def check(initial_state, final_state):\n    return final_state['nope']['x']\n", "KeyError"),
        ("def check(initial_state, final_state):\n    return 1\n", "not_bool"),
        ("def check(initial_state, final_state):\n    while True:\n        pass\n", "timeout"),
        ("import os\ndef check(initial_state, final_state):\n    return True\n", "import_not_allowed"),
        ("def check(final_state):\n    return True\n", "signature must be exactly"),
    ],
)
async def test_broken_checks_are_rejected_with_the_reason(tmp_path, sandbox, code, error):
    model = scripted(checks={**CHECKS, FROZEN: code})
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "check_broken"
    assert rejection.detail.startswith("check 3:") and error in rejection.detail


async def test_broken_check_is_regenerated_with_its_error(tmp_path, sandbox):
    broken = "def check(initial_state, final_state):\n    return 1\n"
    model = scripted(checks={**CHECKS, FROZEN: [broken, CHECKS[FROZEN]]})
    plain, _ = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert plain.verification.repairs == ("check_broken",) and plain.checks[2] == CHECKS[FROZEN]
    repair = [r for r in requests_of(model, "CheckCode") if len(r.messages) > 2]
    assert len(repair) == 1 and "not_bool" in repair[0].messages[-1].content


async def test_repair_is_bounded_and_ends_in_a_rejection(tmp_path, sandbox):
    wrong = [{"name": "wire_money", "arguments": {}}, *GOLD]
    model = scripted(gold=[wrong])
    ctx = context(tmp_path, model, sandbox, "scenarios.repair_attempts=2")
    (rejection,) = await scenarios(environment("bank"), ctx)
    assert rejection.reason == "gold_call_failed" and "wire_money" in rejection.raw_output
    first, *repairs = requests_of(model, "GoldSolution")
    assert len(repairs) == 2  # the first sequence and two repairs
    # Each repair: the request, the current gold and the feedback (never every earlier one), a fresh sample.
    assert [len(r.messages) for r in repairs] == [4, 4] and all(r.messages[:2] == first.messages for r in repairs)
    assert repairs[0].messages == repairs[1].messages  # the same gold refused the same way ...
    assert len({r.sample_index for r in (first, *repairs)}) == 3  # ... is still asked as a new sample
    assert Store(tmp_path / "store").scenarios() == []


def test_check_lint():
    assert lint_check(CHECKS[FROZEN]) == []
    assert any("[syntax]" in p for p in lint_check("def check(:"))
    assert any(
        "forbidden_name" in p for p in lint_check("def check(initial_state, final_state):\n    return eval('1')")
    )
    assert any("exactly one" in p for p in lint_check("x = 1\n"))


async def test_stage_in_the_runner_counts_yield_cost_and_duplicates(tmp_path, sandbox):
    async def source(inputs, ctx):
        return [environment("bank"), environment("library", status="rejected")]

    stages = (
        BatchStage("environments", source, input=None, output=Environment),
        pipeline_stage("scenarios"),
    )
    overrides = [
        f'store.path="{tmp_path / "store"}"', "scenarios.per_environment=2", 'scenarios.method="llm"',
        "scenarios.families={plain=1}",
    ]  # fmt: skip
    config = load_config(None, overrides)
    model = scripted()
    stats = await run_stages(
        stages, config, tmp_path / "run",
        llm=lambda stage_stats: client_for(
            config.llm, model, model_id="m",
            on_call=stage_stats.add_call,
        ),
        sandbox=lambda: sandbox,
    )  # fmt: skip
    # The scripted model answers both slots alike: the second is the same scenario, so it is a duplicate.
    assert stats["scenarios"].kept == 2 and dict(stats["scenarios"].dropped) == {"duplicate": 1, "not_accepted": 1}
    saved = json.loads((tmp_path / "run" / "stats.json").read_text())["stages"]["scenarios"]
    assert saved["yield"] == 0.5 and saved["per_kept"]["calls"] > 0
    # One verified slot (emitted in two modes): the whole stage's cost is that slot's cost.
    report = saved["report"]
    assert report["verified_slots"] == 1
    assert (
        report["per_verified_slot"]["prompt_tokens"]
        == saved["usage"]["prompt_tokens"]
        == 2 * saved["per_kept"]["prompt_tokens"]
    )
    assert report["per_verified_slot"]["calls"] == saved["usage"]["calls"]
    rejected = pl.read_parquet(tmp_path / "run" / "scenarios.rejected.parquet")
    assert sorted(rejected["reason"]) == ["duplicate", "not_accepted"]
    assert len(Store(tmp_path / "store").scenarios()) == 2


STAMPED = '''"""A desk that stamps each ticket with the clock: the same calls give different states."""

import time


class DeskEnv:
    def __init__(self):
        self.tickets = {}

    def list_tickets(self) -> list:
        """All ticket ids.

        Returns:
            The ids, sorted.
        """
        return sorted(self.tickets)

    def open_ticket(self, title: str) -> dict:
        """Open a ticket.

        Args:
            title: What the ticket is about.

        Returns:
            {"success": true, "ticket_id": ...}.
        """
        ticket_id = f"t{len(self.tickets) + 1}"
        self.tickets[ticket_id] = {"title": title, "opened_ns": time.perf_counter_ns()}
        return {"success": True, "ticket_id": ticket_id}
'''


async def test_gold_whose_replay_differs_is_rejected(tmp_path, sandbox):
    interface = inspect_source(STAMPED)
    env = Environment(
        provenance={"config_hash": "hash"}, plan_id="plan-desk", name="desk", class_name="DeskEnv",
        description="A ticket desk.", domain="test", code=STAMPED, tools=list(interface.tools), state_schema={},
        status="accepted",
    )  # fmt: skip
    item = "Has a ticket titled 'printer' been opened?"
    said = "Please open a ticket about the printer."
    task = {**TASK, "task": said, "known_up_front": said, "checklist": [item]}
    code = (
        "def check(initial_state, final_state):\n"
        "    return any(t['title'] == 'printer' for t in final_state['tickets'].values())\n"
    )
    look = {"name": "list_tickets", "arguments": {}}
    gold = [look, {"name": "open_ticket", "arguments": {"title": "printer"}}, look]
    model = scripted(state={"tickets": {}}, task=task, checks={item: code}, gold=[gold])
    (rejection,) = await scenarios(env, context(tmp_path, model, sandbox, "scenarios.repair_attempts=0"))
    assert rejection.reason == "gold_nondeterministic"


async def test_check_false_after_gold_repairs_the_gold_first_then_the_check(tmp_path, sandbox):
    wrong = "def check(initial_state, final_state):\n    return final_state['accounts']['acc-2']['frozen'] == 'yes'\n"
    model = scripted(checks={**CHECKS, FROZEN: [wrong, CHECKS[FROZEN]]})
    plain, _ = await scenarios(environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=2"))
    assert plain.verification.repairs == ("gold_fails_checks", "gold_fails_checks")
    assert plain.checks[2] == CHECKS[FROZEN]
    assert len(requests_of(model, "GoldSolution")) == 2  # the first repair went to the gold
    (repair,) = [r for r in requests_of(model, "CheckCode") if len(r.messages) > 2]
    assert "returned False" in repair.messages[-1].content and "accounts.acc-2.frozen" in repair.messages[-1].content


async def test_environment_whose_default_state_does_not_load_is_rejected(tmp_path, sandbox):
    broken = STAMPED.replace("self.tickets = {}", "self.tickets = {}\n        raise RuntimeError('no desk today')")
    interface = inspect_source(broken)
    env = Environment(
        provenance={"config_hash": "hash"}, plan_id="plan-desk", name="desk", class_name="DeskEnv",
        description="A ticket desk.", domain="test", code=broken, tools=list(interface.tools), state_schema={},
        status="accepted",
    )  # fmt: skip
    with pytest.raises(Rejected) as verdict:
        await scenarios(env, context(tmp_path, scripted(), sandbox))
    assert verdict.value.rejection.reason == "env_load_failed" and "no desk today" in verdict.value.rejection.detail


async def test_gold_too_short_is_rejected(tmp_path, sandbox):
    model = scripted(gold=[GOLD[2:]])
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "too_few_calls"


async def test_an_unexpected_error_costs_only_its_slot(tmp_path, sandbox, monkeypatch):
    import builder.stages.scenarios as stage

    build = stage._build

    async def flaky(env, ctx, slot, example, start, *rest):
        if slot == 1:
            raise ValueError("bug in slot 1")
        return await build(env, ctx, slot, example, start, *rest)

    monkeypatch.setattr(stage, "_build", flaky)
    ctx = context(tmp_path, scripted(), sandbox, "scenarios.per_environment=2", 'scenarios.method="llm"')
    plain, talk, rejection = await scenarios(environment("bank"), ctx)
    assert (plain.mode, talk.mode) == ("non_conversational", "conversational")
    assert rejection.reason == "exception:ValueError" and rejection.subject_id.endswith("/scenario-1")


# ------------------------------------------------------------------------------- solvable from what the user says

UNNAMED = {**TASK, "task": "I'm Ada Lovelace. Move 30.00 from my checking account acc-1 to my savings account acc-2, "
           "then freeze the savings account."}  # fmt: skip


async def test_task_whose_gold_needs_an_id_it_never_gives_is_rejected(tmp_path, sandbox):
    # list_accounts(owner="c1"): the customer id is in the state, but neither the task nor an earlier result
    # gives it; the conversational script does (reveal_when_asked), so only one mode fails.
    model = scripted(task=UNNAMED)
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "task_underspecified"
    assert rejection.detail == "non_conversational: call 1 list_accounts: owner = 'c1'"
    assert Store(tmp_path / "store").scenarios() == []


async def test_underspecified_task_is_replaced_by_a_new_task_with_the_evidence(tmp_path, sandbox):
    model = scripted(task=[UNNAMED, TASK])
    plain, talk = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert plain.verification.repairs == ("task_underspecified",) and plain.task == " ".join(TASK["task"].split())
    first, second = requests_of(model, "TaskDraft")
    feedback = second.messages[-1].content
    assert "not in the task: call 1 list_accounts: owner = 'c1'" in feedback and UNNAMED["task"] in feedback
    assert "refused" not in first.messages[-1].content
    assert len(requests_of(model, "GoldSolution")) == 2  # the new task got its own gold and checks


LIBRARY_STATE = {
    "books": {"b1": {"title": "The Left Hand of Darkness", "author": "Ursula K. Le Guin", "copies": 2},
              "b2": {"title": "Wide Sargasso Sea", "author": "Jean Rhys", "copies": 1},
              "b3": {"title": "Dune", "author": "Frank Herbert", "copies": 0}},
    "members": {"m1": {"name": "Sam Vimes", "max_loans": 3, "fines_cents": 0},
                "m2": {"name": "Sybil Ramkin", "max_loans": 2, "fines_cents": 0},
                "m3": {"name": "Nobby Nobbs", "max_loans": 1, "fines_cents": 250}},
    "loans": [{"member_id": "m2", "book_id": "b3", "due": "2024-03-20", "returned": False},
              {"member_id": "m3", "book_id": "b2", "due": "2024-02-01", "returned": True},
              {"member_id": "m2", "book_id": "b2", "due": "2024-01-10", "returned": True}],
    "today": "2024-03-14",
}  # fmt: skip
LENT = {"Does m1 have an open loan of b1?": "b1", "Does m1 have an open loan of b2?": "b2"}
LENDING = {
    "task": "I'm member m1. Please lend me The Left Hand of Darkness and Wide Sargasso Sea, two weeks each.",
    "difficulty": "medium", "user_profile": "Sam, a night-watch captain who reads on his breaks.",
    "known_up_front": "Member m1; wants The Left Hand of Darkness and Wide Sargasso Sea, two weeks each.",
    "reveal_when_asked": "Nothing else.", "ending": "Thanks the assistant once both loans are confirmed.",
    "checklist": list(LENT),
}  # fmt: skip


async def test_a_gold_that_skips_a_look_up_the_user_allows_is_written_again_not_the_task(tmp_path, sandbox):
    """The user names the books by title, which `search_books` finds; a gold that lends `b1` and `b2` straight
    away is at fault, not the task (teacher-16: tasks were rewritten to quote retreat ids instead)."""
    checks = {item: "def check(initial_state, final_state):\n    return any(loan['member_id'] == 'm1' and "
              f"loan['book_id'] == {book!r} and not loan['returned'] for loan in final_state['loans'])\n"
              for item, book in LENT.items()}  # fmt: skip
    blind = [{"name": "borrow", "arguments": {"member_id": "m1", "book_id": book}} for book in ("b1", "b2")]
    looked_up = [
        {"name": "search_books", "arguments": {"query": "The Left Hand of Darkness"}},
        {"name": "search_books", "arguments": {"query": "Wide Sargasso Sea"}},
        *blind,
    ]
    model = scripted(state=LIBRARY_STATE, task=LENDING, checks=checks, gold=(blind, looked_up))
    env = environment("library", state_schema=LIBRARY_SCHEMA)
    plain, _talk = await scenarios(env, context(tmp_path, model, sandbox))
    assert plain.verification.repairs == ("task_underspecified",) and len(requests_of(model, "TaskDraft")) == 1
    assert [action.name for action in plain.gold_actions][:2] == ["search_books", "search_books"]
    told = requests_of(model, "GoldSolution")[1].messages[-1].content
    assert "call 1 borrow: book_id = 'b1': the user gives it only as 'The Left Hand of Darkness'" in told
    assert "call 2 borrow: book_id = 'b2': the user gives it only as 'Wide Sargasso Sea'" in told
    assert "Look each one up first with a tool" in told


async def test_a_gold_that_still_skips_the_look_up_hands_the_values_to_the_task(tmp_path, sandbox):
    blind = [{"name": "borrow", "arguments": {"member_id": "m1", "book_id": book}} for book in ("b1", "b2")]
    more = "def check(initial_state, final_state):\n    return len(final_state['loans']) > 3\n"
    checks = dict.fromkeys(LENT, more)
    model = scripted(state=LIBRARY_STATE, task=LENDING, checks=checks, gold=(blind,))
    env = environment("library", state_schema=LIBRARY_SCHEMA)
    (rejection,) = await scenarios(env, context(tmp_path, model, sandbox, "scenarios.repair_attempts=2"))
    assert rejection.reason == "task_underspecified"
    # The gold first (told what to look up), then a new task (with its own gold), not the gold again and again.
    assert len(requests_of(model, "GoldSolution")) == 3 and len(requests_of(model, "TaskDraft")) == 2
    assert "not in the task: call 1 borrow: book_id = 'b1'" in requests_of(model, "TaskDraft")[1].messages[-1].content


async def test_conversational_script_must_give_the_values_too(tmp_path, sandbox):
    silent = {**TASK, "reveal_when_asked": "My checking and savings accounts."}
    model = scripted(task=silent)
    (rejection,) = await scenarios(
        environment("bank"), context(tmp_path, model, sandbox, "scenarios.repair_attempts=0")
    )
    assert rejection.reason == "task_underspecified" and rejection.detail.startswith("conversational: call 1")
    # Configured for one mode only, the other mode's text is not asked to hold anything.
    ctx = context(tmp_path, scripted(task=silent), sandbox, 'scenarios.modes=["non_conversational"]')
    (plain,) = await scenarios(environment("bank"), ctx)
    assert plain.mode == "non_conversational"


# ------------------------------------------------------------------------------------------ what each request sees


async def test_requests_get_the_interface_not_the_module(tmp_path, sandbox):
    env = environment("bank")
    model = scripted()
    await scenarios(env, context(tmp_path, model, sandbox))
    tools = json.dumps([tool["function"] for tool in env.tools], ensure_ascii=False)
    transfer_body = 'self.accounts[source]["balance"] -= amount'
    lookup_body = 'return {"success": True, "account": dict(account, account_id=account_id)}'
    for name in ("InitialState", "TaskDraft", "GoldSolution", "CheckCodes"):
        for request in requests_of(model, name):
            text = request.messages[1].content
            assert env.code.strip() not in text and lookup_body not in text, name
    for name in ("InitialState", "TaskDraft", "GoldSolution"):
        (request,) = requests_of(model, name)
        text = request.messages[1].content
        assert tools in text and "Accounts hold integer cents" in text, name  # the tool schemas and the rules
        # The module docstring too: the code stage writes the plan's numbered rules there.
        assert "transfers with an overdraft rule and a daily limit" in text, name
        assert transfer_body not in text, name
    checks = requests_of(model, "CheckCodes")
    assert len(checks) == 1 and checklist_of(checks[0]) == TASK["checklist"]  # one request for the checklist
    schema = generated_state_schema({}, BANK_STATE)
    for request in checks:
        text = request.messages[1].content
        assert json.dumps(schema) in text and tools not in text
        assert transfer_body in text  # the state-changing method the gold calls (lookups are left out)
        assert '"acc-3"' not in text and '"acc-1"' in text  # only the records the gold names
    (gold,) = requests_of(model, "GoldSolution")
    compact = json.dumps(BANK_STATE["accounts"], separators=(",", ":"))
    assert compact in gold.messages[1].content  # the gold sees the whole state (compact JSON)


async def test_a_prompt_too_long_is_asked_again_smaller_and_counted(tmp_path, sandbox):
    from builder.llm import PromptTooLongError

    more = {f"acc-{i}": {"owner": "c3", "balance": 100 * i, "kind": "savings", "frozen": False} for i in range(5, 12)}
    inner = scripted(state={**BANK_STATE, "accounts": {**BANK_STATE["accounts"], **more}})
    sizes = []

    def answer(request: ChatRequest):
        if schema_name(request) == "TaskDraft":
            sizes.append(request.messages[1].content)
            if len(sizes) == 1:
                return PromptTooLongError("too long", prompt_tokens=40000, context_tokens=32768, min_completion=512)
        return inner.script(request)

    ctx = context(tmp_path, ScriptedModel(answer), sandbox)
    plain, _ = await scenarios(environment("bank"), ctx)
    assert plain.verification.repairs == ()
    assert ctx.stats.report.to_json()["prompt_shrunk"] == {"scenario_task": 1}
    shown = sizes[1].partition("\n… ")[0]  # the JSON of the state, before the note naming what was left out
    assert len(sizes) == 2 and len(sizes[1]) < len(sizes[0]) and "acc-11" in sizes[0] and "acc-11" not in shown
    assert "… 5 more accounts not shown: ids acc-7, acc-8, acc-9, acc-10, acc-11" in sizes[1]


async def test_a_prompt_that_never_fits_is_a_prompt_too_long_rejection(tmp_path, sandbox):
    from builder.llm import PromptTooLongError

    inner = scripted()

    def answer(request: ChatRequest):
        if schema_name(request) == "GoldSolution":
            return PromptTooLongError("too long", prompt_tokens=40000, context_tokens=32768, min_completion=512)
        return inner.script(request)

    ctx = context(tmp_path, ScriptedModel(answer), sandbox)
    (rejection,) = await scenarios(environment("bank"), ctx)
    assert rejection.reason == "prompt_too_long" and rejection.subject_id.endswith("/scenario-0")
    # Every level of the one shrink scheme was tried (builder/views/budget.py: 12000 characters halved to 200).
    assert (
        ctx.stats.report.to_json()["prompt_shrunk"]
        == {"scenario_gold": len(prompt_budgets(12000)) - 1}
        == {"scenario_gold": 6}
    )


# A tool the way a capable model writes one: long, stamping records with the clock and ids with uuid4.
PRINTER = {
    **TASK,
    "task": "Please open an urgent ticket titled printer and show me the open tickets.",
    "known_up_front": "I need an urgent ticket opened.",
    "reveal_when_asked": "The title is printer.",
}
HELPDESK = '''"""A help desk whose tickets carry generated ids and timestamps."""

import datetime
import random
import uuid
from datetime import date, timedelta


class HelpDeskEnv:
    """Support tickets with priorities, due dates and an audit log."""

    def __init__(self):
        self.tickets = {}
        self.audit = []

    def open_ticket(self, title: str, priority: str = "normal") -> dict:
        """Open a ticket.

        Args:
            title: What the ticket is about.
            priority: low, normal or urgent.

        Returns:
            {"success": true, "ticket": {...}} or {"success": false, "error": ...}.
        """
        title = title.strip()
        if not title:
            return {"success": False, "error": "the title must not be empty"}
        if len(title) > 200:
            return {"success": False, "error": "the title is longer than 200 characters"}
        if priority not in ("low", "normal", "urgent"):
            return {"success": False, "error": f"unknown priority {priority!r}"}
        for ticket in self.tickets.values():
            if ticket["title"].lower() == title.lower() and ticket["status"] == "open":
                return {"success": False, "error": "an open ticket with this title exists"}
        now = datetime.datetime.now()
        days = {"low": 7, "normal": 3, "urgent": 1}[priority]
        due = date.today() + timedelta(days=days)
        if due.weekday() >= 5:
            due += timedelta(days=7 - due.weekday())
        ticket_id = f"TCK-{uuid.uuid4().hex[:8].upper()}"
        ticket = {
            "ticket_id": ticket_id,
            "title": title,
            "priority": priority,
            "status": "open",
            "opened_at": now.isoformat(),
            "due": due.isoformat(),
            "agent": random.choice(["ana", "ben", "chloe"]),
        }
        self.tickets[ticket_id] = ticket
        self.audit.append({"at": now.isoformat(timespec="seconds"), "event": "opened", "ticket_id": ticket_id})
        return {"success": True, "ticket": dict(ticket)}

    def list_tickets(self, status: str = "open") -> dict:
        """List tickets by status.

        Args:
            status: open or closed.

        Returns:
            {"success": true, "tickets": [...]}.
        """
        found = [dict(t) for t in self.tickets.values() if t["status"] == status]
        found.sort(key=lambda t: (t["due"], t["ticket_id"]))
        return {"success": True, "tickets": found}
'''


def helpdesk() -> Environment:
    interface = inspect_source(HELPDESK)
    return Environment(
        provenance={"config_hash": "hash"}, plan_id="plan-helpdesk", name="helpdesk", class_name="HelpDeskEnv",
        description="A help desk.", domain="test", code=HELPDESK, tools=list(interface.tools), state_schema={},
        status="accepted",
    )  # fmt: skip


async def test_clock_and_uuid_stamping_gold_verifies_at_the_scenarios_now(tmp_path, sandbox):
    assert len(HELPDESK.split("def open_ticket")[1].split("def list_tickets")[0].splitlines()) >= 40
    item = "Has a ticket titled 'printer' been opened today, due tomorrow?"
    check = (
        "import datetime\n\n"
        "def check(initial_state, final_state):\n"
        "    today = datetime.date.today()\n"
        "    tomorrow = (today + datetime.timedelta(days=1)).isoformat()\n"
        "    return any(t['title'] == 'printer' and t['opened_at'].startswith(today.isoformat())\n"
        "               and t['due'] == tomorrow for t in final_state['tickets'].values())\n"
    )
    look = {"name": "list_tickets", "arguments": {}}
    gold = [look, {"name": "open_ticket", "arguments": {"title": "printer", "priority": "urgent"}}, look]
    model = scripted(state={"tickets": {}, "audit": []}, task={**PRINTER, "checklist": [item]}, checks={item: check},
                     gold=[gold])  # fmt: skip
    plain, _talk = await scenarios(helpdesk(), context(tmp_path, model, sandbox))
    assert isinstance(plain, Scenario) and plain.now == NOW  # a Thursday: tomorrow is a weekday
    (ticket,) = plain.verification.gold[1:2]
    assert '"opened_at": "2024-03-14T10:30:00"' in ticket.result and '"due": "2024-03-15"' in ticket.result
    # The task, check and gold requests were told the scenario's date-time, with its weekday.
    for name in ("TaskDraft", "CheckCodes", "GoldSolution"):
        (request,) = requests_of(model, name)
        assert "## Now\n2024-03-14T10:30:00 (Thursday)" in request.messages[1].content
    assert plain.id != plain.model_copy(update={"now": "2024-03-15T10:30:00"}).id  # `now` defines the scenario


async def test_the_same_scenario_at_another_now_fails_its_date_check(tmp_path, sandbox):
    item = "Has a ticket been opened on 2024-03-14?"
    check = (
        "def check(initial_state, final_state):\n"
        "    return any(t['opened_at'].startswith('2024-03-14') for t in final_state['tickets'].values())\n"
    )
    look = {"name": "list_tickets", "arguments": {}}
    gold = [look, {"name": "open_ticket", "arguments": {"title": "printer"}}, look]
    state = {"tickets": {}, "audit": []}
    task = {**PRINTER, "checklist": [item]}
    kept, _ = await scenarios(helpdesk(), context(tmp_path, scripted(state, task, {item: check}, [gold]), sandbox))
    assert kept.now == NOW
    later = {"now": "2024-03-20T08:00:00", "state": state}
    (rejection,) = await scenarios(
        helpdesk(),
        context(tmp_path, scripted(later, task, {item: check}, [gold]), sandbox, "scenarios.repair_attempts=0"),
    )
    assert rejection.reason == "gold_fails_checks"


@pytest.mark.parametrize("now", ["next Tuesday", "2024-03-14", "2024-02-30T10:00:00", "2024-03-14T10:30:00+02:00"])
async def test_a_now_that_is_not_a_naive_iso_date_time_is_refused(tmp_path, sandbox, now):
    model = scripted(state=[{"now": now, "state": BANK_STATE}])
    (rejection,) = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert rejection.reason == "state_invalid" and "now" in rejection.detail
    assert requests_of(model, "TaskDraft") == []


async def test_a_now_without_seconds_is_repaired_to_whole_seconds(tmp_path, sandbox):
    model = scripted(state=[{"now": "2024-03-14T10:30", "state": BANK_STATE}])
    plain, _ = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert plain.now == "2024-03-14T10:30:00"


def test_a_large_state_is_shown_in_whole_records_never_cut_mid_json():
    from builder.views.budget import prompt_budgets
    from builder.views.state import state_text

    budget = prompt_budgets(12000)[0]
    big = {"accounts": {f"acc-{i}": {"owner": f"customer {i}", "balance": i, "note": "x" * 80} for i in range(400)}}
    text = state_text(big, budget)
    shown, _, note = text.partition("\n…")
    parsed = json.loads(shown)  # the JSON part parses: whole records only
    assert 0 < len(parsed["accounts"]) < 400 and len(text) <= budget.state_chars
    assert f"{400 - len(parsed['accounts'])} more accounts not shown" in note


async def test_a_task_that_asks_to_be_told_something_keeps_its_answer_facts(tmp_path, sandbox):
    """The task writer names what the reply must state; the gate holds it to what the gold's calls return (the gold
    is asked first to read it, then the task to name what the tools tell), and the kept scenario carries it."""
    asks = {**TASK, "task": TASK["task"] + " Then tell me what acc-1 holds.", "answer_facts": ["7000"]}
    wrong = {**asks, "answer_facts": ["70.00 dollars"]}  # not a value the tools return
    without_read = [call for call in GOLD if call["name"] != "get_account"]
    model = scripted(task=[wrong, asks], gold=(without_read, without_read, GOLD + [GOLD[1]]))
    plain, talk = await scenarios(environment("bank"), context(tmp_path, model, sandbox))
    assert plain.answer_facts == talk.answer_facts == ("7000",)
    assert plain.verification.repairs == ("answer_not_read", "answer_not_read")
    repair, retask = requests_of(model, "GoldSolution")[1], requests_of(model, "TaskDraft")[1]
    assert "answer fact '70.00 dollars': no call of the solution returns it" in repair.messages[-1].content
    assert "answer_facts must be values the tools return" in retask.messages[-1].content
