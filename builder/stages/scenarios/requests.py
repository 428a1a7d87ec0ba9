"""The scenario stage's model requests: the initial state, the task draft, one check function per checklist item
(all in one request) and the gold action sequence, each validated and re-asked with feedback on a bad reply: the
state by `repaired`, the others in the stage's repair rounds (the request, the current piece and the feedback)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, create_model

from builder.envs.state_schema import generated_state_schema, reference_problems
from builder.llm.reask import Refusal, repair_messages
from builder.prompts import prompt
from builder.records import (
    Action,
    ChatMessage,
    Environment,
    Sampling,
    scenario_seed,
)
from builder.run.stage import StageContext
from builder.stages._llm import ask, repaired, shrinking, system_user
from builder.stages.scenarios.state import attribute_problems, size_problems, slot_records
from builder.stages.scenarios.verify import load_state
from builder.stages.scenarios.writers import writer_messages
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import interface_text, now_text, writer_sources
from builder.views.state import involved_state, state_output_type, state_text

CODE_SAMPLING_TEMPERATURE = 0.2  # checks and gold sequences are precise code: sample close to greedy


T = TypeVar("T", bound=BaseModel)

CheckSource = Annotated[
    str, Field(description="Python source defining `def check(initial_state, final_state) -> bool`.", max_length=4000)
]


# String caps are part of the schema so a constrained decoder closes every string (see stages/mine.py).
class TaskDraft(BaseModel):
    task: str = Field(description="The user's full request, first person.", max_length=1200)
    difficulty: Literal["easy", "medium", "hard"]
    user_profile: str = Field(max_length=600)
    known_up_front: str = Field(max_length=600)
    reveal_when_asked: str = Field(max_length=600)
    ending: str = Field(max_length=300)
    checklist: list[Annotated[str, Field(max_length=300)]] = Field(min_length=1, max_length=6)
    answer_facts: list[Annotated[str, Field(max_length=200)]] = Field(default_factory=list, max_length=6)


class GoldAction(BaseModel):
    name: str = Field(max_length=80)
    arguments: dict[str, Any]


class GoldSolution(BaseModel):
    actions: list[GoldAction] = Field(min_length=1, max_length=20)


class CheckCode(BaseModel):
    """One check: what a repair of a refused check asks for."""

    code: CheckSource


class CheckCodes(BaseModel):
    """Every check of a checklist, in its order: one request, so the shared context is sent once, not per item."""

    checks: list[CheckSource] = Field(min_length=1, max_length=6)


def checks_model(count: int) -> type[CheckCodes]:
    """`CheckCodes` holding exactly `count` checks (the constrained decoder then writes one per item)."""
    sized = Annotated[list[CheckSource], Field(min_length=count, max_length=count)]
    return create_model("CheckCodes", __base__=CheckCodes, checks=(sized, ...))


@dataclass
class Draft:
    """The pieces of one scenario under construction, with the requests that produced them (a repair is such a
    request, the current piece and the feedback). Mutable on purpose: repairs replace pieces in place; only
    verified drafts become (frozen) `Scenario`s."""

    task: TaskDraft
    task_messages: list[ChatMessage]
    now: str  # the scenario's date-time, chosen with the state
    gold_note: str = ""  # what the gold writer is told of the task's family (`families.gold_note`)
    checks: list[str] = field(default_factory=list)
    check_messages: list[ChatMessage] = field(default_factory=list)
    gold: list[Action] = field(default_factory=list)
    gold_messages: list[ChatMessage] = field(default_factory=list)


def _sampling(ctx: StageContext, temperature: float | None = None) -> Sampling:
    llm = ctx.config.llm
    return Sampling(
        temperature=llm.temperature if temperature is None else temperature, top_p=llm.top_p, max_tokens=llm.max_tokens
    )


async def _ask_fitting(
    ctx: StageContext,
    env: Environment,
    kind: str,
    build: Callable[[PromptBudget], list[ChatMessage]],
    output_type: type[T],
    *,
    sampling: Sampling,
    invalid_reason: str,
) -> tuple[T, list[ChatMessage]]:
    """`ask` with the messages `build(budget)`, built one level smaller while too long for the context
    (`shrinking`, counted under `kind`). Returns the answer and the messages that fitted, for repairs."""

    async def at(budget: PromptBudget) -> tuple[T, list[ChatMessage]]:
        messages = build(budget)
        answer = await ask(ctx, env, messages, output_type, sampling=sampling, invalid_reason=invalid_reason)
        return answer, messages

    return await shrinking(ctx, kind, prompt_budgets(ctx.config.llm.max_state_chars), at)


async def _initial_state(
    env: Environment, ctx: StageContext, slot: int, example: dict[str, Any]
) -> tuple[dict[str, Any], str, int]:
    """A generated state that passed the load and realism gates, as the environment holds it (slot `slot` asks
    for `state.slot_records` records per collection: small for the first slots, large for the last); the
    scenario's `now` (the model's "today" for the state); and the repairs it took (`repaired`, the whole loop
    built smaller while a request is too long for the context)."""
    config = ctx.config.scenarios
    schema = generated_state_schema(env.state_schema, example)
    model = state_output_type(schema, "InitialState")
    # Asked for small to large across the slots; the gate holds every slot to `min_records`, the floor.
    records = slot_records(slot, config.per_environment, config.min_records)

    def request(budget: PromptBudget) -> list[ChatMessage]:
        user = (
            f"{interface_text(env, budget)}\n\n## State schema\n{json.dumps(schema)}\n\n## Default state of the class\n"
            f"{state_text(example, budget)}\n\nWrite initial state {slot + 1} of {config.per_environment} for this "
            "environment (different people, items and situations from the others), with at least "
            f"{records} records in every collection of records."
        )
        return system_user(prompt("scenario_state"), user)

    async def ask_once(conversation: list[ChatMessage], attempt: int) -> tuple[dict[str, Any], str, int] | Refusal:
        reply = await ask(
            ctx, env, conversation, model, sampling=_sampling(ctx), invalid_reason="state_invalid", attempt=attempt
        )
        now, state = reply.now, reply.values()
        loaded, problems = await asyncio.to_thread(
            load_state, ctx.sandbox, env.code, state, now=now, seed=scenario_seed(env.id, now), contract=env.contract
        )
        reason = "state_load_failed"
        if loaded is not None and not problems:
            problems, reason = size_problems(loaded, schema, config.min_records), "state_too_small"
        if loaded is not None and not problems:
            problems, reason = attribute_problems(state, example) + reference_problems(loaded), "state_inconsistent"
        if loaded is not None and not problems:
            return loaded, now, attempt  # the loop's first attempt is 0: `attempt` counts the repairs
        feedback = "This state was refused:\n- " + "\n- ".join(problems) + "\nReply with the corrected full state."
        shown = json.dumps({"now": reply.now, "state": state})
        return Refusal(reason, "; ".join(problems), feedback, shown=shown, raw=shown[:20000])

    async def at(budget: PromptBudget) -> tuple[dict[str, Any], str, int]:
        return await repaired(ctx, env, request(budget), ask_once, attempts=config.repair_attempts + 1)

    return await shrinking(ctx, "scenario_state", prompt_budgets(ctx.config.llm.max_state_chars), at)


async def _task(
    env: Environment, ctx: StageContext, state: dict[str, Any], now: str, feedback: str = "",
    *, output_type: type[TaskDraft] = TaskDraft, note: str = "",
) -> Draft:  # fmt: skip
    """A task draft; with `feedback` (why the previous task was refused and what to do), its replacement. `note`
    says which family of task to write (`families.family_note`), `output_type` is that family's draft."""

    def request(budget: PromptBudget) -> list[ChatMessage]:
        needs = f"\n\n## The kind of task\n{note}" if note else ""
        if feedback:
            needs += f"\n\n## A previous task for this state was refused\n{feedback}"
        return writer_messages(env, budget, now, state, "task", needs)

    draft, messages = await _ask_fitting(
        ctx, env, "scenario_task", request, output_type, sampling=_sampling(ctx), invalid_reason="task_invalid"
    )
    return Draft(draft, messages, now)


async def _checks(
    env: Environment, ctx: StageContext, state: dict[str, Any], draft: Draft
) -> tuple[list[str], list[ChatMessage]]:
    """The code of every check of the checklist, in one request written after the gold (whose state-changing
    methods it is shown), and the request that wrote them (for repairs)."""
    schema = generated_state_schema(env.state_schema, state)
    involved = involved_state(state, draft.gold)
    checklist = draft.task.checklist

    def request(budget: PromptBudget) -> list[ChatMessage]:
        methods = writer_sources(env.code, [action.name for action in draft.gold], budget)
        # What the environment's scenarios share first (the schema, then the methods, which repeat between
        # tasks), the scenario's own records and task after: a model server's prefix cache reuses the start.
        user = f"# Environment {env.name} ({env.domain})\n{env.description}\n\n"
        user += f"## State schema\n{json.dumps(schema)}\n\n"
        if methods:
            user += f"## Methods the solution calls that change the state\n```python\n{methods}\n```\n\n"
        user += (
            f"## Initial state (the records the task involves; others exist)\n{state_text(involved, budget)}\n\n"
            f"## Now\n{now_text(draft.now)}\n\n"
        )
        items = "\n".join(f"{number}. {item}" for number, item in enumerate(checklist, 1))
        user += f"## Task\n{draft.task.task}\n\n## Checklist ({len(checklist)} items)\n{items}"
        return system_user(prompt("scenario_check"), user)

    reply, messages = await _ask_fitting(
        ctx, env, "scenario_check", request, checks_model(len(checklist)),
        sampling=_sampling(ctx, CODE_SAMPLING_TEMPERATURE), invalid_reason="check_invalid",
    )  # fmt: skip
    return list(reply.checks), messages


async def _repaired_check(
    env: Environment, ctx: StageContext, draft: Draft, index: int, problem: str, attempt: int
) -> str:
    """Check `index` rewritten with why it was refused: the request that wrote the checks, the checks as they
    are now and the feedback (`repair_messages`), as attempt `attempt` of the checks (a fresh sample each)."""
    item = draft.task.checklist[index]
    feedback = (
        f"Check {index + 1} ({item!r}) was refused: {problem}\n"
        'Reply with a JSON object {"code": "..."} holding only the corrected function for that item.'
    )
    written = json.dumps({"checks": draft.checks}, ensure_ascii=False)
    messages = repair_messages(draft.check_messages, written, feedback)
    sampling = _sampling(ctx, CODE_SAMPLING_TEMPERATURE)
    reply = await ask(ctx, env, messages, CheckCode, sampling=sampling, invalid_reason="check_invalid", attempt=attempt)
    return reply.code


async def _gold(
    env: Environment, ctx: StageContext, state: dict[str, Any], draft: Draft, feedback: str = "", attempt: int = 0
) -> tuple[list[Action], list[ChatMessage]]:
    """The gold sequence and the request that wrote it; with `feedback` (why the current gold was refused), its
    repair: that request, the current gold and the feedback (`repair_messages`), as attempt `attempt` of it."""
    sampling = _sampling(ctx, CODE_SAMPLING_TEMPERATURE)
    if not feedback:

        def request(budget: PromptBudget) -> list[ChatMessage]:
            needs = f"\n\n## Task\n{draft.task.task}" + (f"\n\n## Note\n{draft.gold_note}" if draft.gold_note else "")
            return writer_messages(env, budget, draft.now, state, "solution", needs)

        reply, messages = await _ask_fitting(
            ctx, env, "scenario_gold", request, GoldSolution, sampling=sampling, invalid_reason="gold_invalid"
        )
    else:
        messages = draft.gold_messages
        previous = json.dumps({"actions": [action.model_dump() for action in draft.gold]}, ensure_ascii=False)
        repair = repair_messages(messages, previous, f"{feedback}\nReply with the corrected full sequence.")
        reply = await ask(
            ctx, env, repair, GoldSolution, sampling=sampling, invalid_reason="gold_invalid", attempt=attempt
        )
    return [Action(name=action.name, arguments=action.arguments) for action in reply.actions], messages


async def _fill(env: Environment, ctx: StageContext, state: dict[str, Any], draft: Draft) -> None:
    """Generate the gold sequence of `draft`, then its checks (they are shown what the gold calls)."""
    draft.gold, draft.gold_messages = await _gold(env, ctx, state, draft)
    if draft.task.checklist:  # an infeasible task has none: nothing may change (the guard) and the answer says why
        draft.checks, draft.check_messages = await _checks(env, ctx, state, draft)
    else:
        draft.checks, draft.check_messages = [], []
