"""A deterministic model for tests: replies chosen by a function of the request, malformed ones included.

    def answer(request: ChatRequest) -> Reply | str | Exception:
        if request.response_format:
            return '{"name": "x"}'          # a string becomes the reply's content
        return tool_reply(("get", "{not json"))  # malformed arguments, to test the error path

    model = ScriptedModel(answer)
    client = LLMClient(model, model_id="scripted")

Returning an exception raises it, so transport failures (`TransientLLMError`) and rejections
(`LLMRequestError`) can be scripted too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from builder.llm.base import ChatRequest, Reply, TokenUsage
from builder.records import FunctionCall, ToolCall

Script = Callable[[ChatRequest], "Reply | str | BaseException"]


class ScriptedModel:
    """A `ChatModel` whose reply to each request is `script(request)`.

    `prompt_tokens(request)`, when given, is what the model answers to `count_prompt_tokens` (the server's
    tokenizer); without it the client estimates prompt sizes itself.

    Attributes:
        requests: Every request received, in order, for assertions.
        counted: Every request whose prompt was counted, in order.
    """

    def __init__(self, script: Script, *, prompt_tokens: Callable[[ChatRequest], int | None] | None = None) -> None:
        self.script = script
        self.prompt_tokens = prompt_tokens
        self.requests: list[ChatRequest] = []
        self.counted: list[ChatRequest] = []

    @classmethod
    def sequence(
        cls,
        replies: Iterable[Reply | str | BaseException],
        *,
        prompt_tokens: Callable[[ChatRequest], int | None] | None = None,
    ) -> ScriptedModel:
        """A model that gives `replies` in order, one per request; running out is an `AssertionError`."""
        queue = list(replies)

        def next_reply(request: ChatRequest) -> Reply | str | BaseException:
            if not queue:
                raise AssertionError(f"scripted model ran out of replies at request {request.messages[-1]!r}")
            return queue.pop(0)

        return cls(next_reply, prompt_tokens=prompt_tokens)

    async def count_prompt_tokens(self, request: ChatRequest) -> int | None:
        if self.prompt_tokens is None:
            return None
        self.counted.append(request)
        return self.prompt_tokens(request)

    async def chat(self, request: ChatRequest) -> Reply:
        self.requests.append(request)
        answer = self.script(request)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, str):
            answer = text_reply(answer)
        if answer.usage == TokenUsage():
            answer = answer.model_copy(update={"usage": _estimate_usage(request, answer)})
        return answer


def text_reply(content: str, *, finish_reason: str = "stop", reasoning: str | None = None) -> Reply:
    """A plain text reply."""
    return Reply(content=content, reasoning=reasoning, finish_reason=finish_reason)


def tool_reply(*calls: tuple[str, str | dict], content: str | None = None) -> Reply:
    """A reply calling tools: each call is (name, arguments) with arguments as raw text (may be malformed) or
    a dict."""
    tool_calls = tuple(
        ToolCall(
            id=f"call_{index}",
            function=FunctionCall(name=name, arguments=args if isinstance(args, str) else json.dumps(args)),
        )
        for index, (name, args) in enumerate(calls)
    )
    return Reply(content=content, tool_calls=tool_calls, finish_reason="tool_calls")


def _estimate_usage(request: ChatRequest, reply: Reply) -> TokenUsage:
    """Rough token counts (4 characters a token), so accounting tests see non-zero numbers."""
    prompt = sum(len(message.content or "") for message in request.messages)
    completion = len(reply.content or "") + sum(len(call.function.arguments) for call in reply.tool_calls)
    return TokenUsage(prompt_tokens=max(1, prompt // 4), completion_tokens=max(1, completion // 4))
