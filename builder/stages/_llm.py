"""Asking the model for structured output inside a stage, with failures turned into rejections."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel

from builder.llm import LLMRequestError, PromptTooLongError, StructuredOutputError
from builder.records import ChatMessage, Record, Sampling
from builder.run.stage import Rejected, StageContext

T = TypeVar("T", bound=BaseModel)


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
    sample_index: int = 0,
) -> T:
    """The model's answer as a validated `output_type`.

    Raises:
        Rejected: the model never produced valid output (`invalid_reason`, with its raw text), or the server
            refused the request (`llm_request`), or the prompt alone fills the context (`prompt_too_long`: a stage
            that can shrink its prompt catches that rejection and asks again smaller).
        LLMRequestError: the server could not be reached after every retry; the run stops and can resume.
    """
    try:
        return await ctx.llm.structured(messages, output_type, sampling=sampling, sample_index=sample_index)
    except StructuredOutputError as error:
        detail = "; ".join(error.errors)[-2000:]
        raise Rejected(ctx.reject(subject, invalid_reason, detail, raw_output=error.raw_text)) from None
    except PromptTooLongError as error:
        raise Rejected(ctx.reject(subject, "prompt_too_long", str(error)[:2000])) from error
    except LLMRequestError as error:
        if error.retryable:
            raise
        raise Rejected(ctx.reject(subject, "llm_request", str(error)[:2000])) from None
