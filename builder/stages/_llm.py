"""Asking the model inside a stage, with failures turned into rejections: one structured answer (`ask`), an
answer re-asked with feedback until the stage's own check accepts it (`repaired`), and a prompt built smaller
while it is too long for the model's context (`shrinking`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from pydantic import BaseModel

from builder.limits import DETAIL_CHARS
from builder.llm import LLMRequestError, PromptTooLongError, StructuredOutputError
from builder.llm.reask import NoUsableReply, Refusal, reask
from builder.records import ChatMessage, Record, Sampling
from builder.run.stage import Rejected, StageContext

T = TypeVar("T", bound=BaseModel)
A = TypeVar("A")
S = TypeVar("S")


def system_user(system: str, user: str) -> list[ChatMessage]:
    return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]


async def ask(
    ctx: StageContext,
    subject: Record,
    messages: Sequence[ChatMessage],
    output_type: type[T],
    *,
    sampling: Sampling,
    invalid_reason: str,
    attempt: int = 0,
) -> T:
    """The model's answer as a validated `output_type`; `attempt` is which attempt of the stage's repair loop
    this is (its requests are fresh samples, see `builder.llm.reask`).

    Raises:
        Rejected: the model never produced valid output (`invalid_reason`, with its raw text), or the server
            refused the request or failed it after every retry (`llm_request`, the status in the detail), or the
            prompt alone fills the context (`prompt_too_long`: a stage that can shrink its prompt asks again
            smaller, see `shrinking`).
        ServerUnreachable: no server ever answered this client; the run stops and can resume.
    """
    try:
        return await ctx.llm.structured(messages, output_type, sampling=sampling, attempt=attempt)
    except StructuredOutputError as error:
        detail = "; ".join(error.errors)[-DETAIL_CHARS:]
        raise Rejected(ctx.reject(subject, invalid_reason, detail, raw_output=error.raw_text)) from None
    except PromptTooLongError as error:
        raise Rejected(ctx.reject(subject, "prompt_too_long", str(error)[:DETAIL_CHARS])) from error
    except LLMRequestError as error:  # also after every retry (the status is in the message)
        raise Rejected(ctx.reject(subject, "llm_request", str(error)[:DETAIL_CHARS])) from None


async def repaired(
    ctx: StageContext,
    subject: Record,
    messages: Sequence[ChatMessage],
    ask_once: Callable[[list[ChatMessage], int], Awaitable[A | Refusal]],
    *,
    attempts: int,
) -> A:
    """The first usable answer of `ask_once(conversation, attempt)`, at most `attempts` tries (`reask`: each
    re-ask shows `messages`, the latest refused reply and its feedback, as a fresh sample).

    `ask_once` asks (usually through `ask`, passing `attempt` on) and checks the answer: a `Refusal` says why
    it cannot be used and what the model is told.

    Raises:
        Rejected: every attempt was refused: the last refusal's reason, detail and raw reply, naming `subject`;
            or what `ask_once` rejected itself (invalid output, a refused request, a prompt too long).
    """
    try:
        return await reask(messages, ask_once, attempts=attempts)
    except NoUsableReply as failed:
        last = failed.refusal
        raise Rejected(
            ctx.reject(subject, last.reason, last.detail[:DETAIL_CHARS], raw_output=last.raw_output)
        ) from None


async def shrinking(ctx: StageContext, prompt_name: str, sizes: Sequence[S], ask_at: Callable[[S], Awaitable[A]]) -> A:
    """`ask_at(size)` with the first of `sizes`; while the prompt is too long for the model's context (a
    `PromptTooLongError`, or `ask`'s `prompt_too_long` rejection), again with the next smaller size, each shrink
    counted in `ctx.stats.report.prompt_shrunk[prompt_name]`. At the last size the error goes up as it is."""
    *larger, smallest = sizes
    for size in larger:
        try:
            return await ask_at(size)
        except (PromptTooLongError, Rejected) as error:
            if isinstance(error, Rejected) and error.rejection.reason != "prompt_too_long":
                raise
        shrunk = ctx.stats.report.prompt_shrunk
        shrunk[prompt_name] = shrunk.get(prompt_name, 0) + 1
    return await ask_at(smallest)
