"""The client every stage talks to: one `chat` call with cache, bounded concurrency, retries and accounting.

It wraps any `ChatModel` backend (the OpenAI-compatible one in production, the scripted one in tests), so all
of its logic is tested without a server. It is also the one place every request passes, so it fits completion
budgets into the model's context and switches thinking on or off. `structured` asks for a pydantic model and
re-asks with the validation error fed back (`builder.llm.reask`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from builder.llm.base import TOOL_CHOICE_KEYWORDS, CallRecord, ChatModel, ChatRequest, Reply
from builder.llm.cache import ResponseCache
from builder.llm.errors import LLMError, LLMRequestError, PromptTooLongError, ServerUnreachable, StructuredOutputError
from builder.llm.parsing import parse_structured, response_format, split_reasoning, tool_names, with_strict
from builder.llm.reask import NoUsableReply, Refusal, reask
from builder.llm.retry import RetryPolicy, with_retries
from builder.llm.sanitize import clean_reply
from builder.records import ChatMessage, Sampling
from builder.usage import Usage, add_to_tallies

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# Kept free between prompt + completion budget and the context: a measured count can still differ from the
# server's by a few tokens (special tokens added outside the template).
CONTEXT_MARGIN_TOKENS = 32
# The smallest completion worth sending a request for (or the request's own budget, if smaller): a reply
# squeezed below it would be cut in almost every case, so the prompt is reported too long instead.
MIN_COMPLETION_TOKENS = 256
# Without the server's tokenizer: one token per 3 characters of the messages' and tools' JSON, with non-ASCII
# characters escaped (6 characters each, so 2 tokens). Tokenizers average about 4 characters a token on English
# and code, and the JSON keys stand in for the template's own tokens, so this overestimates.
ESTIMATE_CHARS_PER_TOKEN = 3
# A prompt holds at most one token per byte of its text (every token of a byte-level or byte-fallback tokenizer
# covers at least one byte), and its ASCII JSON has at least one character per byte (escapes take more); the
# chat template adds its own text (role markers, a tools preamble, a default system prompt), allowed for here.
TEMPLATE_ALLOWANCE_TOKENS = 512
_MEASURED_PROMPTS = 4096  # prompt sizes remembered (growths and repeated samples of one prompt reuse them)


class LLMClient:
    """A `ChatModel` that adds what every stage needs around a backend.

    Per call: sampling defaults filled in, `strict: true` on tools, the thinking switch, the completion budget
    fitted into the context, a response-cache lookup, at most `max_concurrency` backend requests in flight, a
    hard `request_timeout_s` per attempt, retries with backoff on `TransientLLMError` (HTTP 429 and 5xx, dropped
    connections, unreadable bodies) and timeouts, never on `LLMRequestError` (`builder.llm.retry`), reasoning
    split off the content, lone surrogates and NUL characters cleaned out of the reply (`builder.llm.sanitize`),
    a cut reply asked again with a larger budget, and one `CallRecord` to `on_call` per request, also for cache
    hits and failures. Usage follows the one ledger rule of `usage.Usage`: `totals` sums every request, a reply's
    `cost` (a failure's `LLMError.cost`) those of its call, an open `usage.tally()` block those made inside it.

    Budgets: the prompt is measured (the backend's `count_prompt_tokens`, else a conservative estimate) and
    `max_tokens` is capped at `context_tokens - prompt - CONTEXT_MARGIN_TOKENS`, so no request is sent whose
    prompt and budget exceed the context. If that leaves less than min(budget, MIN_COMPLETION_TOKENS), nothing is
    sent and `PromptTooLongError` is raised. A budget that fits beside the largest size the prompt could have
    (`prompt_token_bound`) is sent without measuring: the budget is the same, and the measurement is a round trip
    to the server before the request can start. A reply cut at its budget (`finish_reason == "length"`) is asked
    again with the budget doubled, up to `max_budget_growths` times and never past the context; the last reply is
    returned (still "length" if even the largest budget was used up).

    Args:
        backend: What actually answers.
        model_id: Identity of the served weights; part of every cache key, so two models never share replies.
        cache: Response cache, or None for no caching.
        on_call: Observer called with each `CallRecord` (e.g. the pipeline's per-stage stats).
        default_sampling: Fills sampling fields a request leaves as None.
        context_tokens: The model's context (llm.max_model_len); None: unknown, budgets are sent as asked.
        thinking: Sent as `chat_template_kwargs.enable_thinking` on every request (a template without the
            switch ignores it); None sends nothing.
        reasoning_budget: With thinking on, added to every completion budget for the reasoning before the answer.
        max_budget_growths: How often a cut reply is asked again with a doubled budget.
        max_retries, retry_budget_s: Tries after the first, and the time from the first try within which a
            retry may still start (`retry.RetryPolicy`).
        sleep, rng, clock: Injected for tests of the backoff.
    """

    def __init__(
        self,
        backend: ChatModel,
        *,
        model_id: str,
        cache: ResponseCache | None = None,
        on_call: Callable[[CallRecord], None] | None = None,
        default_sampling: Sampling | None = None,
        context_tokens: int | None = None,
        thinking: bool | None = None,
        reasoning_budget: int = 0,
        max_budget_growths: int = 2,
        max_concurrency: int = 16,
        request_timeout_s: float = 300.0,
        max_retries: int = 4,
        retry_budget_s: float = 900.0,
        structured_retries: int = 2,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        sleep: Callable[[float], Any] = asyncio.sleep,
        rng: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.model_id = model_id
        self.cache = cache
        self.on_call = on_call
        self.default_sampling = default_sampling or Sampling()
        self.context_tokens = context_tokens
        self.thinking = thinking
        self.reasoning_budget = reasoning_budget
        self.max_budget_growths = max_budget_growths
        self.max_concurrency = max_concurrency
        self.request_timeout_s = request_timeout_s
        self.retry = RetryPolicy(max_retries, retry_budget_s, backoff_base_s, backoff_cap_s)
        self.structured_retries = structured_retries
        self.totals = Usage()  # every request of this client, by the ledger rule
        self._sleep = sleep
        self._rng = rng
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._measured: dict[str, int] = {}
        self._answered = False  # whether any request of this client got a response (see `ServerUnreachable`)

    async def chat(self, request: ChatRequest) -> Reply:
        """Answer `request`, from the cache when possible, with its completion budget fitted into the context.

        Raises:
            PromptTooLongError: the prompt leaves too little of the context for a reply; nothing was sent.
            LLMRequestError: the server rejected the request (4xx), or every retry failed.
            ServerUnreachable: every try found no server, and no request of this client was ever answered.
            ValueError: `tool_choice` names no tool of the request.
        """
        request = self._prepare(request)
        if self.context_tokens is None:
            return await self._answer(request, regrowth=0)
        prompt_tokens: int | None = None
        wanted = request.sampling.max_tokens
        if wanted is None or self._room(prompt_token_bound(request)) < wanted:
            prompt_tokens = await self._prompt_tokens(request)
            request = self._fitted(request, prompt_tokens)
        reply = await self._answer(request, regrowth=0)
        cost = reply.cost
        for growth in range(1, self.max_budget_growths + 1):
            if reply.finish_reason != "length":
                break
            if prompt_tokens is None:
                prompt_tokens = await self._prompt_tokens(request)  # only now does the exact room matter
            if (larger := self._grown(request, prompt_tokens)) is None:
                break
            # A distinct request (its budget is part of the cache key), so a rerun replays both replies.
            request = larger
            try:
                reply = await self._answer(request, regrowth=growth)
            except LLMError as error:
                error.cost = cost + error.cost  # the cut replies before it were paid for too
                raise
            cost += reply.cost
        return reply.model_copy(update={"cost": cost})

    async def structured(
        self,
        messages: Sequence[ChatMessage | dict[str, Any]],
        output_type: type[T],
        *,
        sampling: Sampling | None = None,
        sample_index: int = 0,
        attempt: int = 0,
        retries: int | None = None,
    ) -> T:
        """Ask for JSON matching `output_type` (strict `response_format`) and return the validated object.

        On invalid output the model is asked again (`builder.llm.reask`), shown the prompt, its latest reply and
        the validation error, up to `retries` times (default: the client's `structured_retries`). Each request is
        a fresh sample: a call that is attempt `attempt` of the caller's own repair loop sends samples
        `sample_index + attempt * (retries + 1)` onwards, so the caller's attempts never share a sample.

        Raises:
            StructuredOutputError: no reply validated; carries the last raw text and every error.
            LLMRequestError: a request failed (see `chat`).
        """
        asked = [ChatMessage.model_validate(message) for message in messages]
        limit = self.structured_retries if retries is None else retries
        first = ChatRequest(
            messages=tuple(asked),
            response_format=response_format(output_type),
            sampling=sampling or Sampling(),
            sample_index=sample_index,
        )
        errors: list[str] = []

        async def ask_once(conversation: list[ChatMessage], sample: int) -> T | Refusal:
            reply = await self.chat(first.resampled(sample, conversation))
            raw_text = reply.content or ""
            try:
                return parse_structured(raw_text, output_type)
            except ValueError as error:
                errors.append(str(error))
            return Refusal("invalid_output", errors[-1], _feedback(errors[-1], reply.finish_reason), shown=raw_text)

        try:
            return await reask(asked, ask_once, attempts=limit + 1, attempt=attempt)
        except NoUsableReply as failed:
            message = f"no valid {output_type.__name__} after {len(errors)} replies; last error: {errors[-1]}"
            raw_text = failed.refusal.raw_output or ""
            raise StructuredOutputError(message, raw_text=raw_text, errors=errors, attempts=len(errors)) from None

    async def aclose(self) -> None:
        """Close the backend's connections, if it has any; call at the end of each event loop that used it."""
        close = getattr(self.backend, "aclose", None)
        if close is not None:
            await close()

    def _prepare(self, request: ChatRequest) -> ChatRequest:
        choice = request.tool_choice
        if choice is not None and choice not in TOOL_CHOICE_KEYWORDS and choice not in tool_names(request.tools):
            raise ValueError(f"tool_choice {choice!r} is neither auto/required/none nor the name of a given tool")
        defaults = self.default_sampling.model_dump()
        given = request.sampling.model_dump(exclude_none=True)
        sampling = Sampling(**{**defaults, **given})
        extra = request.extra
        if self.thinking is not None:
            # vLLM passes chat_template_kwargs to the template; one without `enable_thinking` never sees it.
            kwargs = {"enable_thinking": self.thinking, **extra.get("chat_template_kwargs", {})}
            extra = {**extra, "chat_template_kwargs": kwargs}
            if self.thinking and sampling.max_tokens is not None:
                sampling = sampling.model_copy(update={"max_tokens": sampling.max_tokens + self.reasoning_budget})
        return request.model_copy(update={"sampling": sampling, "tools": with_strict(request.tools), "extra": extra})

    async def _prompt_tokens(self, request: ChatRequest) -> int:
        """The prompt's size: measured by the backend once per prompt, else estimated (`estimate_prompt_tokens`)."""
        key = prompt_key(request)
        if (known := self._measured.get(key)) is not None:
            return known
        count = None
        counter = getattr(self.backend, "count_prompt_tokens", None)
        if counter is not None:
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    count = await counter(request)
            except TimeoutError:
                count = None
        if count is None:
            return estimate_prompt_tokens(request)
        if len(self._measured) >= _MEASURED_PROMPTS:
            self._measured.pop(next(iter(self._measured)))  # the oldest
        self._measured[key] = count
        return count

    def _room(self, prompt_tokens: int) -> int:
        assert self.context_tokens is not None
        return self.context_tokens - prompt_tokens - CONTEXT_MARGIN_TOKENS

    def _fitted(self, request: ChatRequest, prompt_tokens: int) -> ChatRequest:
        """`request` with its budget capped at what the context leaves (or set to it, if the request has none)."""
        room = self._room(prompt_tokens)
        wanted = request.sampling.max_tokens
        needed = min(wanted or MIN_COMPLETION_TOKENS, MIN_COMPLETION_TOKENS)
        if room < needed:
            raise PromptTooLongError(
                f"the prompt takes {prompt_tokens} of the model's {self.context_tokens} context tokens "
                f"(llm.max_model_len), leaving {max(room, 0)} for the reply; at least {needed} are needed",
                prompt_tokens=prompt_tokens,
                context_tokens=self.context_tokens or 0,
                min_completion=needed,
            )
        return _with_budget(request, min(wanted, room) if wanted else room)

    def _grown(self, request: ChatRequest, prompt_tokens: int) -> ChatRequest | None:
        """`request` with its budget doubled (at most to what the context leaves), or None if it cannot grow."""
        current = request.sampling.max_tokens or 0
        larger = min(2 * current, self._room(prompt_tokens))
        return _with_budget(request, larger) if larger > current else None

    async def _answer(self, request: ChatRequest, *, regrowth: int) -> Reply:
        """One request as it is: from the cache, or sent (with retries), split, cached and reported; the reply's
        (or the error's) `cost` is this request's usage."""
        key = request.cache_key(self.model_id)
        start = time.perf_counter()
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            record = self._report(key, hit, start, cached=True, attempts=0, regrowth=regrowth)
            return hit.model_copy(update={"cost": record.usage})
        try:
            raw, attempts = await self._call_with_retries(request)
        except LLMError as error:
            error.cost = self._report_failure(key, start, error, regrowth=regrowth).usage
            raise
        content, reasoning = split_reasoning(raw.content, raw.reasoning)
        # The cache keeps the answer, not what it cost: a later hit costs nothing. Cleaned before it is cached or
        # returned: a lone surrogate cannot be written to the cache, a record or Parquet.
        reply = clean_reply(raw.model_copy(update={"content": content, "reasoning": reasoning, "cost": Usage()}))
        if self.cache is not None:
            self.cache.put(key, reply)
        record = self._report(key, reply, start, cached=False, attempts=attempts, regrowth=regrowth)
        return reply.model_copy(update={"cost": record.usage})

    async def _call_with_retries(self, request: ChatRequest) -> tuple[Reply, int]:
        async def attempt_once() -> Reply:
            async with self._bound():
                async with asyncio.timeout(self.request_timeout_s):
                    return await self.backend.chat(request)

        try:
            answered = await with_retries(attempt_once, self.retry, sleep=self._sleep, clock=self._clock, rng=self._rng)
        except LLMRequestError as error:
            # No response, and none ever: no server is there (a wrong URL, one that is down); the operator's to fix.
            if error.retryable and error.status_code is None and not self._answered:
                raise ServerUnreachable(f"no model server answered {self.model_id!r}: {error}") from error
            raise
        self._answered = True
        return answered

    def _bound(self) -> asyncio.Semaphore:
        # A semaphore belongs to one event loop; the pipeline may run each stage in its own `asyncio.run`.
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._loop, self._semaphore = loop, asyncio.Semaphore(self.max_concurrency)
        return self._semaphore

    def _report(
        self, key: str, reply: Reply, start: float, *, cached: bool, attempts: int, regrowth: int
    ) -> CallRecord:
        record = CallRecord(
            model=self.model_id,
            key=key,
            prompt_tokens=reply.usage.prompt_tokens,
            completion_tokens=reply.usage.completion_tokens,
            latency_s=time.perf_counter() - start,
            cached=cached,
            attempts=attempts,
            retries=max(attempts - 1, 0),
            finish_reason=reply.finish_reason,
            regrowth=regrowth,
        )
        self._emit(record)
        return record

    def _report_failure(self, key: str, start: float, error: LLMError, *, regrowth: int) -> CallRecord:
        latency = time.perf_counter() - start
        attempts = getattr(error, "attempts", 1)
        record = CallRecord(
            model=self.model_id,
            key=key,
            latency_s=latency,
            ok=False,
            attempts=attempts,
            retries=max(attempts - 1, 0),
            error=str(error),
            regrowth=regrowth,
        )
        self._emit(record)
        return record

    def _emit(self, record: CallRecord) -> None:
        self.totals += record.usage
        add_to_tallies(record.usage)
        if self.on_call is not None:
            self.on_call(record)


def prompt_key(request: ChatRequest) -> str:
    """What the prompt's size depends on: the messages as sent, the tools and the chat template kwargs."""
    content = [request.wire_messages(), list(request.tools), request.extra.get("chat_template_kwargs")]
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def prompt_token_bound(request: ChatRequest) -> int:
    """A size the prompt cannot exceed (see TEMPLATE_ALLOWANCE_TOKENS)."""
    text = json.dumps([request.wire_messages(), list(request.tools)], ensure_ascii=True)
    return len(text) + TEMPLATE_ALLOWANCE_TOKENS


def estimate_prompt_tokens(request: ChatRequest) -> int:
    """A prompt size that errs on the large side, for backends that cannot count (see ESTIMATE_CHARS_PER_TOKEN)."""
    text = json.dumps([request.wire_messages(), list(request.tools)], ensure_ascii=True)
    return len(text) // ESTIMATE_CHARS_PER_TOKEN + 1


def _with_budget(request: ChatRequest, max_tokens: int) -> ChatRequest:
    return request.model_copy(update={"sampling": request.sampling.model_copy(update={"max_tokens": max_tokens})})


def _feedback(error: str, finish_reason: str) -> str:
    # The client already grew the budget as far as it may: say what happened, do not ask for a shorter answer.
    cut = " The reply used up its whole token budget and stops unfinished." if finish_reason == "length" else ""
    return (
        f"Your reply was not valid: {error}.{cut} "
        "Answer again with only a JSON object that matches the required schema."
    )
