"""mine: judge each seed request and infer the stateful environment behind it (two model calls per seed).

The judge keeps requests that need a persistent, domain-specific system with reads and writes; topic inference
names that system, describes it independently of the request, lists its core entities and scores how well it
can be modelled and how useful it is. Topics scoring under `mine.keep_threshold` are dropped.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, Field

from builder.prompts import prompt, prompt_version
from builder.records import Record, Sampling, SeedTask, Topic
from builder.run.stage import Rejected, StageContext
from builder.stages._llm import ask, system_user


# Length caps on free text are part of the JSON schema, so a constrained decoder must close the string: a small
# model that loops inside a string ("to cherish, to cherish, ...") then ends its answer instead of running into
# max_tokens and failing as invalid JSON (a third of the 135M model's mine failures before the caps).
class Judgement(BaseModel):
    reason: str = Field(description="One or two sentences.", max_length=400)
    needs_stateful_system: bool


class TopicDraft(BaseModel):
    name: str = Field(max_length=80)
    description: str = Field(max_length=600)
    domain: str = Field(max_length=40)
    core_entities: list[Annotated[str, Field(max_length=60)]] = Field(min_length=1, max_length=8)
    modelability: int = Field(ge=1, le=10)
    usefulness: int = Field(ge=1, le=10)


JUDGE_SAMPLING = Sampling(temperature=0.0, max_tokens=256)


def snake_case(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.casefold()).strip("_")


async def mine(seed: SeedTask, ctx: StageContext) -> list[Record]:
    """One topic for a seed request, or a rejection (not_stateful, judge_invalid, topic_invalid, low_score)."""
    judgement = await ask(
        ctx,
        seed,
        system_user(prompt("mine_judge"), seed.request),
        Judgement,
        sampling=JUDGE_SAMPLING,
        invalid_reason="judge_invalid",
    )
    if not judgement.needs_stateful_system:
        raise Rejected(ctx.reject(seed, "not_stateful", judgement.reason))
    sampling = Sampling(temperature=ctx.config.llm.temperature, max_tokens=512)
    draft = await ask(
        ctx,
        seed,
        system_user(prompt("mine_topic"), f"User request: {seed.request}"),
        TopicDraft,
        sampling=sampling,
        invalid_reason="topic_invalid",
    )
    name, domain = snake_case(draft.name), snake_case(draft.domain)
    if not name or not domain or not draft.description.strip():
        raise Rejected(ctx.reject(seed, "topic_invalid", f"empty name, domain or description: {draft!r}"))
    modelability, usefulness = draft.modelability / 10, draft.usefulness / 10
    threshold = ctx.config.mine.keep_threshold
    if min(modelability, usefulness) < threshold:
        detail = f"{name}: modelability {modelability:.1f}, usefulness {usefulness:.1f} (keep at >= {threshold})"
        raise Rejected(ctx.reject(seed, "low_score", detail))
    versions = f"{prompt_version('mine_judge')}+{prompt_version('mine_topic')}"
    return [
        Topic(
            provenance=ctx.provenance([seed], model=ctx.llm.model_id, sampling=sampling, prompt_version=versions),
            name=name,
            description=" ".join(draft.description.split()),
            domain=domain,
            entities=tuple(dict.fromkeys(snake_case(entity) for entity in draft.core_entities if snake_case(entity))),
            example_requests=(seed.request,),
            judge_reason=judgement.reason,
            modelability=modelability,
            usefulness=usefulness,
        )
    ]
