"""The dual-agent check: per test state, the tester agent proposes tool calls (a schedule of positive and negative
cases over every tool), each runs in a sandbox session, and the checker agent judges the outcome against the
method's source and the state diff."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError, ToolResult, diff_states
from builder.evidence import JudgedCall
from builder.records import Environment
from builder.run.stage import StageContext
from builder.stages._llm import shrinking
from builder.stages.evaluate.agents import Agents, CaseType, CheckerVerdict, InvalidReply
from builder.stages.evaluate.cases import admits_wrong_value
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import attributes_used, class_header, environment_text, method_source, now_text
from builder.views.state import clip_json, state_text, state_view

T = TypeVar("T")


# Session error kinds that mean the tester's call never reached the environment: the tester's fault.
TESTER_ERRORS = {"unknown_tool", "bad_arguments"}


CASE_TEXT = {
    "positive": "a POSITIVE case (input a correct implementation accepts)",
    "negative": "a NEGATIVE case (input a correct implementation refuses with an error value)",
    "unscheduled": "a case the tester chose itself (decide from the arguments whether the input is valid)",
}


EVIDENCE_CHARS = 600  # per result and per diff in the stored evidence, so 100 calls stay a small JSON


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


def schedule(tools: tuple[str, ...], position: int, negatable: Collection[str]) -> tuple[str, CaseType]:
    """The tool and case type of the `position`-th judged call: the tools in turn, cases alternating positive and
    negative within each lap and swapped in the next, so half the judged calls test a refusal however few they
    are (with fewer calls than tools, a first lap of positives only would test no rule at all), and every tool
    gets both cases over two laps.

    A tool outside `negatable` (no argument it accepts can be wrong, e.g. only an optional flag) gets a positive
    case in its negative slots too: asking for a NEGATIVE case there only makes the tester invent one.
    """
    lap, index = divmod(position, len(tools))
    name = tools[index]
    return name, ("negative" if (lap + index) % 2 and name in negatable else "positive")


def negatable_tools(tools: Collection[dict[str, Any]]) -> frozenset[str]:
    """The tools that admit a schema-valid argument a correct implementation must refuse."""
    return frozenset(t["function"]["name"] for t in tools if admits_wrong_value(t["function"]["parameters"]))


async def exercise_all(
    env: Environment, interface: EnvInterface, states: list[TestState], ctx: StageContext, agents: Agents
) -> list[StateRun]:
    """Split `evaluate.calls` over the states and exercise each state in its own session, concurrently."""
    total = ctx.config.evaluate.calls
    quotas = [total // len(states) + (i < total % len(states)) for i in range(len(states))]
    starts = [sum(quotas[:i]) for i in range(len(states))]
    runs = [StateRun(quota) for quota in quotas]
    await _all([exercise(env, interface, *job, ctx, agents) for job in zip(states, runs, starts, strict=True)])
    return runs


async def _all(jobs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `jobs` concurrently; the first error cancels the rest (no orphan requests) and is raised as is."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None  # callers handle plain errors (LLMRequestError, SessionError)
    return [task.result() for task in tasks]


async def exercise(
    env: Environment, interface: EnvInterface, state: TestState, run: StateRun, start: int,
    ctx: StageContext, agents: Agents,
) -> None:  # fmt: skip
    """Rounds on one test state until `run.quota` calls are judged or too many replies were unusable."""
    config = ctx.config.evaluate
    budgets = prompt_budgets(ctx.config.llm.max_state_chars)
    negatable = negatable_tools(interface.tools)
    session = await asyncio.to_thread(_session, ctx.sandbox, env.code, state, interface)
    try:
        position = start
        while len(run.judged) < run.quota and len(run.invalid) <= config.max_invalid_replies:
            slot = schedule(interface.tool_names, position, negatable)
            where = {"state": state.index, "round": len(run.judged) + len(run.invalid)}
            try:
                before = await asyncio.to_thread(session.snapshot)
            except SessionError:  # the worker died and replaying the calls failed: start over from the state
                await asyncio.to_thread(session.close)
                session = await asyncio.to_thread(_session, ctx.sandbox, env.code, state, interface)
                before = await asyncio.to_thread(session.snapshot)
            propose = partial(_propose, agents, env, interface, slot, state, run, before, config.history_calls)
            try:
                name, arguments, raw = await shrinking(ctx, "evaluate_tester", budgets, propose)
            except InvalidReply as invalid:
                run.invalid.append({**where, "kind": invalid.kind, "detail": invalid.detail, "raw": invalid.raw})
                continue
            result = await asyncio.to_thread(session.call, name, arguments)
            if result.error_kind in TESTER_ERRORS:
                run.invalid.append({**where, "kind": result.error_kind, "detail": result.error, "raw": raw})
                continue
            position += 1
            case = slot[1] if name == slot[0] else "unscheduled"
            call = {**where, "tool": name, "case": case, "arguments": arguments}
            try:
                after = await asyncio.to_thread(session.snapshot)
            except SessionError as error:
                run.judged.append(_ruled(call, result, [], "fail", f"state_not_json: {error}", "runtime"))
                await asyncio.to_thread(session.close)
                session = await asyncio.to_thread(_session, ctx.sandbox, env.code, state, interface)
                continue
            changes = diff_states(before, after)
            if not result.ok:  # raised, hung, crashed, non-JSON result: the environment broke its contract
                run.judged.append(
                    _ruled(call, result, changes, "fail", f"{result.error_kind}: {result.error}", "runtime")
                )
                continue
            check = partial(_check, agents, env, call, result, before, after, changes, now=state.now)
            try:
                verdict = await shrinking(ctx, "evaluate_checker", budgets, check)
            except InvalidReply as invalid:
                run.invalid.append({**where, "kind": invalid.kind, "detail": invalid.detail, "raw": invalid.raw})
                continue
            run.judged.append(_ruled(call, result, changes, verdict.verdict, verdict.reason, "checker"))
    finally:
        await asyncio.to_thread(session.close)


async def _propose(
    agents: Agents, env: Environment, interface: EnvInterface, slot: tuple[str, CaseType], state: TestState,
    run: StateRun, current: dict[str, Any], history_calls: int, budget: PromptBudget,
) -> tuple[str, dict[str, Any], str]:  # fmt: skip
    facts = _tester_facts(state, run, current, history_calls, budget)
    return await agents.propose(env, interface.tools, slot, facts)


async def _check(
    agents: Agents, env: Environment, call: dict[str, Any], result: ToolResult, before: dict[str, Any],
    after: dict[str, Any], changes: list[dict[str, Any]], budget: PromptBudget, *, now: str,
) -> CheckerVerdict:  # fmt: skip
    facts = _checker_facts(env, call, result, before, after, changes, budget, now)
    return await agents.ask_json(agents.checker_messages(facts), CheckerVerdict, "checker")


def _ruled(
    call: dict[str, Any], result: ToolResult, changes: list[dict[str, Any]], verdict: str, reason: str, judge: str
) -> JudgedCall:
    return JudgedCall(
        **call,
        result=clip_json(result.result, EVIDENCE_CHARS) if result.ok else None,
        error_kind=result.error_kind,
        error=(result.error or "")[:EVIDENCE_CHARS] or None,
        changes=clip_json(changes, EVIDENCE_CHARS) if changes else None,
        verdict=verdict,
        reason=" ".join(reason.split())[:EVIDENCE_CHARS],
        judge=judge,
    )


def _session(sandbox: Any, code: str, state: TestState, interface: EnvInterface) -> Session:
    return Session(sandbox, code, state.state, interface, now=state.now)


def _tester_facts(
    state: TestState, run: StateRun, current: dict[str, Any], history_calls: int, budget: PromptBudget
) -> str:
    done = len(run.judged)
    recent = run.judged[-history_calls:] if history_calls else []
    lines = [f"- {c.tool}({json.dumps(c.arguments)}) -> {c.result or c.error}" for c in recent]
    history = "\n".join(lines) or "- none yet"
    # After an unusable tester reply the request must differ (or a cached reply would repeat the mistake), and
    # the tester should learn what was wrong. A checker's failure is not the tester's business.
    last = run.invalid[-1] if run.invalid and run.invalid[-1]["round"] == done + len(run.invalid) - 1 else None
    last = last if last and last["kind"] != "checker_invalid" else None
    feedback = f"\n\nYour previous reply was unusable ({last['kind']}): {last['detail']}" if last else ""
    # The call's number comes after the state: the state and the calls before repeat from one round to the next
    # (a model server's prefix cache reuses them), the number never does.
    return (
        f"Test state {state.index + 1}, as first set up: {state.purpose}\n"
        f"Now: {now_text(state.now)}.\n\n"
        f"Current state (JSON):\n{state_text(current, budget)}\n\n"
        f"Recent calls on this state:\n{history}\n\n"
        f"Call {done + 1} of {run.quota} on this state; the current state above includes the calls made since."
        f"{feedback}"
    )


def _checker_facts(
    env: Environment, call: dict[str, Any], result: ToolResult, before: dict[str, Any], after: dict[str, Any],
    changes: list[dict[str, Any]], budget: PromptBudget, now: str,
) -> str:  # fmt: skip
    limit = budget.state_chars
    name = call["tool"]
    used = attributes_used(env.code, name)
    return (
        f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
        f"State definition:\n```python\n{class_header(env.code)}\n```\n\n"
        f"Method source of `{name}`:\n```python\n{method_source(env.code, name)}\n```\n\n"
        f"Now: {now_text(now)}.\n\n"
        f"State before (attributes the method uses):\n{state_text(state_view(before, used), budget)}\n\n"
        f"Tool under test: `{name}`, {CASE_TEXT[call['case']]}.\n"
        f"Arguments: {json.dumps(call['arguments'], ensure_ascii=False)}\n"
        f"Result: {clip_json(result.result, limit)}\n\n"
        f"State after:\n{state_text(state_view(after, used), budget) if changes else '(identical to the state before)'}"
        f"\n\nChanges: {clip_json(changes, limit) if changes else 'none: the state did not change'}"
        f"{_outcome_note(result, changes)}"
    )


def _outcome_note(result: ToolResult, changes: list[dict[str, Any]]) -> str:
    """A fact small models miss: a result that reports failure while the state changed (or the reverse)."""
    success = result.result.get("success") if isinstance(result.result, dict) else None
    if success is False and changes:
        return "\nNote: the result reports failure, yet the state changed."
    if success is False:
        return "\nNote: the result reports failure and the state is unchanged."
    return ""
