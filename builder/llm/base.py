"""The one model interface every stage uses: `ChatRequest` in, `Reply` out, through `ChatModel.chat`, and
`StageModel`, what a stage is given (`chat`, `structured`, `model_id`).

Messages and tool calls reuse the record structs of `builder.records`, so a reply's message can be appended to
a trajectory as is. `CallRecord` is what the client reports to an observer after every call (usage
accounting).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from builder.records import ChatMessage, Sampling, ToolCall
from builder.usage import Usage

# Bump when the meaning of a cached reply changes, so old cache rows are never reused.
CACHE_KEY_VERSION = 1

T = TypeVar("T", bound=BaseModel)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatRequest(_Frozen):
    """One chat-completion request, independent of the backend that serves it.

    `tool_choice` is "auto", "required", "none", or the name of one tool in `tools` to force that tool.
    `sample_index` tells apart repeated samples of the same request (it is part of the cache key, never sent);
    `resampled` gives a request's further samples.
    `extra` holds server-specific body fields (e.g. vLLM's `ignore_eos`, `top_k`, `chat_template_kwargs`), sent
    as is. An assistant message's `reasoning_content` is never sent (see `openai_backend.request_body`).
    `affinity` names what the request belongs to (an environment's id): a pool of servers sends the requests of
    one affinity to one server while it can take them, so that server's prefix cache holds what they share
    (`pool.EndpointPool`). It is never sent and is not part of the cache key: it cannot change the reply.
    """

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    sampling: Sampling = Sampling()
    sample_index: int = Field(0, ge=0)
    extra: dict[str, Any] = Field(default_factory=dict)
    affinity: str | None = None

    def wire_messages(self) -> list[dict[str, Any]]:
        """The messages as a server gets them. Reasoning (`reasoning_content`) stays out: Qwen3's template drops
        earlier turns' reasoning itself, and a template that does not know the field could render it as text."""
        exclude = {"reasoning_content"}
        return [message.model_dump(mode="json", exclude_none=True, exclude=exclude) for message in self.messages]

    def resampled(self, offset: int, messages: Sequence[ChatMessage] | None = None) -> ChatRequest:
        """This request's sample number `offset` after its own (0: the request itself), with `messages` instead
        of its own if given (a re-ask's conversation): `sample_index` and, when the sampling has a seed, the seed
        moved on by `offset`.

        Both, because a re-ask must be a fresh sample even when its messages repeat: the same sample index would
        be answered from the response cache, and the same seed by a seeded server, with the very reply refused.
        """
        seed = self.sampling.seed
        sampling = self.sampling if seed is None else self.sampling.model_copy(update={"seed": seed + offset})
        update: dict[str, Any] = {"sample_index": self.sample_index + offset, "sampling": sampling}
        if messages is not None:
            update["messages"] = tuple(messages)
        return self.model_copy(update=update)

    def cache_key(self, model_id: str) -> str:
        """sha256 over the model identity and everything in the request that can change the reply."""
        request = self.model_dump(mode="json", exclude={"affinity"})
        content = {"v": CACHE_KEY_VERSION, "model": model_id, "request": request}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()


class TokenUsage(_Frozen):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Reply(_Frozen):
    """What a model answered.

    `content` never contains reasoning: `<think>…</think>` blocks and a server's separate reasoning field end
    up in `reasoning`. `finish_reason` is the server's ("stop", "length", "tool_calls", …). `usage` is the
    reply's own size as the server counted it (also for a reply from the cache: what the conversation holds);
    `cost` is what getting it took in this run by the ledger rule of `usage.Usage`, set by `LLMClient`
    (every request of the call, cut replies asked again included; a cache hit is `cached_calls=1`).
    """

    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    usage: TokenUsage = TokenUsage()
    cost: Usage = Usage()

    def message(self) -> ChatMessage:
        """The assistant message to append to the conversation, reasoning kept as `reasoning_content` for the
        record (trajectories keep what the model thought); backends never send it back to the server."""
        return ChatMessage(
            role="assistant", content=self.content, tool_calls=self.tool_calls or None, reasoning_content=self.reasoning
        )


class CallRecord(_Frozen):
    """One request of a client call (a grown re-ask of a cut reply is another), reported to `on_call`.

    Tokens are the reply's usage even when `cached` is true (then nothing was spent in this run); a failed
    request (`ok` false) has zero tokens and the error message. `usage` is its entry in the ledger.
    """

    model: str
    key: str = Field(description="The request's cache key.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = Field(0.0, description="Wall time of the call including retries; ~0 for a cache hit.")
    cached: bool = False
    ok: bool = True
    attempts: int = Field(0, description="Requests sent to the backend (0 for a cache hit).")
    retries: int = Field(0, description="Of the attempts, those after transient failures (attempts - 1, or 0).")
    finish_reason: str | None = None
    error: str | None = None
    regrowth: int = Field(
        0, description="How often the request's completion budget had been grown after cut replies (0: as asked)."
    )

    @property
    def usage(self) -> Usage:
        """This request in the ledger, by the rule of `usage.Usage`: a cache hit counts as nothing but a cached
        call, a failure spends no tokens."""
        if self.cached:
            return Usage(cached_calls=1)
        regrowths = int(self.regrowth > 0)
        if not self.ok:
            return Usage(failed_calls=1, regrowths=regrowths, retries=self.retries)
        return Usage(
            calls=1,
            regrowths=regrowths,
            retries=self.retries,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )


class ServerCall(_Frozen):
    """One attempt of a request on one server of a pool (`pool.EndpointPool`), reported to its `on_server_call`.

    Per-server figures, apart from the ledger: a request that failed on one server and was answered by another
    is one call in `CallRecord` and two attempts here.
    """

    url: str
    ok: bool = True
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = Field(0.0, description="Wall time of the attempt, from the slot taken to the reply.")
    prompt_chars: int = Field(0, description="Characters of the prompt the server answered (0: failed).")
    prefix_chars: int = Field(
        0, description="Of them, the start an earlier answered request to this server began with (`llm.prefix`)."
    )


# `ChatRequest.tool_choice` values that are not tool names.
TOOL_CHOICE_KEYWORDS = ("auto", "required", "none")


class ChatModel(Protocol):
    """Anything that answers a chat request: the OpenAI-compatible backend, the scripted model, the client.

    A backend may also offer `async count_prompt_tokens(request) -> int | None`: the prompt's size in tokens as
    the server renders it, or None when it cannot tell. `LLMClient` uses it to fit completion budgets into the
    context and estimates conservatively without it.
    """

    async def chat(self, request: ChatRequest) -> Reply:
        """Answer one request.

        Raises:
            TransientLLMError: a retryable failure (connection, timeout, 5xx).
            LLMRequestError: a failure retrying cannot fix (4xx).
        """
        ...


@runtime_checkable
class StageModel(ChatModel, Protocol):
    """What a stage calls (`StageContext.llm`, `.rl_agent`): a `ChatModel` with an identity and structured output.
    `LLMClient` is one, and so is the pipeline's `LazyModel`, which starts one on its first call; tests give
    stages an `LLMClient` around a `ScriptedModel` (`client_for`)."""

    model_id: str  # the served model's name, recorded in provenance and part of every cache key

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
        """A validated `output_type`, re-asked on invalid output (see `LLMClient.structured`)."""
        ...
