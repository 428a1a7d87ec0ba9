"""Prompts laid out for a model server's prefix cache (issue 29): the requests of one environment share their
start, and what varies from one request to the next (the state, the call, its result) comes after it.

A request's prompt is read as `builder.llm.prefix` reads it (the text a chat template starts from), so a layout
change that puts a varying part before a shared one fails here, not only in a run's `prefix_reuse`.
"""

from __future__ import annotations

import os
from pathlib import Path

from builder.config import EvaluateConfig
from builder.envs.schema import inspect_source
from builder.envs.session import ToolResult, diff_states
from builder.llm import ChatRequest
from builder.llm.prefix import PrefixIndex, prompt_text
from builder.prompts import prompt
from builder.records import Environment
from builder.stages.evaluate.agents import Agents, shares_start
from builder.stages.evaluate.exercise import StateRun, _tester_facts
from builder.stages.evaluate.exercise import TestState as StateUnderTest
from builder.stages.evaluate.facts import Ran, _batch_facts, shows_whole_source
from builder.stages.scenarios.writers import writer_messages
from builder.views.budget import prompt_budgets
from builder.views.code import class_header, writer_sources

BANK = (Path(__file__).parent / "fixtures" / "envs" / "bank.py").read_text()
STATE = {
    "customers": {"c7": {"name": "Grace Hopper", "tier": "silver"}, "c8": {"name": "Alan Turing", "tier": "gold"}},
    "accounts": {
        "acc-7": {"owner": "c7", "balance": 2500, "kind": "checking", "frozen": False},
        "acc-8": {"owner": "c8", "balance": 90000, "kind": "savings", "frozen": False},
    },
    "transfers": [],
    "daily_limit": 40000,
}
AFTER = {**STATE, "transfers": [{"source": "acc-7", "target": "acc-8", "amount": 100}]}
NOW = "2025-03-14T09:30:00"
BUDGET = prompt_budgets(20_000)[0]


def bank() -> Environment:
    return Environment(
        provenance={"config_hash": "h", "parent_ids": ["plan-1"]}, plan_id="plan-1", name="bank", class_name="Bank",
        description="A retail bank's accounts and transfers.", domain="banking", code=BANK,
        tools=list(inspect_source(BANK).tools), state_schema={},
    )  # fmt: skip


def shared_start(first: str, second: str) -> str:
    return os.path.commonprefix([first, second])


AGENTS = Agents(llm=None, config=EvaluateConfig(), retries=0, seed=0)  # type: ignore[arg-type]
SMALLER = prompt_budgets(20_000)[1]  # a prompt built again one level smaller (too long for the context)


def text(messages) -> str:
    return prompt_text(ChatRequest(messages=tuple(messages)))


def ran(number: int, tool: str, arguments: dict, result: dict, after: dict, case: str, before=STATE) -> Ran:
    changes = diff_states(before, after)
    call = {"tool": tool, "arguments": arguments, "case": case}
    return Ran(number, call, ToolResult(name=tool, ok=True, result=result), before, after, changes)


def checker_prompt(batch: list[Ran], now: str = NOW, budget=BUDGET, whole: bool = True, first=STATE) -> str:
    facts = _batch_facts(bank(), batch, first, budget, now, whole)
    return text(AGENTS.checker_messages(facts, shares_start(budget, whole)))


MOVE = {"source": "acc-7", "target": "acc-8", "amount": 100}
TRANSFER = ran(1, "transfer", MOVE, {"success": True}, AFTER, "positive")
LOOKUP = ran(1, "get_account", {"account_id": "acc-404"}, {"success": False, "error": "no account"}, STATE, "negative")
FREEZE = ran(2, "freeze_account", {"account_id": "acc-8"}, {"success": True}, STATE, "positive")


def test_checker_requests_of_one_environment_share_its_whole_source_whatever_they_judge():
    """Two batches with other tools, on two test states with other clocks: one prefix up to the clock, holding
    the instructions and the environment's whole source (every method, the one under test or not)."""
    first, second = checker_prompt([TRANSFER]), checker_prompt([LOOKUP, FREEZE], now="2025-04-01T08:00:00")
    start = shared_start(first, second)
    assert "```\n\n## Part\n`verdicts`\n\nNow: 2025-0" in start and start.count("Now: ") == 1  # dates differ by month
    assert all(f"def {name}(self" in start for name in ("transfer", "get_account", "freeze_account", "list_accounts"))
    assert "overdraft rule" in start and "def __init__(self" in start  # the docstring, the state definition
    assert "Tool under test" not in start and "State before" not in start
    assert len(start) > 0.6 * min(len(first), len(second))
    # The calls themselves follow it, each without a source of its own.
    assert "Method source" not in second and second.count("Tool under test") == 2


def test_checker_batches_on_one_state_share_the_state_as_first_set_up_and_show_only_what_changed_after_it():
    """Batch 1 and batch 2 on one test state: one start up to the state as first set up; batch 2 sees what batch 1
    changed (`- path: value before call 1`) and each call's arguments, result and exact changes, no state of its
    own (teacher-12e: the states before and after each call were 60% and 25% of a request's new text)."""
    first = checker_prompt([TRANSFER])
    frozen = {**AFTER, "accounts": {**AFTER["accounts"], "acc-8": {**AFTER["accounts"]["acc-8"], "frozen": True}}}
    later = [
        ran(1, "get_account", {"account_id": "acc-404"}, {"success": False}, AFTER, "negative", before=AFTER),
        ran(2, "freeze_account", {"account_id": "acc-8"}, {"success": True}, frozen, "positive", before=AFTER),
    ]
    second = checker_prompt(later)
    start = shared_start(first, second)
    assert start.endswith("Changed since by the calls on this state (path: value before call 1):\n- ")
    assert '"daily_limit":40000' in start and '"transfers":[]' in start  # the state as first set up, once
    assert "- nothing yet" in first and '- transfers: [{"source":"acc-7","target":"acc-8","amount":100}]' in second
    assert second.count('"daily_limit":40000') == 1 and "State before" not in second and "State after" not in second
    assert 'Changes: [{"path":"accounts.acc-8.frozen","before":false,"after":true}]' in second
    assert "Changes: none: the state did not change" in second
    assert len(start) > 0.85 * len(second)


def test_checker_is_told_of_a_change_between_two_calls_it_does_not_judge():
    """A call that broke at runtime between two judged ones is not shown, but what it changed is, so the state
    each judged call began on still follows from the text."""
    frozen = {**STATE, "accounts": {**STATE["accounts"], "acc-7": {**STATE["accounts"]["acc-7"], "frozen": True}}}
    batch = [TRANSFER, ran(2, "get_account", {"account_id": "acc-7"}, {"success": True}, frozen, "positive",
                           before=frozen)]  # fmt: skip
    shown = checker_prompt(batch)
    note = 'Before it, a call not shown here changed: [{"path":"accounts.acc-7.frozen","before":false,"after":true}'
    assert shown.count("Before it, a call not shown here changed") == 1
    assert shown.index("## Call 2") < shown.index(note) < shown.index("`get_account`")


def test_checker_sees_the_state_before_its_calls_once_the_changes_are_longer():
    big = {**STATE, "transfers": [{"source": "acc-7", "target": "acc-8", "amount": n} for n in range(60)]}
    batch = [ran(1, "get_account", {"account_id": "acc-7"}, {"success": True}, big, "positive", before=big)]
    shown = checker_prompt(batch, budget=prompt_budgets(1500)[0])
    assert "State before call 1 (JSON):" in shown and "State as first set up" not in shown
    assert '"amount":0' in shown


def state_prompt(index: int, whole: bool = True, budget=BUDGET) -> str:
    env = bank()
    return text(AGENTS.state_messages(env, class_header(env.code), STATE, index, budget, whole))


def test_a_test_state_request_and_the_checker_requests_of_an_environment_share_its_instructions_and_source():
    """The test-state writer's request comes first for an environment; the checker's then find the environment's
    source already computed (one system message for both parts, then the source, then `## Part`)."""
    state, checker = state_prompt(0), checker_prompt([TRANSFER])
    start = shared_start(state, checker)
    assert start.endswith("```\n\n## Part\n`") and "def list_accounts(self" in start
    assert "# The part `test state`" in start and "# The part `verdicts`" in start
    assert len(start) > 0.7 * len(state)
    assert shared_start(state_prompt(0), state_prompt(1)).endswith("Write test state ")  # they differ from there
    # With few calls (the checker shows the called tools only) or built smaller, the state definition instead.
    for narrow in (state_prompt(0, whole=False), state_prompt(0, budget=SMALLER)):
        assert "State definition:" in narrow and "def list_accounts(self" not in narrow
        assert "# The part `verdicts`" not in narrow and "## Part" not in narrow  # its own instructions only


def test_checker_shows_only_the_called_sources_when_few_calls_or_a_smaller_prompt():
    # Every tool called at least twice: the whole source once costs a caching server less than each batch's own.
    assert shows_whole_source(calls=100, tools=4) and shows_whole_source(38, 19)
    assert not shows_whole_source(7, 4) and not shows_whole_source(10, 19)  # teacher-9: 10 calls, 19 tools
    for few in (checker_prompt([LOOKUP, FREEZE], whole=False), checker_prompt([LOOKUP, FREEZE], budget=SMALLER)):
        assert "def get_account(self" in few and "def freeze_account(self" in few
        assert "def transfer(self" not in few and "def list_accounts(self" not in few
        assert few.index("def freeze_account(self") < few.index("Now: ") < few.index("Tool under test")
        assert "# The part `test state`" not in few and "## Part" not in few


def round_prompt(run: StateRun, current: dict, slots, done: int, budget=BUDGET) -> str:
    state = StateUnderTest(index=0, purpose="a busy branch", state=STATE, now=NOW)
    facts = _tester_facts(state, run, STATE, current, 0, budget, slots).replace("Calls 1 to", f"Calls {done} to")
    return text(AGENTS.tester_messages(bank(), bank().tools, facts))


def test_tester_rounds_on_one_state_share_the_state_as_first_set_up_and_see_the_changes_after_it():
    run = StateRun(quota=10)
    first = round_prompt(run, STATE, [("transfer", "positive"), ("get_account", "negative")], 1)
    second = round_prompt(run, AFTER, [("freeze_account", "negative")], 3)
    start = shared_start(first, second)
    # Instructions, the environment, its tool schemas, the test state's purpose, its clock and the state as first
    # set up are one prefix; what the calls changed, the recent calls and the round's slots come after.
    assert '"name": "transfer"' in start
    assert start.endswith("Changed since by the calls on this state (path: value now):\n- ")
    assert '"acc-8"' in start and '"transfers":[]' in start
    assert "- nothing yet" in first and '- transfers: [{"source":"acc-7"' in second
    assert "1. `freeze_account` with a NEGATIVE case" in second and "`transfer` with a" not in start
    assert "of 10 on this state, numbered 1 to 1 here, to run" in second  # the slots' numbers (teacher-14)
    assert len(start) > 0.85 * min(len(first), len(second))


def test_tester_sees_the_current_state_once_the_changes_are_longer():
    """Changes that outgrow the state as the budget shows it (cut to whole records) give way to that state."""
    big = {**STATE, "transfers": [{"source": "acc-7", "target": "acc-8", "amount": n} for n in range(60)]}
    shown = round_prompt(StateRun(quota=10), big, [("transfer", "positive")], 1, budget=prompt_budgets(1500)[0])
    assert "State now (JSON):" in shown and "State as first set up" not in shown
    assert '"amount":0' in shown and "more transfers not shown" in shown


def test_the_gold_request_of_a_scenario_repeats_its_task_request_up_to_the_part_asked_for():
    env = bank()
    task = writer_messages(env, BUDGET, NOW, STATE, "task", "\n\n## The kind of task\nmissing information")
    gold = writer_messages(env, BUDGET, NOW, STATE, "solution", "\n\n## Task\nMove 100 from acc-7 to acc-8.")
    first, second = text(task), text(gold)
    start = shared_start(first, second)
    assert start.endswith("## Write\nThe part `")
    assert prompt("scenario_task") in start and prompt("scenario_gold") in start  # both parts' instructions
    assert '"acc-7"' in start and '"name": "transfer"' in start  # the state and the tools
    index = PrefixIndex()
    index.observe(first)
    reused, chars = index.observe(second)
    assert reused / chars > 0.9


def test_check_writer_methods_are_in_the_class_order_whatever_the_call_order():
    code = bank().code
    assert writer_sources(code, ["transfer", "freeze_account"], BUDGET) == writer_sources(
        code, ["freeze_account", "get_account", "transfer"], BUDGET
    )
    shown = writer_sources(code, ["transfer", "freeze_account"], BUDGET)
    assert code.index("def transfer(") < code.index("def freeze_account(")  # the fixture's own order
    assert shown.index("def transfer(") < shown.index("def freeze_account(")


def test_user_simulator_rules_come_before_what_differs_per_scenario():
    template = prompt("user_sim")
    assert template.index("Rules:") < min(template.index(f"${field}") for field in ("profile", "now", "task"))
