"""evaluate: accept or reject each candidate environment, first by deterministic gates, then by the dual-agent check.

1. Gates (`builder env check`): lint, load, every tool called with schema-valid arguments, twice in fresh
   workers (determinism), JSON state, no crash or hang; plus the stored tool schemas must be the code's. A tool
   that fails its probe is repaired through the code stage, at most `evaluate.fuzz_repairs` times
   (`gates`); a repaired environment is a new record (new code, new id, `synthesis.repairs`).
2. Test states: `evaluate.test_states` initial states as structured output, each validated against the state
   schema, its references checked (an empty value is no reference) and loaded in a sandbox session (failures
   fed back, bounded).
3. Dual-agent check: for each test state its own session; the harness schedules which tool to test and whether
   with a positive or a negative case (every tool positive first, then negative, and so on; a tool no argument
   of which can be wrong gets positive cases only), the tester agent picks the arguments through a forced tool
   call, the call runs in the session, and the checker agent rules pass / warning / fail from the rules, the
   method source, the arguments, the result and the state before, after and diffed. Calls that crash, hang or
   return non-JSON are failures without asking the checker. Unknown tools and arguments off the schema are the
   tester's error: not counted, bounded by `max_invalid_replies` per state. States in prompts are whole records
   (`state_text`); a prompt too long for the model's context is retried with fewer records.
4. Score = (pass + warning) / judged calls over `evaluate.calls` calls; accepted at `keep_score` or above and
   upserted into the store by the runner; the per-call verdicts are the evidence (`Environment.evaluation`).

Rejection reasons: gates_failed, no_valid_test_state, tester_invalid, checker_invalid, low_score, llm_request,
prompt_too_long, session_failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

from builder import __version__
from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError, ToolResult, diff_states
from builder.envs.state_schema import generated_state_schema
from builder.llm import LLMRequestError, PromptTooLongError
from builder.prompts import prompt_version
from builder.records import Environment, Record
from builder.run.stage import Rejected, StageContext
from builder.sandbox.world import DEFAULT_NOW
from builder.stages.evaluate.agents import Agents, CaseType, CheckerVerdict, InvalidReply
from builder.stages.evaluate.gates import passing_gates
from builder.stages.evaluate.source import (
    admits_wrong_value,
    attributes_used,
    class_header,
    clip_json,
    environment_text,
    method_source,
    now_text,
    state_output_type,
    state_text,
    state_view,
)
from builder.stages.scenarios.state import reference_problems

logger = logging.getLogger(__name__)
T = TypeVar("T")

PROMPTS = ("evaluate_state", "evaluate_tester", "evaluate_checker")
# Session error kinds that mean the tester's call never reached the environment: the tester's fault.
TESTER_ERRORS = {"unknown_tool", "bad_arguments"}
CASE_TEXT = {
    "positive": "a POSITIVE case (input a correct implementation accepts)",
    "negative": "a NEGATIVE case (input a correct implementation refuses with an error value)",
    "unscheduled": "a case the tester chose itself (decide from the arguments whether the input is valid)",
}
EVIDENCE_CHARS = 600  # per result and per diff in the stored evidence, so 100 calls stay a small JSON
MIN_STATE_CHARS = 200  # a prompt that is too long even with this little state is rejected (`prompt_too_long`)


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
    judged: list[dict[str, Any]] = field(default_factory=list)
    invalid: list[dict[str, Any]] = field(default_factory=list)


async def evaluate(env: Environment, ctx: StageContext) -> list[Record]:
    """The environment accepted (with scores and evidence; the runner upserts it into the store) or a rejection."""
    env, interface, default_state = await passing_gates(env, ctx)
    agents = Agents(ctx.llm, ctx.config.evaluate, retries=ctx.config.llm.structured_retries, seed=ctx.config.run.seed)
    try:
        states, failures = await make_test_states(env, interface, default_state, ctx, agents)
        if not states:
            detail = "; ".join(f"state {i + 1}: {f.detail}" for i, f in failures)[:2000]
            raise Rejected(ctx.reject(env, "no_valid_test_state", detail, raw_output=failures[-1][1].raw))
        runs = await exercise_all(env, interface, states, ctx, agents)
    except PromptTooLongError as error:
        raise Rejected(ctx.reject(env, "prompt_too_long", str(error)[:2000])) from None
    except LLMRequestError as error:
        if error.retryable:
            raise  # the server is gone: stop the run, a rerun resumes
        raise Rejected(ctx.reject(env, "llm_request", str(error)[:2000])) from None
    except SessionError as error:  # a session broke beyond replay (its state could no longer be read or restored)
        raise Rejected(ctx.reject(env, "session_failed", f"{error.kind}: {error}"[:2000])) from None
    evidence = summarize(env, interface, states, failures, runs, ctx, agents)
    counts = evidence["counts"]
    logger.info(
        "evaluate: %s (%s) scored %.2f over %d judged calls, %d unusable replies, %d model requests",
        env.id, env.name, evidence["score"], counts["judged"], counts["invalid_replies"], evidence["usage"]["requests"],
    )  # fmt: skip
    incomplete = [run for run in runs if len(run.judged) < run.quota]
    if incomplete:
        raise _gave_up(env, ctx, incomplete, evidence)
    if evidence["score"] < ctx.config.evaluate.keep_score:
        raise Rejected(ctx.reject(env, "low_score", _low_score_detail(evidence), raw_output=_compact(evidence)))
    accepted = env.model_copy(
        update={
            "status": "accepted",
            "reason": None,
            "scores": {"dual_agent": evidence["score"], "tool_coverage": evidence["tool_coverage"]},
            "evaluation": evidence,
        }
    )
    return [accepted]


# ------------------------------------------------------------------------------------------- test states


async def make_test_states(
    env: Environment, interface: EnvInterface, default_state: dict[str, Any], ctx: StageContext, agents: Agents
) -> tuple[list[TestState], list[tuple[int, InvalidReply]]]:
    """Valid test states (in index order) and the slots that produced none, with their last error."""
    config = ctx.config.evaluate
    output_type = state_output_type(generated_state_schema(env.state_schema, default_state))
    header = class_header(env.code)

    async def loads(draft: Any) -> str | None:
        state = draft.state.model_dump()
        dangling = "; ".join(reference_problems(state))
        if dangling:
            return f"references that name no record (use an existing id, or an empty value for none): {dangling}"
        return await asyncio.to_thread(load_error, ctx.sandbox, env.code, interface, state, draft.now)

    async def one(index: int) -> TestState | InvalidReply:
        def ask(state_chars: int) -> Awaitable[Any]:
            messages = agents.state_messages(env, header, default_state, index, state_chars)
            return agents.ask_json(messages, output_type, "state", sample_index=index, accept=loads)

        try:
            draft = await shrinking(ask, ctx, "evaluate_state")
        except InvalidReply as invalid:
            return invalid
        return TestState(index, " ".join(draft.purpose.split()), draft.state.model_dump(), draft.now)

    results = await _all([one(i) for i in range(min(config.test_states, config.calls))])
    states = [r for r in results if isinstance(r, TestState)]
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, InvalidReply)]
    return states, failures


def load_error(
    sandbox: Any, code: str, interface: EnvInterface, state: dict[str, Any], now: str = DEFAULT_NOW
) -> str | None:
    """Why `state` cannot serve as an initial state (None: it loads and reads back as JSON)."""
    try:
        with Session(sandbox, code, state, interface=interface, now=now) as session:
            session.snapshot()
    except SessionError as error:
        return f"the environment does not load with this state: {error}"
    return None


# ---------------------------------------------------------------------------------------- dual-agent check


def schedule(tools: tuple[str, ...], position: int, negatable: Collection[str]) -> tuple[str, CaseType]:
    """The tool and case type of the `position`-th judged call: all tools positive, then all negative, ...

    A tool outside `negatable` (no argument it accepts can be wrong, e.g. only an optional flag) gets a positive
    case in the negative laps too: asking for a NEGATIVE case there only makes the tester invent one.
    """
    lap, index = divmod(position, len(tools))
    name = tools[index]
    return name, ("negative" if lap % 2 and name in negatable else "positive")


def negatable_tools(tools: Collection[dict[str, Any]]) -> frozenset[str]:
    """The tools that admit a schema-valid argument a correct implementation must refuse."""
    return frozenset(t["function"]["name"] for t in tools if admits_wrong_value(t["function"]["parameters"]))


async def shrinking(ask: Callable[[int], Awaitable[T]], ctx: StageContext, prompt_name: str) -> T:
    """`ask(state_chars)` with `evaluate.max_state_chars`; while the prompt alone is too long for the model's
    context, again with half the state (fewer whole records), each shrink counted in the stage report."""
    state_chars = ctx.config.evaluate.max_state_chars
    while True:
        try:
            return await ask(state_chars)
        except PromptTooLongError:
            if state_chars <= MIN_STATE_CHARS:
                raise
            state_chars = max(MIN_STATE_CHARS, state_chars // 2)
            shrunk = ctx.stats.report.setdefault("prompt_shrunk", {})
            shrunk[prompt_name] = shrunk.get(prompt_name, 0) + 1


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
                name, arguments, raw = await shrinking(propose, ctx, "evaluate_tester")
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
                run.judged.append({**call, **_ruled(result, [], "fail", f"state_not_json: {error}", "runtime")})
                await asyncio.to_thread(session.close)
                session = await asyncio.to_thread(_session, ctx.sandbox, env.code, state, interface)
                continue
            changes = diff_states(before, after)
            if not result.ok:  # raised, hung, crashed, non-JSON result: the environment broke its contract
                run.judged.append(
                    {**call, **_ruled(result, changes, "fail", f"{result.error_kind}: {result.error}", "runtime")}
                )
                continue
            check = partial(_check, agents, env, call, result, before, after, changes, now=state.now)
            try:
                verdict = await shrinking(check, ctx, "evaluate_checker")
            except InvalidReply as invalid:
                run.invalid.append({**where, "kind": invalid.kind, "detail": invalid.detail, "raw": invalid.raw})
                continue
            run.judged.append({**call, **_ruled(result, changes, verdict.verdict, verdict.reason, "checker")})
    finally:
        await asyncio.to_thread(session.close)


async def _propose(
    agents: Agents, env: Environment, interface: EnvInterface, slot: tuple[str, CaseType], state: TestState,
    run: StateRun, current: dict[str, Any], history_calls: int, state_chars: int,
) -> tuple[str, dict[str, Any], str]:  # fmt: skip
    facts = _tester_facts(state, run, current, history_calls, state_chars)
    return await agents.propose(env, interface.tools, slot, facts)


async def _check(
    agents: Agents, env: Environment, call: dict[str, Any], result: ToolResult, before: dict[str, Any],
    after: dict[str, Any], changes: list[dict[str, Any]], state_chars: int, *, now: str,
) -> CheckerVerdict:  # fmt: skip
    facts = _checker_facts(env, call, result, before, after, changes, state_chars, now)
    return await agents.ask_json(agents.checker_messages(facts), CheckerVerdict, "checker")


def _ruled(result: ToolResult, changes: list[dict[str, Any]], verdict: str, reason: str, judge: str) -> dict[str, Any]:
    return {
        "result": clip_json(result.result, EVIDENCE_CHARS) if result.ok else None,
        "error_kind": result.error_kind,
        "error": (result.error or "")[:EVIDENCE_CHARS] or None,
        "changes": clip_json(changes, EVIDENCE_CHARS) if changes else None,
        "verdict": verdict,
        "reason": " ".join(reason.split())[:EVIDENCE_CHARS],
        "judge": judge,
    }


def _session(sandbox: Any, code: str, state: TestState, interface: EnvInterface) -> Session:
    return Session(sandbox, code, state.state, interface, now=state.now)


def _tester_facts(state: TestState, run: StateRun, current: dict[str, Any], history_calls: int, limit: int) -> str:
    done = len(run.judged)
    recent = run.judged[-history_calls:] if history_calls else []
    lines = [f"- {c['tool']}({json.dumps(c['arguments'])}) -> {c['result'] or c['error']}" for c in recent]
    history = "\n".join(lines) or "- none yet"
    # After an unusable tester reply the request must differ (or a cached reply would repeat the mistake), and
    # the tester should learn what was wrong. A checker's failure is not the tester's business.
    last = run.invalid[-1] if run.invalid and run.invalid[-1]["round"] == done + len(run.invalid) - 1 else None
    last = last if last and last["kind"] != "checker_invalid" else None
    feedback = f"\n\nYour previous reply was unusable ({last['kind']}): {last['detail']}" if last else ""
    return (
        f"Test state {state.index + 1}, as first set up: {state.purpose}\n"
        f"Call {done + 1} of {run.quota} on this state; the current state below includes the calls made since.\n"
        f"Now: {now_text(state.now)}.\n\n"
        f"Current state (JSON):\n{state_text(current, limit)}\n\nRecent calls on this state:\n"
        f"{history}{feedback}"
    )


def _checker_facts(
    env: Environment, call: dict[str, Any], result: ToolResult, before: dict[str, Any], after: dict[str, Any],
    changes: list[dict[str, Any]], limit: int, now: str,
) -> str:  # fmt: skip
    name = call["tool"]
    used = attributes_used(env.code, name)
    return (
        f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
        f"State definition:\n```python\n{class_header(env.code)}\n```\n\n"
        f"Now: {now_text(now)}.\n"
        f"Tool under test: `{name}`, {CASE_TEXT[call['case']]}.\n"
        f"Method source:\n```python\n{method_source(env.code, name)}\n```\n\n"
        f"Arguments: {json.dumps(call['arguments'], ensure_ascii=False)}\n"
        f"Result: {clip_json(result.result, limit)}\n\n"
        f"State before (attributes the method uses):\n{state_text(state_view(before, used), limit)}\n\n"
        f"State after:\n{state_text(state_view(after, used), limit) if changes else '(identical to the state before)'}"
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


# ------------------------------------------------------------------------------------------------ verdict


def summarize(
    env: Environment, interface: EnvInterface, states: list[TestState], failures: list[tuple[int, InvalidReply]],
    runs: list[StateRun], ctx: StageContext, agents: Agents,
) -> dict[str, Any]:  # fmt: skip
    """The evidence behind the verdict: score, counts, per-tool coverage, every judged call, unusable replies."""
    calls = [call for run in runs for call in run.judged]
    verdicts = Counter(call["verdict"] for call in calls)
    per_tool: dict[str, Counter[str]] = {name: Counter() for name in interface.tool_names}
    for call in calls:
        per_tool[call["tool"]].update(["calls", call["case"], call["verdict"]])
    score = (verdicts["pass"] + verdicts["warning"]) / len(calls) if calls else 0.0
    config = ctx.config.evaluate
    return {
        "score": round(score, 4),
        "keep_score": config.keep_score,
        "calls_required": config.calls,
        "counts": {
            "judged": len(calls),
            "pass": verdicts["pass"],
            "warning": verdicts["warning"],
            "fail": verdicts["fail"],
            "failed_by_runtime": sum(c["judge"] == "runtime" for c in calls),
            "invalid_replies": sum(len(run.invalid) for run in runs),
        },  # fmt: skip
        "tool_coverage": round(sum(1 for c in per_tool.values() if c["calls"]) / len(per_tool), 4),
        "tools": {name: dict(counter) for name, counter in per_tool.items()},
        "test_states": [{"purpose": s.purpose, "now": s.now, "state": s.state} for s in states],
        "failed_test_states": [{"index": i, "kind": f.kind, "detail": f.detail} for i, f in failures],
        "calls": calls,
        "invalid_replies": [{k: v for k, v in item.items() if k != "raw"} for run in runs for item in run.invalid],
        "usage": agents.meter.as_json(),
        "provenance": {
            "model": getattr(ctx.llm, "model_id", None),
            "prompt_versions": [prompt_version(name) for name in PROMPTS],
            "sampling": {role: agents.sampling(role).model_dump() for role in ("state", "tester", "checker")},
            "tester_tool_choice": config.tester_tool_choice,
            "config_hash": ctx.config_hash,
            "builder_version": __version__,
        },
    }


def _gave_up(env: Environment, ctx: StageContext, incomplete: list[StateRun], evidence: dict[str, Any]) -> Rejected:
    """The check could not judge N calls: blame whichever agent wasted the most replies."""
    invalid = [item for run in incomplete for item in run.invalid]
    checker = sum(item["kind"] == "checker_invalid" for item in invalid)
    reason = "checker_invalid" if checker * 2 > len(invalid) else "tester_invalid"
    kinds = ", ".join(f"{kind}={n}" for kind, n in sorted(Counter(item["kind"] for item in invalid).items()))
    judged = evidence["counts"]["judged"]
    detail = f"gave up after {judged} of {evidence['calls_required']} judged calls; unusable replies: {kinds}"
    return Rejected(ctx.reject(env, reason, detail, raw_output=invalid[-1]["raw"]))


def _low_score_detail(evidence: dict[str, Any]) -> str:
    counts = evidence["counts"]
    first = next((c for c in evidence["calls"] if c["verdict"] == "fail"), None)
    worst = f"; first failure: {first['tool']} ({first['case']}): {first['reason']}" if first else ""
    return (
        f"score {evidence['score']:.2f} < {evidence['keep_score']} over {counts['judged']} judged calls "
        f"({counts['pass']} pass, {counts['warning']} warning, {counts['fail']} fail){worst}"
    )[:2000]


def _compact(evidence: dict[str, Any]) -> str:
    """The per-call verdicts of a rejected environment, kept as the rejection's raw output."""
    keep = ("tool", "case", "arguments", "verdict", "reason", "judge")
    calls = [{k: call[k] for k in keep} for call in evidence["calls"]]
    return json.dumps({"score": evidence["score"], "counts": evidence["counts"], "calls": calls}, ensure_ascii=False)
