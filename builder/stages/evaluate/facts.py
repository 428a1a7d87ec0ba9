"""The facts the tester and the checker are shown: the prompts' user messages, laid out for the prefix cache
(what repeats from one request to the next first, what varies after it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from builder.envs.session import ToolResult, diff_states
from builder.evidence import JudgedCall
from builder.records import Environment
from builder.stages.evaluate.agents import VERDICTS_PART, CaseType, shares_start, slot_text
from builder.stages.evaluate.sequential import Decision
from builder.views.budget import PromptBudget
from builder.views.code import class_header, environment_source, environment_text, method_source, now_text
from builder.views.state import clip_json, state_text

CASE_TEXT = {
    "positive": "a POSITIVE case (input a correct implementation accepts)",
    "negative": "a NEGATIVE case (input a correct implementation refuses with an error value)",
    "unscheduled": "a case the tester chose itself (decide from the arguments whether the input is valid)",
}


@dataclass(frozen=True)
class TestState:
    index: int
    purpose: str
    state: dict[str, Any]
    now: str  # the sandbox clock of every session on this state, chosen with it


@dataclass
class StateRun:
    """What happened on one test state: judged calls and the replies that could not be used."""

    quota: int
    judged: list[JudgedCall] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)
    settled: Decision | None = None  # the verdict the sequential rule reached before `quota` calls were judged

    def gave_up(self, max_invalid: int) -> bool:
        return len(self.invalid) > max_invalid


@dataclass
class Ran:
    """A call of a batch that reached the environment and awaits the checker."""

    number: int
    call: dict[str, Any]
    result: ToolResult
    before: dict[str, Any]
    after: dict[str, Any]
    changes: list[dict[str, Any]]


def _tester_facts(
    state: TestState, run: StateRun, first: dict[str, Any], current: dict[str, Any], history_calls: int,
    budget: PromptBudget, slots: list[tuple[str, CaseType]], feedback: str = "",
) -> str:  # fmt: skip
    """The state as first set up (`first`, the session's state before its first call) and what the calls since
    changed, then the recent calls and the numbered slots: the first part is the same in every round of the state
    (a model server's prefix cache reuses it), the changes, calls and numbers are not. Once the changes take
    more text than the current state, the current state is shown instead."""
    done = len(run.judged)
    recent = run.judged[-history_calls:] if history_calls else []
    lines = [f"- {c.tool}({json.dumps(c.arguments)}) -> {c.result or c.error}" for c in recent]
    history = "\n".join(lines) or "- none yet"
    # After unusable tester items the request must differ (or a cached reply would repeat the mistake), and the
    # tester should learn what was wrong (`feedback`). A checker's failure is not the tester's business.
    note = f"\n\nYour previous reply was partly unusable: {feedback}" if feedback else ""
    asked = "\n".join(slot_text(number, slot) for number, slot in enumerate(slots, 1))
    return (
        f"Test state {state.index + 1}, as first set up: {state.purpose}\n"
        f"Now: {now_text(state.now)}.\n\n"
        f"{state_since(first, current, budget, 'now')}\n\n"
        f"Recent calls on this state:\n{history}\n\n"
        f"Calls {done + 1} to {done + len(slots)} of {run.quota} on this state, numbered 1 to {len(slots)} here, to "
        f"run in this order:\n{asked}{note}"
    )


def state_since(first: dict[str, Any], current: dict[str, Any], budget: PromptBudget, moment: str) -> str:
    """The state as first set up (the same text in every request about this test state, so a model server's
    prefix cache reuses it), then what the calls since changed (`- path: value <moment>`). Once the changes take
    more text than the state at `moment`, that state is shown instead."""
    changed = changes_text(diff_states(first, current), budget.state_chars)
    at_moment = state_text(current, budget)
    if len(changed) > len(at_moment):
        return f"State {moment} (JSON):\n{at_moment}"
    return (
        f"State as first set up (JSON):\n{state_text(first, budget)}\n\n"
        f"Changed since by the calls on this state (path: value {moment}):\n{changed or '- nothing yet'}"
    )


def changes_text(changes: list[dict[str, Any]], limit: int) -> str:
    """Changes as `- path: value now` lines (`removed` for a value gone), each value cut to `limit` characters."""
    return "\n".join(
        f"- {change['path']}: {clip_json(change['after'], limit) if 'after' in change else 'removed'}"
        for change in changes
    )


def _batch_facts(
    env: Environment, ran: list[Ran], first: dict[str, Any], budget: PromptBudget, now: str, whole: bool = True
) -> str:  # fmt: skip
    """What the checker judges a batch on, laid out for the prefix cache: the environment's whole source (every
    checker request of the environment starts with it: the rules, the state definition, every method and helper),
    the test state's clock and the state as first set up (every request about that test state repeats them), then
    what varies: the changes of the earlier calls on the state, and each call of the batch with its case,
    arguments, result and exact changes. The state each call began on is that state plus the changes before it,
    as the tester reads it too; a state shown before every call would be most of the request and new each time.

    Without `whole` (`shows_whole_source`), or built smaller (a prompt too long for the context, `budget.level`
    > 0), the source is cut to what the batch needs: the description and rules, the state definition and the
    source of each tool called."""
    calls = "\n\n".join(
        f"## Call {item.number}\n\n{_call_facts(item, previous, budget)}"
        for previous, item in zip([None, *ran], ran, strict=False)
    )
    called = list(dict.fromkeys(item.call["tool"] for item in ran))
    shared = shares_start(budget, whole)
    head = f"{environment_source(env)}\n\n{VERDICTS_PART}" if shared else _called_source(env, called)
    return (
        f"{head}\n\nNow: {now_text(now)}.\n\n"
        f"{state_since(first, ran[0].before, budget, 'before call 1')}\n\n"
        f"{len(ran)} call(s) ran in this order, call 1 on the state above, each later one on the state the one "
        f"before it left. Give one verdict per call, with its number.\n\n{calls}"
    )


def shows_whole_source(calls: int, tools: int) -> bool:
    """Whether the checker requests of an environment start with its whole source: when the check calls every
    tool at least twice (`calls` judged calls; the schedule takes the tools in turn, so each batch has other
    tools and would send their sources again), sending the whole class once, as the prefix every request
    repeats, leaves a server with a prefix cache less to compute. With fewer calls the batches' own sources are
    less text (about the whole class once, and no later request reuses it)."""
    return calls >= 2 * tools


def _called_source(env: Environment, tools: list[str]) -> str:
    methods = "\n\n".join(f"```python\n{method_source(env.code, name)}\n```" for name in tools)
    return (
        f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
        f"State definition:\n```python\n{class_header(env.code)}\n```\n\n"
        f"Source of the tools called below (each tool is the method of its name):\n\n{methods}"
    )


def _checker_facts(
    env: Environment, call: dict[str, Any], result: ToolResult, before: dict[str, Any], after: dict[str, Any],
    changes: list[dict[str, Any]], budget: PromptBudget, now: str, whole: bool = True,
) -> str:  # fmt: skip
    """The facts of one call on a fresh session of a test state (`before`), as a batch of one: the rule probes'
    confirmations, whose start is the same as the batches' on that state."""
    return _batch_facts(env, [Ran(1, call, result, before, after, changes)], before, budget, now, whole)


def _call_facts(item: Ran, previous: Ran | None, budget: PromptBudget) -> str:
    limit = budget.state_chars
    changes = item.changes
    # A call that broke at runtime between two judged ones (not shown; it is judged without the checker) may
    # have changed the state the next one began on.
    between = diff_states(previous.after, item.before) if previous is not None else []
    gap = f"Before it, a call not shown here changed: {clip_json(between, limit)}\n\n" if between else ""
    return (
        f"{gap}Tool under test: `{item.call['tool']}`, {CASE_TEXT[item.call['case']]}.\n"
        f"Arguments: {json.dumps(item.call['arguments'], ensure_ascii=False)}\n"
        f"Result: {clip_json(item.result.result, limit)}\n"
        f"Changes: {clip_json(changes, limit) if changes else 'none: the state did not change'}"
        f"{_outcome_note(item.result, changes)}"
    )


def _outcome_note(result: ToolResult, changes: list[dict[str, Any]]) -> str:
    """A fact small models miss: a result that reports failure while the state changed (or the reverse)."""
    success = result.result.get("success") if isinstance(result.result, dict) else None
    if success is False and changes:
        return "\nNote: the result reports failure, yet the state changed."
    if success is False:
        return "\nNote: the result reports failure and the state is unchanged."
    return ""
