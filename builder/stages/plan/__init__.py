"""plan: design one environment per topic — its state, business rules and operations — as a validated EnvPlan.

Two small structured requests instead of one large one (the CPU smoke model is 135M parameters): first the
state (class name, entities with typed attributes and keys, rules), then the operations given that state. Each
half is cleaned deterministically, validated (`builder.stages.plan.rules`) and, while invalid, asked again with
the errors fed back (`builder.stages._llm.repaired`), at most `plan.repair_attempts` times. Rejection reasons:
`plan_malformed` (no reply ever matched the JSON schema), `plan_invalid` (still invalid after every repair),
`llm_request`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel

from builder.llm.reask import Refusal
from builder.prompts import prompt, prompt_version
from builder.records import ChatMessage, EntityPlan, EnvPlan, Record, Sampling, Topic
from builder.run.stage import StageContext
from builder.stages._llm import ask, repaired, system_user
from builder.stages.plan.rules import (
    OperationsDraft,
    StateDraft,
    clean_operations,
    clean_state,
    entity_plans,
    operation_errors,
    operation_plans,
    state_errors,
)
from builder.views.plan import describe_entity

D = TypeVar("D", bound=BaseModel)


async def plan(topic: Topic, ctx: StageContext) -> list[Record]:
    """One valid EnvPlan for `topic`, or a rejection (plan_malformed, plan_invalid, llm_request)."""
    config = ctx.config.plan
    sampling = Sampling(temperature=ctx.config.llm.temperature, max_tokens=config.max_tokens)
    state = await _repaired(
        ctx,
        topic,
        system_user(prompt("plan_state"), state_request(topic)),
        StateDraft,
        clean=lambda draft: clean_state(draft, topic.name),
        check=state_errors,
        part="state",
        sampling=sampling,
    )
    entities = entity_plans(state)
    bounds = (config.min_operations, config.max_operations)
    operations = await _repaired(
        ctx,
        topic,
        system_user(prompt("plan_operations"), operations_request(state, entities, *bounds)),
        OperationsDraft,
        clean=lambda draft: clean_operations(draft, entities),
        check=lambda draft: operation_errors(draft, entities, len(state.rules), *bounds),
        part="operations",
        sampling=sampling,
    )
    versions = f"{prompt_version('plan_state')}+{prompt_version('plan_operations')}"
    return [
        EnvPlan(
            provenance=ctx.provenance([topic], model=ctx.llm.model_id, sampling=sampling, prompt_version=versions),
            topic_id=topic.id,
            name=topic.name,
            domain=topic.domain,
            class_name=state.class_name,
            description=state.description,
            entities=tuple(entities),
            rules=tuple(state.rules),
            operations=tuple(operation_plans(operations)),
        )
    ]


async def _repaired(
    ctx: StageContext,
    topic: Topic,
    messages: Sequence[ChatMessage],
    output_type: type[D],
    *,
    clean: Callable[[D], D],
    check: Callable[[D], list[str]],
    part: str,
    sampling: Sampling,
) -> D:
    """A cleaned draft with no validation errors; each invalid draft is shown back with its errors (`repaired`).

    Raises:
        Rejected: `plan_malformed` (from `ask`) or `plan_invalid` after `plan.repair_attempts` repairs, with the
            last draft as the raw output.
    """

    async def ask_once(conversation: list[ChatMessage], attempt: int) -> D | Refusal:
        answer = await ask(
            ctx, topic, conversation, output_type, sampling=sampling, invalid_reason="plan_malformed", attempt=attempt
        )
        draft = clean(answer)
        errors = check(draft)
        if not errors:
            return draft
        # The cleaned draft goes back, so the error messages' names and positions match what the model sees.
        detail = f"{part}: " + "; ".join(errors)
        shown, raw = draft.model_dump_json(), answer.model_dump_json()
        return Refusal("plan_invalid", detail, repair_request(errors), shown=shown, raw=raw)

    return await repaired(ctx, topic, messages, ask_once, attempts=ctx.config.plan.repair_attempts + 1)


def repair_request(errors: list[str]) -> str:
    listed = "\n".join(f"- {error}" for error in errors)
    return f"That plan has these problems:\n{listed}\nAnswer again with the whole corrected JSON object."


def state_request(topic: Topic) -> str:
    """The user message of the state request: everything the topic knows."""
    lines = [f"Environment: {topic.name} (domain: {topic.domain})", f"Description: {topic.description}"]
    if topic.entities:
        lines.append(f"Core entities: {', '.join(topic.entities)}")
    lines += [f"Example user request: {request}" for request in topic.example_requests[:3]]
    return "\n".join(lines)


def operations_request(state: StateDraft, entities: list[EntityPlan], min_ops: int, max_ops: int) -> str:
    """The user message of the operations request: the validated state, numbered rules and the bounds."""
    lines = [f"Environment class: {state.class_name}", f"Description: {state.description}", "State:"]
    lines += [f"- {describe_entity(entity)}" for entity in entities]
    lines.append("Rules:")
    lines += [f"{number}. {rule}" for number, rule in enumerate(state.rules, 1)]
    lines.append(f"Plan between {min_ops} and {max_ops} operations, with at least one query and one change.")
    return "\n".join(lines)
