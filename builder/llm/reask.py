"""Re-asking a model with feedback: the one loop behind structured output, stage repairs and code regeneration.

The caller asks a prompt and judges the reply: a usable answer, or a `Refusal` saying why not and what to tell
the model. A refused prompt is asked again as the prompt, the refused reply and the feedback (`repair_messages`):
only the latest exchange, so a conversation never grows past the prompt plus one reply however many attempts
are allowed. After `attempts` refused attempts `NoUsableReply` carries the last refusal.

Sample numbers. Every attempt must be a fresh sample (`ChatRequest.resampled`): a model that repeats a refused
reply would otherwise send the very same request again, which the response cache (or a seeded server) answers
the very same way. The loop numbers its attempts, and the numbers nest: attempt `n` of a loop of `N` attempts
that runs as attempt `a` of an enclosing loop is sample `a * N + n` of its prompt. A stage's repair attempt `a`
that asks through `structured` (itself a loop of `llm.structured_retries + 1` attempts) so sends samples
`a * (structured_retries + 1)` onwards, and no two requests of one prompt share a sample; no caller computes an
offset.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from builder.records import ChatMessage

A = TypeVar("A")
K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True)
class Refusal:
    """Why a reply cannot be used.

    Attributes:
        reason: The failure's stable code (the rejection reason, should no attempt be left).
        detail: What was wrong, for the rejection record.
        feedback: What the model is told when it is asked again.
        shown: The refused reply as the model is shown it again; None: not shown (a tool call whose result never
            came would break the chat template, so the feedback goes back alone).
        raw: The reply as the rejection keeps it, if not `shown` (e.g. the draft before it was cleaned).
    """

    reason: str
    detail: str
    feedback: str
    shown: str | None = None
    raw: str | None = None

    @property
    def raw_output(self) -> str | None:
        return self.shown if self.raw is None else self.raw


class NoUsableReply(Exception):  # noqa: N818 - a verdict about replies, not a program error
    """Every attempt was refused: `refusals` holds the last refusal of each prompt still refused, `refusal` the
    first of them (the only one, for a single prompt)."""

    def __init__(self, refusals: Mapping[Hashable, Refusal]) -> None:
        self.refusals = dict(refusals)
        self.refusal = next(iter(self.refusals.values()))
        super().__init__(f"{self.refusal.reason}: {self.refusal.detail}")


def repair_messages(asked: Sequence[ChatMessage], shown: str | None, feedback: str) -> list[ChatMessage]:
    """The re-ask of `asked` after a refused reply: the prompt, the reply as `shown` (if any), the feedback."""
    reply = [ChatMessage(role="assistant", content=shown)] if shown is not None else []
    return [*asked, *reply, ChatMessage(role="user", content=feedback)]


async def reask(
    asked: Sequence[ChatMessage],
    ask_once: Callable[[list[ChatMessage], int], Awaitable[A | Refusal]],
    *,
    attempts: int,
    attempt: int = 0,
) -> A:
    """`ask_once(conversation, sample)` until it gives a usable answer, at most `attempts` times.

    The first conversation is `asked`; each later one `asked` with the last refused reply and its feedback.
    `sample` numbers the attempt as the module docstring says (`attempt`: which attempt of an enclosing loop this
    loop is); `ask_once` sends `request.resampled(sample, conversation)`, or `structured(..., attempt=sample)`.

    Raises:
        NoUsableReply: every attempt was refused; its `refusal` is the last one.
    """

    async def one(_key: None, conversation: list[ChatMessage], sample: int) -> A | Refusal:
        return await ask_once(conversation, sample)

    answers = await reask_each({None: asked}, one, attempts=attempts, attempt=attempt)
    return answers[None]


async def reask_each(
    asked: Mapping[K, Sequence[ChatMessage]],
    ask_once: Callable[[K, list[ChatMessage], int], Awaitable[A | Refusal]],
    *,
    attempts: int,
    attempt: int = 0,
    judge: Callable[[dict[K, A]], Awaitable[Mapping[K, Refusal]]] | None = None,
    refused: Mapping[K, Refusal] | None = None,
) -> dict[K, A]:
    """`reask` for several prompts at once (the pieces of one module), asked concurrently; each attempt asks
    again only the prompts still refused.

    `judge(answers)`, called once every prompt has a usable answer, may refuse some of them for what they do
    together (pieces that do not assemble into a working module); those are asked again. `refused` starts from
    replies refused earlier (a later stage repairing a finished module): then only those prompts are asked.

    Returns:
        The usable answer of every prompt asked.

    Raises:
        NoUsableReply: after `attempts` attempts some prompts were still refused.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    refusals = dict(refused or {})
    todo = list(refusals) or list(asked)
    answers: dict[K, A] = {}
    for number in range(attempts):
        sample = attempt * attempts + number
        asking = [ask_once(key, _conversation(asked[key], refusals.get(key)), sample) for key in todo]
        for key, result in zip(todo, await asyncio.gather(*asking), strict=True):
            if isinstance(result, Refusal):
                refusals[key] = result
            else:
                answers[key] = result
                refusals.pop(key, None)
        if not refusals and judge is not None:
            refusals = dict(await judge(answers))
        if not refusals:
            return answers
        todo = list(refusals)
    raise NoUsableReply(refusals)


def _conversation(asked: Sequence[ChatMessage], refusal: Refusal | None) -> list[ChatMessage]:
    if refusal is None:
        return list(asked)
    return repair_messages(asked, refusal.shown, refusal.feedback)
