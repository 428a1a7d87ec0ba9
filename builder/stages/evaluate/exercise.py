"""The dual-agent check: per test state, the tester agent proposes a batch of tool calls (slots of a schedule of
positive and negative cases over every tool), each runs in turn in the state's sandbox session, and the checker agent
judges the batch's outcomes in one request against each method's source and state diff. The states run their
batches in rounds; after each round the sequential rule (`sequential.py`) may settle the verdict early."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Coroutine
from functools import partial
from typing import Any, TypeVar

from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError, ToolResult, diff_states
from builder.evidence import JudgedCall
from builder.records import Environment
from builder.run.stage import StageContext
from builder.stages._llm import shrinking
from builder.stages.evaluate.agents import (
    Agents,
    CaseType,
    CheckerVerdicts,
    InvalidReply,
    ProposedCall,
    TesterCalls,
    shares_start,
    tester_schema,
)
from builder.stages.evaluate.cases import admits_wrong_value
from builder.stages.evaluate.facts import (  # _checker_facts: probes.py asks about single calls
    Ran,
    StateRun,
    TestState,
    _batch_facts,
    _checker_facts,  # noqa: F401
    _tester_facts,
    shows_whole_source,
)
from builder.stages.evaluate.sequential import negatives_in, settled
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.state import clip_json

T = TypeVar("T")


# Session error kinds that mean the tester's call never reached the environment: the tester's fault.
TESTER_ERRORS = {"unknown_tool", "bad_arguments"}


EVIDENCE_CHARS = 600  # per result and per diff in the stored evidence, so 100 calls stay a small JSON


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
    """Split `evaluate.calls` over the states and exercise them in rounds, one batch per state and round, the
    states concurrently; stop when every state has its quota, one gave up (the verdict is then a rejection
    whatever the rest would do) or the sequential rule settles the verdict (`StateRun.settled`)."""
    config = ctx.config.evaluate
    total = config.calls
    quotas = [total // len(states) + (i < total % len(states)) for i in range(len(states))]
    starts = [sum(quotas[:i]) for i in range(len(states))]
    negatable = negatable_tools(interface.tools)
    cases = [schedule(interface.tool_names, position, negatable)[1] for position in range(total)]
    min_negatives = negatives_in(cases, config.min_calls, total)
    workers = [
        StateWorker(env, interface, state, StateRun(quota), start, negatable, ctx, agents)
        for state, quota, start in zip(states, quotas, starts, strict=True)
    ]
    try:
        await _all([worker.open() for worker in workers])
        while active := [worker for worker in workers if worker.active()]:
            await _all([worker.batch() for worker in active])
            runs = [worker.run for worker in workers]
            if any(run.gave_up(config.max_invalid_replies) for run in runs):
                break
            judged = [call for run in runs for call in run.judged]
            decision = settled(
                sum(call.verdict != "fail" for call in judged), len(judged),
                sum(call.case == "negative" for call in judged), total=total, keep_score=config.keep_score,
                min_calls=config.min_calls, min_negatives=min_negatives, confidence=config.stop_confidence,
            )  # fmt: skip
            if decision is not None:
                for run in runs:
                    run.settled = decision
                break
    finally:
        await _all([worker.close() for worker in workers])
    return [worker.run for worker in workers]


async def _all(jobs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run `jobs` concurrently; the first error cancels the rest (no orphan requests) and is raised as is."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except ExceptionGroup as errors:
        raise errors.exceptions[0] from None  # callers handle plain errors (LLMRequestError, SessionError)
    return [task.result() for task in tasks]


class StateWorker:
    """One test state's session and its share of the schedule, exercised one batch at a time.

    A slot whose call never ran in the environment (a missing or unusable tester item) is asked again in the
    next batch, as a single call was asked again before batches; every unusable item is counted (`run.invalid`),
    so a tester that keeps failing ends at `max_invalid_replies`.
    """

    def __init__(
        self, env: Environment, interface: EnvInterface, state: TestState, run: StateRun, start: int,
        negatable: frozenset[str], ctx: StageContext, agents: Agents,
    ) -> None:  # fmt: skip
        self.env, self.interface, self.state, self.run = env, interface, state, run
        self.negatable, self.ctx, self.agents = negatable, ctx, agents
        self.config = ctx.config.evaluate
        self.budgets = prompt_budgets(ctx.config.llm.max_state_chars)
        self.pending: list[int] = []  # schedule positions asked for whose call has not run yet
        self.next_position = start
        self.rounds = 0  # each call and each unusable reply is a round (JudgedCall.round)
        self.feedback = ""  # the tester's unusable items of the last batch, told in the next request
        self.session: Session | None = None
        self.first: dict[str, Any] | None = None  # the session's state before its first call, as the tester sees it

    async def open(self) -> None:
        self.session = await asyncio.to_thread(_session, self.ctx.sandbox, self.env.code, self.state, self.interface)

    async def close(self) -> None:
        if self.session is not None:
            await asyncio.to_thread(self.session.close)

    async def restart(self) -> None:
        await self.close()
        await self.open()

    def active(self) -> bool:
        return len(self.run.judged) < self.run.quota and not self.run.gave_up(self.config.max_invalid_replies)

    async def snapshot(self) -> dict[str, Any]:
        try:
            return await asyncio.to_thread(self.session.snapshot)
        except SessionError:  # the worker died and replaying the calls failed: start over from the state
            await self.restart()
            return await asyncio.to_thread(self.session.snapshot)

    def where(self) -> dict[str, int]:
        """The next round's place (and the round counted)."""
        self.rounds += 1
        return {"state": self.state.index, "round": self.rounds - 1}

    async def batch(self) -> None:
        """Ask the tester for the next slots, run its calls in order, ask the checker about those that returned."""
        run = self.run
        size = min(self.config.calls_per_request, run.quota - len(run.judged))
        while len(self.pending) < size:
            self.pending.append(self.next_position)
            self.next_position += 1
        positions = self.pending[:size]
        slots = [schedule(self.interface.tool_names, position, self.negatable) for position in positions]
        current = await self.snapshot()
        self.first = current if self.first is None else self.first
        propose = partial(_propose, self.agents, self.env, self.interface, slots, self.state, run, self.first,
                          current, self.config.history_calls, self.feedback)  # fmt: skip
        counted = len(run.invalid)
        try:
            proposed = await shrinking(self.ctx, "evaluate_tester", self.budgets, propose)
        except InvalidReply as invalid:
            run.invalid.append({**self.where(), "kind": invalid.kind, "detail": invalid.detail, "raw": invalid.raw})
            self.feedback = f"({invalid.kind}) {invalid.detail}"
            return
        await self.run_batch(proposed, positions, slots, current)
        tester_errors = [item for item in run.invalid[counted:] if item["kind"] != "checker_invalid"]
        self.feedback = "; ".join(f"({item['kind']}) {item['detail']}" for item in tester_errors)

    async def run_batch(
        self, proposed: TesterCalls, positions: list[int], slots: list[tuple[str, CaseType]], current: dict[str, Any]
    ) -> None:
        """Run the tester's calls in slot order, then ask the checker about those that returned."""
        run, size = self.run, len(slots)
        raw = proposed.model_dump_json()
        outcomes: list[JudgedCall | Ran] = []  # in the order the calls ran; `Ran` awaits the checker
        before = current
        for item in _in_order(proposed.calls, size, run, self.where, raw):
            position, slot = positions[item.call - 1], slots[item.call - 1]
            where = self.where()
            named = self.config.tester_tool_choice == "named"
            if named and item.tool != slot[0] and item.tool in self.interface.tool_names:  # unknown: the session's
                detail = f"slot {item.call} asks for `{slot[0]}`, the reply called `{item.tool}`"
                run.invalid.append({**where, "kind": "wrong_tool", "detail": detail, "raw": raw})
                continue
            result = await asyncio.to_thread(self.session.call, item.tool, item.arguments)
            if result.error_kind in TESTER_ERRORS:
                run.invalid.append({**where, "kind": result.error_kind, "detail": result.error, "raw": raw})
                continue
            self.pending.remove(position)
            case = slot[1] if item.tool == slot[0] else "unscheduled"
            call = {**where, "tool": item.tool, "case": case, "arguments": item.arguments}
            try:
                after = await asyncio.to_thread(self.session.snapshot)
            except SessionError as error:
                outcomes.append(_ruled(call, result, [], "fail", f"state_not_json: {error}", "runtime"))
                await self.restart()
                before = await self.snapshot()
                continue
            changes = diff_states(before, after)
            if not result.ok:  # raised, hung, crashed, non-JSON result: the environment broke its contract
                outcomes.append(
                    _ruled(call, result, changes, "fail", f"{result.error_kind}: {result.error}", "runtime")
                )
            else:
                number = sum(isinstance(outcome, Ran) for outcome in outcomes) + 1
                outcomes.append(Ran(number, call, result, before, after, changes))
            before = after
        ran = [outcome for outcome in outcomes if isinstance(outcome, Ran)]
        verdicts, failure = {}, None
        if ran:
            try:
                whole = shows_whole_source(self.config.calls, len(self.interface.tools))
                verdicts = await shrinking(self.ctx, "evaluate_checker", self.budgets, partial(_check, self.agents,
                                           self.env, ran, self.first, now=self.state.now, whole=whole))  # fmt: skip
            except InvalidReply as invalid:
                failure = invalid
        unjudged: list[Ran] = []
        for outcome in outcomes:
            if isinstance(outcome, JudgedCall):
                run.judged.append(outcome)
            elif (verdict := verdicts.get(outcome.number)) is not None:
                ruled = _ruled(
                    outcome.call, outcome.result, outcome.changes, verdict.verdict, verdict.reason, "checker"
                )
                run.judged.append(ruled)
            else:  # no usable checker reply, or none for this call: not judged
                unjudged.append(outcome)
        if unjudged:  # one unusable reply, however many calls it leaves unjudged (the bound counts replies)
            numbers = ", ".join(str(outcome.number) for outcome in unjudged)
            kind, detail, raw_reply = (
                (failure.kind, failure.detail, failure.raw) if failure else
                ("checker_invalid", f"no verdict for call(s) {numbers} of the batch", "")
            )  # fmt: skip
            where = {"state": unjudged[0].call["state"], "round": unjudged[0].call["round"]}
            run.invalid.append({**where, "kind": kind, "detail": detail, "raw": raw_reply})


def _in_order(
    calls: list[ProposedCall], size: int, run: StateRun, where: Any, raw: str
) -> list[ProposedCall]:  # fmt: skip
    """The tester's items for slots 1..size, each slot once, in slot order; every other item is counted as an
    unusable reply (`unknown_call`: a number no slot has, or a slot filled twice)."""
    usable: dict[int, ProposedCall] = {}
    for item in calls:
        if 1 <= item.call <= size and item.call not in usable:
            usable[item.call] = item
            continue
        detail = f"call {item.call} is not a slot of this batch (1 to {size}, each once)"
        run.invalid.append({**where(), "kind": "unknown_call", "detail": detail, "raw": raw})
    return [usable[number] for number in sorted(usable)]


async def _propose(
    agents: Agents, env: Environment, interface: EnvInterface, slots: list[tuple[str, CaseType]], state: TestState,
    run: StateRun, first: dict[str, Any], current: dict[str, Any], history_calls: int, feedback: str,
    budget: PromptBudget,
) -> TesterCalls:  # fmt: skip
    facts = _tester_facts(state, run, first, current, history_calls, budget, slots, feedback)
    messages = agents.tester_messages(env, interface.tools, facts)

    async def fills_a_slot(reply: TesterCalls) -> str | None:
        if any(1 <= item.call <= len(slots) for item in reply.calls):
            return None
        return f"no call fills one of the slots 1 to {len(slots)}"

    schema = tester_schema(interface.tools, slots, named=agents.config.tester_tool_choice == "named")
    return await agents.ask_json(messages, TesterCalls, "tester", calls=len(slots), accept=fills_a_slot, schema=schema)


async def _check(
    agents: Agents, env: Environment, ran: list[Ran], first: dict[str, Any], budget: PromptBudget, *, now: str,
    whole: bool,
) -> dict:  # fmt: skip
    """The checker's verdicts by call number (the first for each number of the batch; others are ignored);
    `first`: the state as first set up in the session, which the checker sees before the batch's calls."""
    facts = _batch_facts(env, ran, first, budget, now, whole)
    numbers = {item.number for item in ran}

    async def judges_a_call(reply: CheckerVerdicts) -> str | None:
        if any(verdict.call in numbers for verdict in reply.verdicts):
            return None
        return f"no verdict names one of the calls 1 to {len(ran)}"

    messages = agents.checker_messages(facts, shared=shares_start(budget, whole))
    reply = await agents.ask_json(messages, CheckerVerdicts, "checker", calls=len(ran), accept=judges_a_call)
    found: dict[int, Any] = {}
    for verdict in reply.verdicts:
        if verdict.call in numbers:
            found.setdefault(verdict.call, verdict)
    return found


def _reason(text: str) -> str:
    return " ".join(text.split())[:EVIDENCE_CHARS]


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
        reason=_reason(reason),
        judge=judge,
    )


def _session(sandbox: Any, code: str, state: TestState, interface: EnvInterface) -> Session:
    return Session(sandbox, code, state.state, interface, now=state.now)
