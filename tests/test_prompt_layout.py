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
from builder.envs.session import ToolResult
from builder.llm import ChatRequest
from builder.llm.prefix import prompt_text
from builder.records import Environment
from builder.stages.evaluate.agents import Agents
from builder.stages.evaluate.exercise import StateRun, _checker_facts, _tester_facts
from builder.stages.evaluate.exercise import TestState as StateUnderTest
from builder.views.budget import prompt_budgets

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


def checker_prompt(env: Environment, arguments: dict, result: ToolResult, after: dict, case: str) -> str:
    call = {"tool": "transfer", "arguments": arguments, "case": case}
    changes = [{"path": "transfers", "op": "add"}] if after != STATE else []
    facts = _checker_facts(env, call, result, STATE, after, changes, BUDGET, NOW)
    agents = Agents(llm=None, config=EvaluateConfig(), retries=0, seed=0)  # type: ignore[arg-type]
    return prompt_text(ChatRequest(messages=tuple(agents.checker_messages(facts))))


def test_two_checker_requests_on_one_state_share_everything_up_to_the_call():
    env = bank()
    good = checker_prompt(
        env, {"source": "acc-7", "target": "acc-8", "amount": 100}, ToolResult(name="transfer", ok=True,
        result={"success": True}), AFTER, "positive",
    )  # fmt: skip
    refused = checker_prompt(
        env, {"source": "acc-404", "target": "acc-8", "amount": 5}, ToolResult(name="transfer", ok=True,
        result={"success": False, "error": "no such account"}), STATE, "negative",
    )  # fmt: skip
    start = shared_start(good, refused)
    # The instructions, the environment, the state definition, the method's source, the clock and the state
    # before the call are one prefix; the call itself (case, arguments, result, state after) follows it.
    assert "def transfer" in start and "Now:" in start
    assert "State before" in start and '"acc-7"' in start
    assert "Tool under test: `transfer`, a" in start and "Arguments" not in start
    assert len(start) > 0.7 * min(len(good), len(refused))


def test_two_tester_requests_on_one_state_share_everything_up_to_the_round():
    env = bank()
    agents = Agents(llm=None, config=EvaluateConfig(), retries=0, seed=0)  # type: ignore[arg-type]
    state = StateUnderTest(index=0, purpose="a busy branch", state=STATE, now=NOW)
    run = StateRun(quota=10)
    prompts = []
    for slots, done in (
        ([("transfer", "positive"), ("get_account", "negative")], 3),
        ([("freeze_account", "negative")], 5),
    ):
        facts = _tester_facts(state, run, STATE, 0, BUDGET, slots).replace("Calls 1 to", f"Calls {done} to")
        prompts.append(prompt_text(ChatRequest(messages=tuple(agents.tester_messages(env, env.tools, facts)))))
    first, second = prompts
    start = shared_start(first, second)
    # Instructions, the environment, its tool schemas, the test state's purpose, its clock and the current state
    # are one prefix; the round (its numbers, the slots asked for) comes after.
    assert '"acc-8"' in start and "Recent calls on this state" in start and '"name": "transfer"' in start
    assert start.endswith("Recent calls on this state:\n- none yet\n\nCalls ")
    assert "`transfer` with a" not in start
    assert len(start) > 0.85 * min(len(first), len(second))
