"""scenarios: per accepted environment, verified scenarios (initial state, task, checklist, checks, gold actions).

For each of `scenarios.per_environment` slots the model writes, in turn, an initial state (structured output
constrained by the environment's state schema), a task with a user script and a checklist, one check function per
checklist item, and a gold action sequence. Nothing is trusted until the sandbox has shown it:

1. the state loads, reads back as JSON and every tool answers on it without crashing; every collection of
   records holds `min_records` records, `<entity>_id` fields point at existing records, and every attribute is
   one the class has;
2. every check lints clean and returns a real bool on the initial and the final state;
3. the gold sequence runs without a failing or refused call; every literal argument of it comes from what the
   user says in each mode (the task, or the user script), from an earlier call's result or from the tool schema
   (`sufficiency`); it has `min_gold_calls` calls, changes the state and gives the same final state
   when replayed. A gold argument may be a reference to an earlier call's result (`references`: the id of a
   record an earlier call creates); it is resolved as the gold runs, and the scenario stores the resolved calls;
4. not every check already passes on the initial state; every check passes after the gold sequence;
5. negative control: dropping any one state-changing gold call makes at least one check fail. Checks that never
   failed on any state tried are kept but reported as vacuous.

A failing piece is regenerated with the evidence fed back (`scenarios.repair_attempts` times for the state, and
as many rounds for task, checks and gold; a repair is the piece's request, the current piece and the feedback);
then the slot becomes a rejection with the reason code of the last failure. A verified scenario is emitted once per
mode in `scenarios.modes` (the runner upserts them into the store).

Each request is shown what it needs, not the whole module (`views`): the interface (class header and
tool schemas) and the state for the state, task and gold; the state schema, the records the gold names and the
source of the gold's state-changing methods for a check, which is written after the gold.

That is the `llm` method. `scenarios.method` picks it, the `graph` method (`graph_method`: a chain sampled along
the tool graph is the gold, the checks are derived from its diff, the model words only the user's request, under
the same gates) or both, the slots alternating llm, graph, llm, ... Each scenario records its method; the
stage's stats report both side by side (`method_stats`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from builder.envs.audit import FAILURES, Audit, audit_reward
from builder.envs.lint import ContractError
from builder.envs.session import SessionError, diff_states
from builder.errors import ItemError, OperatorError
from builder.limits import DETAIL_CHARS
from builder.prompts import prompt_version
from builder.records import Environment, Record, Rejection, Scenario, scenario_seed
from builder.run.stage import Rejected, StageContext
from builder.stages.scenarios.emitted import Words, scenario_records
from builder.stages.scenarios.graph_method import State, graph_chains, graph_scenario, start_states
from builder.stages.scenarios.method_stats import report_methods
from builder.stages.scenarios.requests import (
    Draft,
    _fill,
    _gold,
    _initial_state,
    _repaired_check,
    _sampling,
    _task,
    _user_texts,
)
from builder.stages.scenarios.verbalise import Spent
from builder.stages.scenarios.verify import Evidence, default_state, verify
from builder.usage import Usage

logger = logging.getLogger(__name__)

PROMPTS = ("scenario_state", "scenario_task", "scenario_check", "scenario_gold")
# Every reason code this stage gives (stable: aggregated in stats and the dataset card; see docs/scenarios.md).
REASONS = (
    "not_accepted", "env_load_failed", "state_invalid", "state_load_failed", "state_too_small", "state_inconsistent",
    "task_invalid", "check_invalid", "gold_invalid", "check_broken", "gold_call_failed", "task_underspecified",
    "too_few_calls", "no_state_change", "gold_nondeterministic", "already_solved", "gold_fails_checks",
    "negative_control_failed", "duplicate", "llm_request", "prompt_too_long", "no_chain", "request_invalid",
    "request_leaks", *FAILURES.values(),
)  # fmt: skip
Made = list[Scenario] | Rejection  # what one slot makes
OnSlot = Callable[[int, str, Made], None]


async def scenarios(
    env: Environment, ctx: StageContext, *, start: State | None = None, on_slot: OnSlot | None = None
) -> list[Record]:
    """Verified scenarios of one environment (each in every configured mode) and one rejection per failed slot.

    `start` is a (state, now) every slot starts from (the state of `python -m builder scenarios`; it must load):
    the llm method then writes no state and the graph method samples from it alone. `on_slot(slot, method, made)` is
    told of each slot as it ends (progress).

    Rejects the whole environment with `not_accepted` (its status is not "accepted") or `env_load_failed` (its
    default state does not load). Slot rejections have subject `<env id>/scenario-<slot>` and these reasons:
    state_invalid, state_load_failed, state_too_small, state_inconsistent, task_invalid, check_invalid,
    gold_invalid, check_broken, gold_call_failed, task_underspecified, too_few_calls, no_state_change,
    gold_nondeterministic, already_solved, gold_fails_checks, negative_control_failed, duplicate, llm_request,
    prompt_too_long; for the graph method also no_chain (fewer verified chains than slots), request_invalid
    and request_leaks (`verbalise`); the reward audit's (`builder.envs.audit`, run on every verified slot with
    the collateral guard appended to its checks): reward_for_nothing, gold_not_rewarded, collateral_rewarded,
    order_sensitive, spelling_sensitive; and `exception:<Type>` for a slot that hit an unexpected error, logged
    with its traceback.

    Counts in `ctx.stats.report` (`builder.reports.ScenariosReport`) `verified_slots` (a slot is emitted once per
    mode, so `per_kept` is per record)
    and the figures per method; `method_stats.derive_report` (the stage's `derive`) adds the costs per verified
    slot from them.
    """
    if env.status != "accepted":
        raise Rejected(ctx.reject(env, "not_accepted", f"status is {env.status!r}; only accepted environments"))
    try:
        example = await asyncio.to_thread(default_state, ctx.sandbox, env.code, env.contract)
    except (SessionError, ContractError) as error:
        raise Rejected(ctx.reject(env, "env_load_failed", str(error)[:DETAIL_CHARS])) from None
    methods = slot_methods(ctx.config.scenarios.method, ctx.config.scenarios.per_environment)
    llm_slots = [slot for slot, method in enumerate(methods) if method == "llm"]
    graph_slots = [slot for slot, method in enumerate(methods) if method == "graph"]
    spent = {slot: Spent() for slot in graph_slots}

    async def llm(slot: int) -> Made:
        return await _slot(env, ctx, slot, "llm", lambda: _build(env, ctx, slot, example, start), on_slot)

    fell_back: list[int] = []  # graph slots with no chain that the llm method made instead (method both)

    async def graph() -> tuple[list[Made], Counter[str]]:
        if not graph_slots:
            return [], Counter()
        states = [start] if start is not None else start_states(env, example)
        found, dropped = await graph_chains(env, ctx, len(graph_slots), states)

        async def one(index: int, slot: int) -> Made:
            if index < len(found):
                chain = found[index]
                return await _slot(env, ctx, slot, "graph", lambda: graph_scenario(env, ctx, chain, spent[slot]),
                                   on_slot)  # fmt: skip
            if ctx.config.scenarios.method == "both":
                fell_back.append(slot)  # no chain: the llm method makes this slot
                return await llm(slot)
            detail = (
                f"{len(found)} verified chains for {len(graph_slots)} slots from {len(states)} start states "
                f"(dropped: {json.dumps(dict(sorted(dropped.items())))})"
            )
            rejection = _reject_slot(ctx, env, slot, "no_chain", detail)
            if on_slot is not None:
                on_slot(slot, "graph", rejection)
            return rejection

        return list(await asyncio.gather(*(one(i, slot) for i, slot in enumerate(graph_slots)))), dropped

    llm_made, (graph_made, dropped) = await asyncio.gather(asyncio.gather(*map(llm, llm_slots)), graph())
    made = dict(zip(llm_slots, llm_made, strict=True)) | dict(zip(graph_slots, graph_made, strict=True))
    results: list[Record] = []
    outcomes: list[tuple[str, Made]] = []
    seen: set[str] = set()
    for slot in range(len(methods)):
        result = made[slot]
        if not isinstance(result, Rejection) and result[0].id in seen:
            result = _reject_slot(ctx, env, slot, "duplicate", "the same state and task as an earlier slot")
        elif not isinstance(result, Rejection):
            seen.add(result[0].id)
        outcomes.append((methods[slot], result))
        results += [result] if isinstance(result, Rejection) else result
    kept = [record for record in results if isinstance(record, Scenario)]
    _count_verified(ctx, len(kept) // max(1, len(ctx.config.scenarios.modes)))
    graph_usage = sum((s.usage for s in spent.values()), Usage())
    report_methods(ctx, env, outcomes, graph_usage, dropped, fell_back=[made[slot] for slot in fell_back])
    return results


def slot_methods(method: str, count: int) -> list[str]:
    """The method of each of `count` slots: all one method, or for `both` alternating llm, graph, llm, ..."""
    if method == "both":
        return ["llm" if slot % 2 == 0 else "graph" for slot in range(count)]
    return [method] * count


def _count_verified(ctx: StageContext, verified: int) -> None:
    ctx.stats.report.verified_slots += verified


async def _slot(
    env: Environment, ctx: StageContext, slot: int, method: str, build: Callable[[], Awaitable[list[Scenario]]],
    on_slot: OnSlot | None,
) -> Made:  # fmt: skip
    made = await _made(env, ctx, slot, build)
    if on_slot is not None:
        on_slot(slot, method, made)
    return made


async def _made(env: Environment, ctx: StageContext, slot: int, build: Callable[[], Awaitable[list[Scenario]]]) -> Made:
    try:
        made = await build()
        audit = await asyncio.to_thread(_audit, ctx, env, made[0])
        if audit.reason is not None:
            raw = json.dumps({"outcomes": audit.outcomes, "rewards": audit.rewards})
            return _reject_slot(ctx, env, slot, audit.reason, audit.detail, raw)
        return made
    except Rejected as verdict:
        rejection = verdict.rejection
        if rejection.subject_id == env.id:  # from `ask`: give it this slot's subject, so slots do not collide
            return _reject_slot(ctx, env, slot, rejection.reason, rejection.detail, rejection.raw_output)
        return rejection
    except (asyncio.CancelledError, OperatorError):
        raise  # an interrupt or an operator error (an unreachable server) stops the run; it is not this slot's
    except ItemError as error:  # a failed request or session: this slot's, the other slots go on
        return _reject_slot(ctx, env, slot, error.reason, str(error)[:DETAIL_CHARS])
    except Exception as error:  # noqa: BLE001 - like the runner: one bad slot must not cost the others
        logger.error("scenarios: %s slot %d failed:\n%s", env.id, slot, traceback.format_exc())
        return _reject_slot(ctx, env, slot, f"exception:{type(error).__name__}", str(error))


def _audit(ctx: StageContext, env: Environment, scenario: Scenario) -> Audit:
    """The reward audit of a slot's scenario (its modes share state, checks and gold), counted in the report."""
    audit = audit_reward(
        ctx.sandbox, env.code, scenario.initial_state, scenario.checks, scenario.gold_actions, env.tools,
        now=scenario.now, seed=scenario.seed, contract=env.contract,
    )  # fmt: skip
    ctx.stats.report.count_audit(audit.outcomes)
    return audit


def _reject_slot(
    ctx: StageContext, env: Environment, slot: int, reason: str, detail: str, raw_output: str | None = None
) -> Rejection:
    return Rejection(
        provenance=ctx.provenance([env]),
        stage=ctx.stage,
        subject_id=f"{env.id}/scenario-{slot}",
        reason=reason,
        detail=detail[:DETAIL_CHARS],
        raw_output=raw_output,
    )


# ------------------------------------------------------------------------------------------------- pieces


# ------------------------------------------------------------------------------------------- verification


async def _build(
    env: Environment, ctx: StageContext, slot: int, example: dict[str, Any], start: State | None
) -> list[Scenario]:
    config = ctx.config.scenarios
    if start is None:
        state, now, state_repairs = await _initial_state(env, ctx, slot, example)
    else:
        (state, now), state_repairs = start, 0
    draft = await _task(env, ctx, state, now)
    await _fill(env, ctx, state, draft)
    repairs: list[str] = []
    blame_gold_next = True  # for gold_fails_checks: alternate between the gold and the checks, gold first
    for round_ in range(config.repair_attempts + 1):
        evidence = await asyncio.to_thread(
            verify, ctx.sandbox, env.code, state, draft.gold, draft.checks, min_gold_calls=config.min_gold_calls,
            texts=_user_texts(draft.task, config.modes), tools=env.tools, now=now, seed=scenario_seed(env.id, now),
            contract=env.contract,
        )  # fmt: skip
        if evidence.reason is None:
            return _scenarios(env, ctx, state, draft, evidence, state_repairs, repairs)
        if round_ == config.repair_attempts:
            gold = [action.model_dump() for action in draft.gold]
            raw = json.dumps({"task": draft.task.task, "checks": draft.checks, "gold": gold}, ensure_ascii=False)
            raise Rejected(_reject_slot(ctx, env, slot, evidence.reason, evidence.detail, raw[:20000]))
        repairs.append(evidence.reason)
        # Repair round r is attempt r + 1 of the piece it repairs (its first writing is attempt 0): fresh samples.
        if evidence.reason in ("already_solved", "task_underspecified"):
            draft = await _task(env, ctx, state, now, feedback=_task_feedback(draft, evidence))
            await _fill(env, ctx, state, draft)
            blame_gold_next = True
        elif evidence.reason == "check_broken" or (evidence.reason == "gold_fails_checks" and not blame_gold_next):
            await _repair_checks(env, ctx, state, draft, evidence, attempt=round_ + 1)
            blame_gold_next = True
        else:
            draft.gold, draft.gold_messages = await _gold(
                env, ctx, state, draft, _gold_feedback(draft, evidence), attempt=round_ + 1
            )
            blame_gold_next = evidence.reason != "gold_fails_checks"
    raise AssertionError("unreachable: the last round returns or rejects")


async def _repair_checks(
    env: Environment, ctx: StageContext, state: dict[str, Any], draft: Draft, evidence: Evidence, attempt: int
) -> None:
    changes = diff_states(state, evidence.final_state) if evidence.final_state is not None else []
    after_gold = f" The gold sequence changed: {json.dumps(changes)[:1500]}" if changes else ""
    problems = {i: evidence.check_problems[i] + after_gold for i in sorted(evidence.check_problems)}
    repaired = await asyncio.gather(
        *(_repaired_check(env, ctx, draft, i, problem, attempt) for i, problem in problems.items())
    )
    for i, code in zip(problems, repaired, strict=True):
        draft.checks[i] = code


def _task_feedback(draft: Draft, evidence: Evidence) -> str:
    if evidence.reason == "already_solved":
        return f"{draft.task.task}\nWhy: {evidence.detail}\nWrite a different task."
    where = {
        "non_conversational": "the task",
        "conversational": "the user's script (known_up_front and reveal_when_asked)",
    }
    lines = [draft.task.task, "Why: solving it needs values the user never gives, and the assistant must not guess:"]
    for mode, problems in evidence.underspecified.items():
        lines += [f"- not in {where.get(mode, mode)}: {problem}" for problem in problems]
    lines.append(
        "Write the task again so that the user states these values (or details the assistant can look them up "
        "by with the tools), in the task and in known_up_front or reveal_when_asked."
    )
    return "\n".join(lines)


def _gold_feedback(draft: Draft, evidence: Evidence) -> str:
    lines = [f"This sequence was refused ({evidence.reason})."]
    lines += [f"- {problem}" for problem in evidence.gold_problems]
    for index, problem in sorted(evidence.check_problems.items()):
        lines.append(f"- checklist item {draft.task.checklist[index]!r} {problem}")
    if evidence.final_state is not None and evidence.reason == "gold_fails_checks":
        answered = [call.model_dump(mode="json") for call in evidence.gold]
        lines.append(f"Its calls answered: {json.dumps(answered, ensure_ascii=False)[:1500]}")
    return "\n".join(lines)


def _scenarios(
    env: Environment,
    ctx: StageContext,
    state: dict[str, Any],
    draft: Draft,
    evidence: Evidence,
    state_repairs: int,
    repairs: Sequence[str],
) -> list[Scenario]:
    versions = "+".join(prompt_version(name) for name in PROMPTS)
    provenance = ctx.provenance([env], model=ctx.llm.model_id, sampling=_sampling(ctx), prompt_version=versions)
    task = draft.task
    words = Words(
        task=task.task, user_profile=task.user_profile, known_up_front=task.known_up_front,
        reveal_when_asked=task.reveal_when_asked, ending=task.ending, difficulty=task.difficulty,
    )  # fmt: skip
    return scenario_records(
        env, ctx, method="llm", provenance=provenance, state=state, now=draft.now, words=words,
        checklist=task.checklist, checks=draft.checks, gold=evidence.actions, evidence=evidence,
        state_repairs=state_repairs, repairs=repairs,
    )  # fmt: skip
