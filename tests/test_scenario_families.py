"""Task families (`builder.stages.scenarios.families`): each family's generation path with a scripted model on the
bank fixture, its gates (not_refused, state_changed, nothing_withheld), its checks per mode, the reward audit of
what it keeps, and its figures in the report."""

from __future__ import annotations

import json

import pytest

from builder.envs.answer import answer_check
from builder.envs.audit import audit_reward
from builder.envs.guard import GUARD_ITEM, is_guard
from builder.evidence import GoldResult
from builder.llm import ChatRequest, ScriptedModel
from builder.records import Action, Rejection, Scenario
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.families import FAMILIES, slot_families
from builder.stages.scenarios.family_gates import doable_without
from builder.stages.scenarios.family_stats import derive_families
from builder.stages.scenarios.state import slot_records
from builder.stages.scenarios.verify import Evidence
from builder.store import Store
from tests.test_stage_scenarios import BANK_STATE, CHECKS, FAST, GOLD, NOW, TASK, context, environment, schema_name

pytestmark = pytest.mark.usefixtures("restore_logging")

MOVED_IN, MOVED_OUT, FROZEN = TASK["checklist"]
CHECK_FOR = CHECKS | {
    "Has acc-2's balance increased by 500 cents?": "def check(initial_state, final_state):\n"
    "    return final_state['accounts']['acc-2']['balance'] == initial_state['accounts']['acc-2']['balance'] + 500\n",
}


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def model(tasks: list[dict], golds: list[list[dict]]) -> ScriptedModel:
    """Answers the stage's requests: the state, then `tasks` and `golds` in turn (the last one repeats), and
    each checklist item's check from CHECK_FOR."""
    queues = {"task": list(tasks), "gold": list(golds)}

    def next_of(kind: str):
        queue = queues[kind]
        return queue.pop(0) if len(queue) > 1 else queue[0]

    def answer(request: ChatRequest) -> str:
        name = schema_name(request)
        if name == "InitialState":
            return json.dumps({"now": NOW, "state": BANK_STATE})
        if name.endswith("Draft"):
            return json.dumps(next_of("task"))
        if name == "GoldSolution":
            return json.dumps({"actions": next_of("gold")})
        if name == "CheckCodes":
            section = request.messages[1].content.rsplit("## Checklist (", 1)[1].split("\n", 1)[1]
            return json.dumps({"checks": [CHECK_FOR[line.split(". ", 1)[1]] for line in section.splitlines()]})
        raise AssertionError(f"unexpected request {name!r}")

    return ScriptedModel(answer)


async def one_slot(tmp_path, sandbox, family: str, tasks, golds, *overrides):
    scripted = model(tasks, golds)
    ctx = context(tmp_path, scripted, sandbox, f"scenarios.families={{{family}=1}}", *overrides)
    made = await scenarios(environment("bank"), ctx)
    return made, scripted, ctx


def audit(sandbox, scenario: Scenario) -> dict[str, str]:
    env = environment("bank")
    return audit_reward(
        sandbox, env.code, scenario.initial_state, scenario.checks, scenario.gold_actions, env.tools,
        now=scenario.now, seed=scenario.seed, check=answer_check(scenario),
    ).outcomes  # fmt: skip


def test_slots_get_families_in_proportion_heaviest_first():
    weights = {"plain": 3, "missing_info": 1, "infeasible": 1, "policy_trap": 1, "error_recovery": 1, "long_context": 1}
    eight = slot_families(8, weights)
    assert eight[0] == "plain" and eight.count("plain") == 3 and set(eight) == set(FAMILIES)
    assert slot_families(3, {"plain": 1, "infeasible": 0}) == ["plain"] * 3
    assert slot_families(4, {"infeasible": 1, "policy_trap": 1}) == ["infeasible", "policy_trap"] * 2


# "Move 30.00 from acc-1 to acc-2, then freeze acc-2": the user leaves the amount out; the freeze needs no amount.
PARTLY = {
    **TASK, "task": "I'm Ada Lovelace, customer c1. Move some money from my checking account acc-1 to my savings "
    "account acc-2, then freeze the savings account.",
    "known_up_front": "Wants to move money to savings and freeze the savings account.",
    "reveal_when_asked": "Accounts acc-1 (checking) and acc-2 (savings); customer id c1; the amount is 30.00.",
    "withheld": "3000", "withheld_as": "the amount",
}  # fmt: skip
# The same without the freeze: nothing it asks for can be done without the amount.
MISSING = {
    **PARTLY, "task": "I'm Ada Lovelace, customer c1. Move some money from my checking account acc-1 to my savings "
    "account acc-2.", "known_up_front": "Wants to move money to savings.", "checklist": [MOVED_IN, MOVED_OUT],
}  # fmt: skip
MOVE = GOLD[:3]  # list_accounts, get_account, transfer


async def test_missing_info_asks_in_conversation_and_changes_nothing_without_it(tmp_path, sandbox):
    (plain, talk), scripted, ctx = await one_slot(tmp_path, sandbox, "missing_info", [MISSING], [MOVE])
    assert plain.family == talk.family == "missing_info" and plain.task == talk.task
    # Without the amount nothing can be done: no change (a guard that allows none), and the answer names it.
    assert plain.gold_actions == () and plain.checklist == (GUARD_ITEM,) and len(plain.checks) == 1
    assert is_guard(plain.checks[0]) and plain.answer_facts == ("amount",)  # "the amount", its article dropped
    # In a conversation the user gives it when asked: the task's own checks and gold.
    assert talk.checklist[:-1] == (MOVED_IN, MOVED_OUT) and len(talk.gold_actions) == len(MOVE)
    assert "the amount is 30.00" in talk.user.reveal_when_asked
    assert audit(sandbox, plain)["nothing"] == "pass" and audit(sandbox, talk)["gold"] == "pass"
    note = scripted.requests[1].messages[1].content
    assert "## The kind of task" in note and "missing information" in note
    gold_request = next(r for r in scripted.requests if schema_name(r) == "GoldSolution")
    assert "When asked, the user also says: Accounts acc-1" in gold_request.messages[1].content
    figures = ctx.stats.report.families["missing_info"]
    assert (figures.slots, figures.verified) == (1, 1) and figures.calls == len(scripted.requests)
    derive_families(ctx.stats.report)
    assert figures.yield_ == 1.0 and figures.per_verified["calls"] == len(scripted.requests)


async def test_a_request_that_gives_the_value_is_not_missing_anything(tmp_path, sandbox):
    stated = {**MISSING, "task": TASK["task"]}  # says 30.00 after all: then a new task is asked for
    (plain, _), scripted, _ = await one_slot(tmp_path, sandbox, "missing_info", [stated, MISSING], [MOVE])
    assert plain.verification.repairs == ("nothing_withheld",)
    retask = [r for r in scripted.requests if schema_name(r) == "MissingInfoDraft"][1]
    assert "withheld '3000': the request gives it or lets the assistant find it" in retask.messages[-1].content


async def test_a_missing_info_task_partly_doable_without_the_value_is_written_again(tmp_path, sandbox):
    # teacher-9: "post a review (rating withheld) and book a visit": a one-shot agent booked, and scored 0.
    (plain, talk), scripted, _ = await one_slot(tmp_path, sandbox, "missing_info", [PARTLY, MISSING], [GOLD, MOVE])
    assert plain.verification.repairs == ("doable_without_withheld",) and plain.task == MISSING["task"]
    retask = [r for r in scripted.requests if schema_name(r) == "MissingInfoDraft"][1]
    assert "call 4 freeze_account can be done without the withheld 'the amount'" in retask.messages[-1].content
    assert [a.name for a in talk.gold_actions] == ["list_accounts", "get_account", "transfer"]


def test_a_change_needs_the_withheld_value_through_what_a_call_with_it_returned():
    def ran(name: str, arguments: dict, result: object, changed: bool = False) -> tuple[Action, GoldResult]:
        text = json.dumps(result)
        return Action(name=name, arguments=arguments), GoldResult(name=name, ok=True, state_changed=changed,
                                                                  result=text)  # fmt: skip

    calls = [
        ran("find_patient_by_email", {"email": "e@x.org"}, {"patient_id": "PAT-43"}),
        ran("list_available_slots", {"provider_id": "PRV-44", "date": "2025-05-08"},
            [{"slot_id": "SLOT-420", "provider_id": "PRV-44"}]),
        ran("book_appointment", {"patient_id": "PAT-43", "slot_id": "SLOT-420"}, {"success": True}, True),
        ran("add_review", {"patient_id": "PAT-43", "rating": 4}, {"review_id": "REV-9", "patient_id": "PAT-43"}, True),
    ]  # fmt: skip
    evidence = Evidence(actions=tuple(a for a, _ in calls), gold=tuple(r for _, r in calls),
                        state_changing_calls=(2, 3))  # fmt: skip
    said = "I'm e@x.org; book me with PRV-44 and review my visit"
    assert doable_without("2025-05-08", evidence, said) == ["call 4 add_review"]  # the date: the review is doable
    assert doable_without("4", evidence, said) == ["call 3 book_appointment"]  # the rating: the booking is doable
    both = Evidence(actions=evidence.actions[:3], gold=evidence.gold[:3], state_changing_calls=(2,))
    assert doable_without("2025-05-08", both, said) == []  # the slot came only from the date's search


# acc-2 holds 500 cents: moving 600.00 out of it is refused (insufficient funds).
INFEASIBLE = {
    **TASK, "task": "I'm Ada Lovelace, customer c1. Move 600.00 from my savings account acc-2 to my checking acc-1.",
    "checklist": [], "answer_facts": ["500"],
    "refused_call": {"name": "transfer", "arguments": {"source": "acc-2", "target": "acc-1", "amount": 60000}},
}  # fmt: skip
LOOKUPS = [{"name": "list_accounts", "arguments": {"owner": "c1"}},
           {"name": "get_account", "arguments": {"account_id": "acc-2"}}]  # fmt: skip


async def test_infeasible_changes_nothing_and_the_answer_says_why(tmp_path, sandbox):
    writes = [*LOOKUPS, {"name": "transfer", "arguments": {"source": "acc-2", "target": "acc-1", "amount": 500}}]
    (plain, talk), scripted, _ = await one_slot(tmp_path, sandbox, "infeasible", [INFEASIBLE], [writes, LOOKUPS])
    assert plain.verification.repairs == ("state_changed",)  # the gold moved what it could: told to change nothing
    assert plain.family == "infeasible" and plain.checklist == talk.checklist == (GUARD_ITEM,)
    assert plain.answer_facts == ("500",) and [a.name for a in plain.gold_actions] == ["list_accounts", "get_account"]
    outcomes = audit(sandbox, plain)
    assert outcomes["nothing"] == "pass" and outcomes["gold"] == "pass"  # nothing said: 0; the reason said: 1
    repair = [r for r in scripted.requests if schema_name(r) == "GoldSolution"][1]
    assert "changed the state; the rules forbid this request" in repair.messages[-1].content
    first_gold = [r for r in scripted.requests if schema_name(r) == "GoldSolution"][0]
    assert "The rules forbid this request (transfer(" in first_gold.messages[1].content


async def test_a_refused_call_the_environment_accepts_is_a_new_task_then_a_rejection(tmp_path, sandbox):
    allowed = {**INFEASIBLE, "refused_call": {"name": "get_account", "arguments": {"account_id": "acc-2"}}}
    (rejection,), _, ctx = await one_slot(tmp_path, sandbox, "infeasible", [allowed], [LOOKUPS],
                                          "scenarios.repair_attempts=1")  # fmt: skip
    assert isinstance(rejection, Rejection) and rejection.reason == "not_refused"
    assert "refused_call get_account" in rejection.detail and "accepted it" in rejection.detail
    assert ctx.stats.report.families["infeasible"].rejected == {"not_refused": 1}


# Moving 600.00 out of acc-2 (500 cents) is refused; told so, Ada accepts moving 5.00 the other way.
TRAP = {
    **TASK, "task": "I'm Ada Lovelace, customer c1. Move 600.00 from my savings account acc-2 to my checking account "
    "acc-1, I need it there for a payment.",
    "known_up_front": "Wants 600.00 moved from savings acc-2 to checking acc-1.",
    "reveal_when_asked": "Customer c1. If that cannot be done, move 5.00 from checking acc-1 to savings acc-2.",
    "checklist": ["Has acc-2's balance increased by 500 cents?"], "refusal_facts": ["500"],
    "refused_call": {"name": "transfer", "arguments": {"source": "acc-2", "target": "acc-1", "amount": 60000}},
}  # fmt: skip
TRAP_GOLD = [*LOOKUPS, {"name": "transfer", "arguments": {"source": "acc-1", "target": "acc-2", "amount": 500}}]


async def test_a_policy_trap_does_the_alternative_in_conversation_and_declines_in_one_shot(tmp_path, sandbox):
    (plain, talk), scripted, _ = await one_slot(tmp_path, sandbox, "policy_trap", [TRAP], [TRAP_GOLD])
    assert plain.family == talk.family == "policy_trap" and "instead" not in plain.task
    # In conversation the user, told it is not possible, accepts the alternative: its checks and gold.
    assert talk.gold_actions[-1].arguments["amount"] == 500 and talk.checklist[0] == TRAP["checklist"][0]
    assert all(outcome in ("pass", "n/a") for outcome in audit(sandbox, talk).values())
    # One shot: no alternative was asked for, so nothing changes and the answer declines with the reason.
    assert plain.checklist == (GUARD_ITEM,) and plain.answer_facts == ("500",)
    assert [a.name for a in plain.gold_actions] == ["list_accounts", "get_account"]  # the look-ups before the change
    check = answer_check(plain)
    assert check.declines and not answer_check(talk).declines
    assert check.grade("Done, moved it.", '{"balance": 500}')[0] is False
    assert check.grade("I cannot: acc-2 holds only 500 cents.", '{"balance": 500}')[0] is True
    outcomes = audit(sandbox, plain)
    assert outcomes["nothing"] == "pass" and outcomes["gold"] == "pass"
    gold_request = next(r for r in scripted.requests if schema_name(r) == "GoldSolution")
    assert "Told so, the user says: Customer c1. If that cannot be done" in gold_request.messages[1].content


async def test_a_policy_traps_reason_no_look_up_reads_is_repaired(tmp_path, sandbox):
    unread = {**TRAP, "refusal_facts": ["2500"]}  # acc-3's balance: no look-up of this gold returns it
    (plain, _), scripted, _ = await one_slot(tmp_path, sandbox, "policy_trap", [unread, TRAP], [TRAP_GOLD])
    assert plain.verification.repairs[0] == "answer_not_read" and plain.answer_facts == ("500",)
    repair = [r for r in scripted.requests if schema_name(r) == "GoldSolution"][1]
    assert "refusal fact '2500': no look-up before the first change returns it" in repair.messages[-1].content


async def test_error_recovery_finds_the_right_record_after_the_stale_one_fails(tmp_path, sandbox):
    stale = {
        **TASK, "task": "I'm Ada Lovelace, customer c1. Freeze my savings account acc-9; it is my only savings "
        "account.",
        "checklist": [FROZEN],
        "refused_call": {"name": "freeze_account", "arguments": {"account_id": "acc-9"}},
    }  # fmt: skip
    gold = [{"name": "list_accounts", "arguments": {"owner": "c1", "kind": "savings"}},
            {"name": "get_account", "arguments": {"account_id": "acc-2"}},
            {"name": "freeze_account", "arguments": {"account_id": "acc-2"}}]  # fmt: skip
    (plain, _), _, _ = await one_slot(tmp_path, sandbox, "error_recovery", [stale], [gold])
    assert plain.family == "error_recovery" and plain.gold_actions[-1].arguments == {"account_id": "acc-2"}


async def test_a_family_draft_without_its_fields_is_invalid(tmp_path, sandbox):
    (rejection,), _, _ = await one_slot(tmp_path, sandbox, "policy_trap", [TASK], [GOLD])  # no refused_call
    assert isinstance(rejection, Rejection) and rejection.reason == "task_invalid"
    assert "refused_call" in rejection.detail


async def test_long_context_plays_the_task_on_a_state_grown_with_distractors(tmp_path, sandbox):
    (plain, _), _, _ = await one_slot(tmp_path, sandbox, "long_context", [TASK], [GOLD],
                                      "scenarios.long_context_records=300")  # fmt: skip
    accounts, customers = plain.initial_state["accounts"], plain.initial_state["customers"]
    assert plain.family == "long_context" and abs(len(accounts) + len(customers) - 300) <= 4  # rounds of 7 records
    assert all(accounts[key] == value for key, value in BANK_STATE["accounts"].items())  # the originals, intact
    # No distractor names the task's records or values: Ada (c1) still owns exactly acc-1 and acc-2.
    assert sorted(key for key, account in accounts.items() if account["owner"] == "c1") == ["acc-1", "acc-2"]
    assert not any(customer["name"] == "Ada Lovelace" for key, customer in customers.items() if key != "c1")
    assert all(outcome in ("pass", "n/a") for outcome in audit(sandbox, plain).values())


async def test_a_task_that_copies_its_seed_is_written_again(tmp_path, sandbox, monkeypatch):
    import builder.stages.scenarios as stage

    monkeypatch.setattr(stage, "seed_requests", lambda ctx, env: (TASK["task"],))
    other = {**TASK, "task": "Shift 30.00 into savings acc-2 from checking acc-1 and lock acc-2 afterwards; my "
             "customer id is c1."}  # fmt: skip
    (plain, _), scripted, _ = await one_slot(tmp_path, sandbox, "plain", [TASK, other], [GOLD])
    assert plain.verification.repairs == ("copies_seed",) and plain.task == other["task"]
    retask = [r for r in scripted.requests if schema_name(r) == "TaskDraft"][1]
    assert "repeats the seed request" in retask.messages[-1].content


async def test_a_task_an_earlier_run_stored_for_this_environment_is_not_made_again(tmp_path, sandbox):
    first, _, _ = await one_slot(tmp_path, sandbox, "plain", [TASK], [GOLD])
    store = Store(tmp_path / "store")
    store.upsert("environments", [environment("bank")])
    store.upsert("scenarios", [record for record in first if isinstance(record, Scenario)])
    # The same slot again (a resumed run writes the same records): the stored ones are itself, not earlier ones.
    again, _, _ = await one_slot(tmp_path, sandbox, "plain", [TASK], [GOLD])
    assert [type(record) for record in again] == [Scenario, Scenario]
    # A new run rewording that request about the same records: dropped, naming the stored task.
    reworded = {**TASK, "task": "Please " + TASK["task"][0].lower() + TASK["task"][1:]}
    (rejection,), _, _ = await one_slot(tmp_path, sandbox, "plain", [reworded], [GOLD])
    assert rejection.reason == "duplicate" and "an earlier run's task" in rejection.detail
    assert TASK["task"] in rejection.detail
    # Only environments of the same name are compared.
    assert len(store.scenario_tasks("bank")) == 2 and store.scenario_tasks("library") == {}


async def test_the_same_change_to_the_same_state_is_one_task_however_worded(tmp_path, sandbox):
    worded = {**TASK, "task": "Ada Lovelace here (c1): shift 30.00 out of acc-1 into acc-2 and then lock "
              "acc-2 for me, thanks."}  # fmt: skip
    made, _, _ = await one_slot(tmp_path, sandbox, "plain", [TASK, worded], [GOLD], "scenarios.per_environment=2",
                                'scenarios.method="llm"')  # fmt: skip
    (rejection,) = [record for record in made if isinstance(record, Rejection)]
    assert rejection.reason == "duplicate" and "the same state change on the same initial state" in rejection.detail


async def test_near_duplicate_tasks_of_one_environment_keep_the_first(tmp_path, sandbox):
    reworded = {**TASK, "task": TASK["task"].replace("Move", "Please move")}
    made, _, _ = await one_slot(tmp_path, sandbox, "plain", [TASK, reworded], [GOLD], "scenarios.per_environment=2",
                                'scenarios.method="llm"')  # fmt: skip
    kept = [record for record in made if isinstance(record, Scenario)]
    (rejection,) = [record for record in made if isinstance(record, Rejection)]
    assert len(kept) == 2 and rejection.reason == "duplicate" and "near-duplicate" in rejection.detail


def test_slot_sizes_spread_from_min_records_to_four_times_it():
    assert [slot_records(slot, 8, 3) for slot in range(8)] == [3, 4, 6, 7, 8, 9, 11, 12]
    assert slot_records(0, 1, 3) == 3 and [slot_records(slot, 2, 5) for slot in range(2)] == [5, 20]


async def test_each_slot_asks_for_a_state_of_its_own_size(tmp_path, sandbox):
    made, scripted, _ = await one_slot(tmp_path, sandbox, "plain", [TASK], [GOLD], "scenarios.per_environment=4",
                                       'scenarios.method="llm"', "scenarios.min_records=2")  # fmt: skip
    asked = sorted(
        int(r.messages[1].content.rsplit("with at least ", 1)[1].split(" ", 1)[0])
        for r in scripted.requests
        if schema_name(r) == "InitialState"
    )
    assert asked == [2, 4, 6, 8]
    # The gate holds every slot to min_records: the bank's 3 customers pass where 8 were asked for.
    assert not any(isinstance(r, Rejection) and r.reason == "state_too_small" for r in made)
