"""The `llm` method of the scenarios stage: for one slot the model writes an initial state, a task of the slot's
family (`families`), the gold sequence and the checks, each verified in the sandbox (`verify`) and repaired with
the evidence fed back, in rounds (docs/scenarios.md §1-3)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from builder.envs.session import diff_states
from builder.prompts import prompt_version
from builder.records import Environment, EnvPlan, Scenario, Topic, scenario_seed
from builder.run.stage import Rejected, StageContext
from builder.stages.scenarios.emitted import Words, reject_slot, scenario_records
from builder.stages.scenarios.families import (
    NO_CHANGE,
    asked_for,
    family_note,
    family_prompts,
    family_texts,
    gold_note,
    refused_call,
    task_model,
    withheld,
)
from builder.stages.scenarios.family_gates import family_problem, one_shot_decline
from builder.stages.scenarios.graph_method import State
from builder.stages.scenarios.long_context import checked_enlarge, protected_values
from builder.stages.scenarios.requests import Draft, _fill, _gold, _initial_state, _repaired_check, _sampling, _task
from builder.stages.scenarios.sufficiency import looked_up_by, problem_value
from builder.stages.scenarios.variety import copies_seed
from builder.stages.scenarios.verify import Evidence, verify

PROMPTS = ("scenario_state", "scenario_writer", "scenario_task", "scenario_check", "scenario_gold")


async def build_slot(
    env: Environment, ctx: StageContext, slot: int, example: dict[str, Any], start: State | None,
    family: str = "plain", seeds: Sequence[str] = (),
) -> list[Scenario]:  # fmt: skip
    config = ctx.config.scenarios
    if start is None:
        small, now, state_repairs = await _initial_state(env, ctx, slot, example)
    else:
        (small, now), state_repairs = start, 0

    async def write_task(feedback: str = "") -> Draft:
        draft = await _task(env, ctx, small, now, feedback, output_type=task_model(family), note=family_note(family))
        draft.gold_note = gold_note(family, draft.task)
        await _fill(env, ctx, small, draft)
        return draft

    async def played_on(draft: Draft) -> dict[str, Any]:
        """The state the scenario is played on: a long_context task's is enlarged with whole copies of its world
        that hold none of the values the task and gold name, checked in the sandbox, with fewer copies if the
        environment's tools or the state's relations refuse them (`long_context.checked_enlarge`)."""
        if family != "long_context":
            return small
        task = draft.task
        protected = protected_values(small, [task.task, task.known_up_front, task.reveal_when_asked],
                                     [action.arguments for action in draft.gold])  # fmt: skip
        return await asyncio.to_thread(
            checked_enlarge, ctx.sandbox, env.code, small, records=config.long_context_records, protected=protected,
            seed=scenario_seed(env.id, now), now=now, contract=env.contract,
        )  # fmt: skip

    draft = await write_task()
    repairs: list[str] = []
    blame_gold_next = True  # for gold_fails_checks: alternate between the gold and the checks, gold first
    for round_ in range(config.repair_attempts + 1):
        state = await played_on(draft)
        evidence = _copied(draft, seeds) or await asyncio.to_thread(
            verify, ctx.sandbox, env.code, state, draft.gold, draft.checks,
            min_gold_calls=config.min_gold_calls if family not in NO_CHANGE else 1,  # look-ups that show why
            texts=family_texts(family, draft.task, config.modes), tools=env.tools, now=now,
            seed=scenario_seed(env.id, now), contract=env.contract, facts=draft.task.answer_facts,
            refused=refused_call(draft.task), expect_change=family not in NO_CHANGE,
            withheld=withheld(draft.task),
        )  # fmt: skip
        evidence = (family_problem(draft.task, evidence) if evidence.reason is None else None) or evidence
        if evidence.reason is None:
            return _scenarios(env, ctx, state, draft, evidence, state_repairs, repairs, family)
        if round_ == config.repair_attempts:
            gold = [action.model_dump() for action in draft.gold]
            raw = json.dumps({"task": draft.task.task, "checks": draft.checks, "gold": gold}, ensure_ascii=False)
            raise Rejected(reject_slot(ctx, env, slot, evidence.reason, evidence.detail, raw[:20000]))
        repairs.append(evidence.reason)
        # Repair round r is attempt r + 1 of the piece it repairs (its first writing is attempt 0): fresh samples.
        retask = evidence.reason == "answer_not_read" and not blame_gold_next  # the gold had its turn: the facts
        skipped = evidence.reason == "task_underspecified" and blame_gold_next and _skipped_lookups(
            evidence, state, family_texts(family, draft.task, config.modes), env.tools
        )  # fmt: skip
        if skipped:  # the user names what the gold used without looking it up: its writer looks it up first
            draft.gold, draft.gold_messages = await _gold(env, ctx, small, draft, skipped, attempt=round_ + 1)
            blame_gold_next = False  # if the values are still missing, the task gives them
        elif evidence.reason in TASK_REPAIRS or retask:
            draft = await write_task(_task_feedback(draft, evidence))
            blame_gold_next = True
        elif evidence.reason == "check_broken" or (evidence.reason == "gold_fails_checks" and not blame_gold_next):
            await _repair_checks(env, ctx, state, draft, evidence, attempt=round_ + 1)
            blame_gold_next = True
        else:
            draft.gold, draft.gold_messages = await _gold(
                env, ctx, small, draft, _gold_feedback(draft, evidence), attempt=round_ + 1
            )
            blame_gold_next = evidence.reason not in ("gold_fails_checks", "answer_not_read")
    raise AssertionError("unreachable: the last round returns or rejects")


def _copied(draft: Draft, seeds: Sequence[str]) -> Evidence | None:
    """A task that repeats the seed request it was inspired by (`variety.copies_seed`) is written again."""
    if not copies_seed(draft.task.task, seeds):
        return None
    return Evidence(reason="copies_seed", detail="the task repeats the seed request it was inspired by")


def seed_requests(ctx: StageContext, env: Environment) -> tuple[str, ...]:
    """The seed requests the environment's topic was inferred from (none when this run did not mine it)."""
    if EnvPlan not in ctx.needs:
        return ()
    plan = ctx.earlier_record(EnvPlan, env.plan_id)
    topic = ctx.earlier_record(Topic, plan.topic_id) if plan is not None else None
    return topic.example_requests if topic is not None else ()


# Failures whose repair is a new task (and fresh gold and checks): the task itself is wrong.
TASK_REPAIRS = frozenset({
    "already_solved", "task_underspecified", "not_refused", "nothing_withheld", "doable_without_withheld",
    "copies_seed",
})  # fmt: skip


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
    if evidence.reason == "copies_seed":
        return f"{draft.task.task}\nWhy: {evidence.detail}\nWrite a task of your own for this state, in your own words."
    if evidence.reason in ("not_refused", "nothing_withheld", "doable_without_withheld"):
        return f"{draft.task.task}\nWhy: {evidence.detail}\nWrite a task of the same kind that holds in this state."
    if evidence.reason == "answer_not_read":
        facts = json.dumps(draft.task.answer_facts, ensure_ascii=False)
        return (
            f"{draft.task.task}\nanswer_facts: {facts}\nWhy: {evidence.detail}\nWrite the task again: answer_facts "
            "must be values the tools return while solving it, exactly as returned, and not values the user says."
        )
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


def _skipped_lookups(
    evidence: Evidence, state: dict[str, Any], texts: dict[str, str], tools: Sequence[dict[str, Any]]
) -> str:  # fmt: skip
    """The gold writer's feedback when every value the user's words lack is one the user names a record of
    (`sufficiency.looked_up_by`): the gold used it without looking it up, so the task is not at fault; "" else."""
    lines = []
    for mode, problems in evidence.underspecified.items():
        for problem in problems:
            detail = looked_up_by(problem_value(problem), state, texts.get(mode, ""), tools)
            if detail is None:
                return ""
            lines.append(f"- {problem}: the user gives it only as {detail!r}")
    return "\n".join([
        "This sequence was refused (task_underspecified): it uses values that the user never states and that no "
        "earlier call of it returned, though the user names the records they belong to:",
        *dict.fromkeys(lines),
        "Look each one up first with a tool, by what the user says, and use the value its result gives.",
    ])  # fmt: skip


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
    family: str = "plain",
) -> list[Scenario]:
    versions = "+".join(prompt_version(name) for name in (*PROMPTS, *family_prompts(family)))
    provenance = ctx.provenance([env], model=ctx.llm.model_id, sampling=_sampling(ctx), prompt_version=versions)
    task = draft.task
    words = Words(
        task=task.task, user_profile=task.user_profile, known_up_front=task.known_up_front,
        reveal_when_asked=task.reveal_when_asked, ending=task.ending, difficulty=task.difficulty,
    )  # fmt: skip
    return scenario_records(
        env, ctx, method="llm", provenance=provenance, state=state, now=draft.now, words=words,
        checklist=task.checklist, checks=draft.checks, gold=evidence.actions, evidence=evidence,
        state_repairs=state_repairs, repairs=repairs, answer_facts=task.answer_facts, family=family,
        declined=one_shot_decline(task, evidence, asked_for(getattr(task, "withheld_as", ""))),
    )  # fmt: skip
