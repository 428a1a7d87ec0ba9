"""The production backend: any OpenAI-compatible chat-completions endpoint (vLLM's server in practice).

It only translates: `ChatRequest` to the request body, the response to `Reply`, and errors to the model
layer's two kinds: retryable `TransientLLMError` (connection errors, timeouts, HTTP 429 and 5xx with the
server's `Retry-After`, a body that is not a chat completion) and final `LLMRequestError` (any other 4xx).
Retries, caching and concurrency live in `LLMClient`, so they behave the same for every backend.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletion

from builder.llm.base import TOOL_CHOICE_KEYWORDS, ChatRequest, Reply, TokenUsage
from builder.llm.errors import LLMRequestError, TransientLLMError
from builder.llm.retry import retry_after_seconds
from builder.records import FunctionCall, ToolCall

# 4xx statuses worth asking again: rate limited (hosted endpoints and gateways in front of vLLM send it).
TRANSIENT_CLIENT_STATUSES = frozenset({408, 429})


class OpenAIChatModel:
    """A `ChatModel` backed by `openai.AsyncOpenAI` pointed at `base_url` (…/v1).

    The SDK's own retries are off (the client retries with jitter instead). One SDK client is kept per event
    loop, because its connection pool cannot be shared between loops.

    Args:
        base_url: The endpoint, e.g. `http://127.0.0.1:8000/v1`.
        model: The model name the server exposes (vLLM's `--served-model-name`).
        timeout_s: Transport timeout of one request.
        http_client_factory: Builds the `httpx.AsyncClient` to use (the benchmark adds timing hooks).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "local",
        timeout_s: float = 300.0,
        http_client_factory: Callable[[], httpx.AsyncClient] | None = None,
        tokenize: bool = True,
        seeds: bool = True,
    ) -> None:
        self.base_url = base_url
        self.seeds = seeds
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.http_client_factory = http_client_factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sdk: openai.AsyncOpenAI | None = None
        # vLLM's /tokenize is outside the OpenAI API: another server may answer a POST there with anything (one
        # that queues every POST as a chat request would wait for a reply), so it is only asked when known.
        self._can_tokenize = tokenize  # and until the server says it has no /tokenize

    async def chat(self, request: ChatRequest) -> Reply:
        """Send one request.

        Raises:
            TransientLLMError: connection error, timeout, HTTP 408, 429 or 5xx (with the server's `Retry-After`),
                or a body that is not a chat completion (not JSON, no choices).
            LLMRequestError: any other HTTP error status (4xx), with the server's message.
        """
        try:
            completion = await self._client().chat.completions.create(
                **request_body(request, self.model, seeds=self.seeds)
            )
        except (openai.APITimeoutError, openai.APIConnectionError) as error:
            raise TransientLLMError(f"{type(error).__name__}: {error} ({self.base_url})") from None
        except openai.APIStatusError as error:
            status = error.status_code
            message = f"HTTP {status} from {self.base_url}: {_server_message(error)}"
            if status >= 500 or status in TRANSIENT_CLIENT_STATUSES:
                wait = retry_after_seconds(error.response.headers.get("retry-after"))
                raise TransientLLMError(message, status_code=status, retry_after_s=wait) from None
            raise LLMRequestError(message, status_code=status) from None
        except json.JSONDecodeError as error:  # a body declared JSON that is not (cut short, or a proxy's page)
            raise TransientLLMError(f"the body from {self.base_url} is not JSON: {error}") from None
        # Without JSON content the SDK returns the body as text; with JSON of another shape, an unchecked object.
        if not isinstance(completion, ChatCompletion):
            text = str(completion)[:200]
            raise TransientLLMError(f"the body from {self.base_url} is not a chat completion: {text!r}")
        if not completion.choices:
            raise TransientLLMError(f"the server at {self.base_url} returned no choices")
        try:
            return reply_from_completion(completion)
        except (AttributeError, TypeError, ValueError) as error:
            raise TransientLLMError(f"the chat completion from {self.base_url} is malformed: {error}") from None

    async def count_prompt_tokens(self, request: ChatRequest) -> int | None:
        """The prompt's size in tokens, rendered by the server's chat template: vLLM's `POST /tokenize` (at the
        server root, next to `/v1`) with the request's messages, tools and chat template kwargs.

        Returns None when the server cannot tell: it has no such endpoint (then it is not asked again), or the
        request failed in any other way (the chat request that follows reports real failures).
        """
        if not self._can_tokenize:
            return None
        try:
            url = f"{server_root(self.base_url)}/tokenize"
            answer = await self._client().post(url, body=tokenize_body(request, self.model), cast_to=object)
        except openai.APIStatusError as error:
            if error.status_code in (404, 405, 501):
                self._can_tokenize = False
            return None
        except openai.APIError:
            return None
        count = answer.get("count") if isinstance(answer, dict) else None
        return count if isinstance(count, int) and count >= 0 else None

    async def healthy(self) -> bool:
        """Whether the server answers `GET …/v1/models` (every OpenAI-compatible server has it; vLLM's `/health`
        is vLLM's own). The pool's probe of a server it took out of rotation."""
        try:
            await self._client().models.list()
        except openai.APIError:
            return False
        return True

    async def aclose(self) -> None:
        """Close the connection pool of the current event loop (optional; it is also dropped with the
        loop)."""
        if self._sdk is not None and self._loop is asyncio.get_running_loop():
            await self._sdk.close()
            self._sdk = None

    def _client(self) -> openai.AsyncOpenAI:
        loop = asyncio.get_running_loop()
        if self._sdk is None or self._loop is not loop:
            http_client = self.http_client_factory() if self.http_client_factory else None
            self._sdk = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                timeout=self.timeout_s,
                max_retries=0,
                http_client=http_client,
            )
            self._loop = loop
        return self._sdk


def server_root(base_url: str) -> str:
    """The server's root URL for vLLM's endpoints outside the OpenAI API (`/tokenize`, `/version`)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def tokenize_body(request: ChatRequest, model: str) -> dict[str, Any]:
    """vLLM's `/tokenize` request for the prompt `request` makes (its `TokenizeChatRequest`)."""
    body: dict[str, Any] = {"model": model, "messages": request.wire_messages(), "add_generation_prompt": True}
    if request.tools:
        body["tools"] = list(request.tools)
    if "chat_template_kwargs" in request.extra:
        body["chat_template_kwargs"] = request.extra["chat_template_kwargs"]
    return body


def request_body(request: ChatRequest, model: str, *, seeds: bool = True) -> dict[str, Any]:
    """The keyword arguments of `chat.completions.create` for `request` (without its sampling seed if not `seeds`)."""
    body: dict[str, Any] = {"model": model, "messages": request.wire_messages()}
    body.update(request.sampling.model_dump(exclude_none=True, exclude=None if seeds else {"seed"}))
    if request.tools:
        body["tools"] = list(request.tools)
    if request.tool_choice is not None:
        choice = request.tool_choice
        named = {"type": "function", "function": {"name": choice}}
        body["tool_choice"] = choice if choice in TOOL_CHOICE_KEYWORDS else named
    if request.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if request.response_format is not None:
        body["response_format"] = request.response_format
    if request.extra:
        body["extra_body"] = dict(request.extra)
    return body


def reply_from_completion(completion: Any) -> Reply:
    """A `Reply` from the SDK's completion object. Reasoning from vLLM's `reasoning` (or older
    `reasoning_content`) field is kept apart; `<think>` blocks are split off later by the client."""
    choice = completion.choices[0]
    message = choice.message
    extra = message.model_extra or {}
    reasoning = extra.get("reasoning") or extra.get("reasoning_content")
    calls = tuple(
        ToolCall(
            id=call.id,
            function=FunctionCall(name=call.function.name, arguments=call.function.arguments or ""),
        )
        for call in (message.tool_calls or ())
        if getattr(call, "function", None) is not None
    )
    usage = completion.usage
    return Reply(
        content=message.content,
        reasoning=reasoning if isinstance(reasoning, str) else None,
        tool_calls=calls,
        finish_reason=choice.finish_reason or "stop",
        usage=TokenUsage(
            prompt_tokens=usage.prompt_tokens if usage else 0,
            completion_tokens=usage.completion_tokens if usage else 0,
        ),
    )


def _server_message(error: openai.APIStatusError) -> str:
    body = error.body
    if isinstance(body, dict):
        detail = body.get("message") or body.get("error") or body
        if isinstance(detail, dict):
            detail = detail.get("message", detail)
        return str(detail)[:500]
    return str(error)[:500]
