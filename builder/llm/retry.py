"""Retrying a request after transient failures: how long to wait, and when to give up.

A failure is transient when asking again can succeed: the connection dropped or was refused, the request timed
out, the server (or a gateway in front of it) answered HTTP 429 or 5xx, or the body was not a chat completion.
Those are tried again after a backoff that is at least what the server's `Retry-After` asked for, at most
`max_retries` times and never past `budget_s` from the first try: a rate limiter that asks for an hour makes
the request fail now, with the status in its message, instead of holding the item for that hour.
"""

from __future__ import annotations

import email.utils
import logging
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from builder.llm.errors import LLMRequestError, TransientLLMError

logger = logging.getLogger(__name__)

R = TypeVar("R")


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt + 1`: exponential, capped, with jitter.

    Half of the delay is fixed and half random ("equal jitter"), so delays always grow but clients that failed
    together do not retry together.
    """
    ceiling = min(cap_s, base_s * 2**attempt)
    return ceiling / 2 + rng() * ceiling / 2


def retry_after_seconds(value: str | None, *, now: datetime | None = None) -> float | None:
    """The wait a `Retry-After` header asks for, in seconds: its delay-seconds, or the time until its HTTP date
    (0 for a date already past); None when there is no header or it cannot be read."""
    if not value or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True)
class RetryPolicy:
    """How a client retries: `max_retries` tries after the first, within `budget_s` of the first try, waiting
    `backoff_delay(base_s, cap_s)` or the server's `Retry-After`, whichever is longer."""

    max_retries: int = 4
    budget_s: float = 900.0
    base_s: float = 0.5
    cap_s: float = 30.0


async def with_retries(
    attempt_once: Callable[[], Awaitable[R]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Any],
    clock: Callable[[], float],
    rng: Callable[[], float] = random.random,
) -> tuple[R, int]:
    """`attempt_once()` tried until it answers, and how many tries that took.

    `TransientLLMError` and `TimeoutError` are retried; anything else is raised at once. An `LLMRequestError`
    (also the one raised when the retries run out) carries the number of tries in `attempts`.

    Raises:
        LLMRequestError: the request was refused (4xx), or it still failed after the last try allowed by
            `max_retries` and `budget_s`; the message and `status_code` name the last failure's HTTP status.
    """
    start = clock()
    attempt = 0
    while True:
        try:
            return await attempt_once(), attempt + 1
        except LLMRequestError as error:
            error.attempts = attempt + 1
            raise
        except (TransientLLMError, TimeoutError) as error:
            last = error
        tries = attempt + 1
        if attempt == policy.max_retries:
            reason = f"after {tries} attempts"
            break
        delay = backoff_delay(attempt, base_s=policy.base_s, cap_s=policy.cap_s, rng=rng)
        asked = getattr(last, "retry_after_s", None)
        if asked is not None:
            delay = max(delay, asked)
        if clock() - start + delay > policy.budget_s:
            reason = (
                f"after {tries} attempts (waiting {delay:.1f} s more would pass llm.retry_budget_s = "
                f"{policy.budget_s:g} s)"
            )
            break
        attempt += 1
        logger.warning("LLM request failed (%s); retry %d in %.1f s", describe(last), attempt, delay)
        await sleep(delay)
    status = getattr(last, "status_code", None)
    raise LLMRequestError(
        f"LLM request failed {reason}: {describe(last)}", status_code=status, retryable=True, attempts=tries
    )


def describe(error: BaseException | None) -> str:
    """A failure in one line (a bare timeout has no message of its own)."""
    if isinstance(error, TimeoutError):
        return "timed out"
    return str(error) or type(error).__name__
