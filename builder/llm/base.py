"""The one model interface every stage uses: `ChatRequest` in, `Reply` out, through `ChatModel.chat`.

Messages and tool calls reuse the record structs of `builder.records`, so a reply's message can be appended to
a trajectory as is. `CallRecord` is what the client reports to an observer after every call (usage
accounting).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from builder.records import ChatMessage, Sampling, ToolCall

# Bump when the meaning of a cached reply changes, so old cache rows are never reused.
CACHE_KEY_VERSION = 1


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ChatRequest(_Frozen):
    """One chat-completion request, independent of the backend that serves it.

    `tool_choice` is "auto", "required", "none", or the name of one tool in `tools` to force that tool.
    `sample_index` tells apart repeated samples of the same request (it is part of the cache key, never sent).
    `extra` holds server-specific body fields (e.g. vLLM's `ignore_eos`, `top_k`), sent as is.
    """

    messages: tuple[ChatMessage, ...]
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    sampling: Sampling = Sampling()
    sample_index: int = Field(0, ge=0)
    extra: dict[str, Any] = Field(default_factory=dict)

    def cache_key(self, model_id: str) -> str:
        """sha256 over the model identity and everything in the request that can change the reply."""
        content = {"v": CACHE_KEY_VERSION, "model": model_id, "request": self.model_dump(mode="json")}
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()


class TokenUsage(_Frozen):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Reply(_Frozen):
    """What a model answered.

    `content` never contains reasoning: `<think>…</think>` blocks and a server's separate reasoning field end
    up in `reasoning`. `finish_reason` is the server's ("stop", "length", "tool_calls", …).
    """

    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = "stop"
    usage: TokenUsage = TokenUsage()

    def message(self) -> ChatMessage:
        """The assistant message to append to the conversation (reasoning left out, as chat templates
        expect)."""
        return ChatMessage(role="assistant", content=self.content, tool_calls=self.tool_calls or None)


class CallRecord(_Frozen):
    """One client call, reported to the `on_call` observer.

    Tokens are the reply's usage even when `cached` is true (then nothing was spent in this run); a failed
    call (`ok` false) has zero tokens and the error message.
    """

    model: str
    key: str = Field(description="The request's cache key.")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = Field(0.0, description="Wall time of the call including retries; ~0 for a cache hit.")
    cached: bool = False
    ok: bool = True
    attempts: int = Field(0, description="Requests sent to the backend (0 for a cache hit).")
    finish_reason: str | None = None
    error: str | None = None


# `ChatRequest.tool_choice` values that are not tool names.
TOOL_CHOICE_KEYWORDS = ("auto", "required", "none")


class ChatModel(Protocol):
    """Anything that answers a chat request: the OpenAI-compatible backend, the scripted model, the client."""

    async def chat(self, request: ChatRequest) -> Reply:
        """Answer one request.

        Raises:
            TransientLLMError: a retryable failure (connection, timeout, 5xx).
            LLMRequestError: a failure retrying cannot fix (4xx).
        """
        ...
