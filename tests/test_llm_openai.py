"""The OpenAI-compatible backend over real HTTP against a stub server: request body, reply mapping, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from llm_stub import StubServer, completion
from pydantic import BaseModel

from builder.config import LLMConfig
from builder.llm import ChatRequest, LLMClient, LLMRequestError, OpenAIChatModel, TransientLLMError, open_llm
from builder.llm.openai_backend import request_body
from builder.llm.server import free_port
from builder.records import ChatMessage, FunctionCall, Sampling, ToolCall

USER = (ChatMessage(role="user", content="hi"),)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}


class Answer(BaseModel):
    value: int


async def test_request_body_carries_everything() -> None:
    history = (
        *USER,
        ChatMessage(role="assistant", tool_calls=(ToolCall(id="1", function=FunctionCall(name="f", arguments="{}")),)),
        ChatMessage(role="tool", tool_call_id="1", content="42"),
    )
    with StubServer(lambda body: (200, completion("ok"))) as stub:
        model = OpenAIChatModel(stub.url, "local")
        request = ChatRequest(
            messages=history,
            tools=(TOOL,),
            tool_choice="f",
            parallel_tool_calls=True,
            sampling=Sampling(temperature=0.0, max_tokens=7, seed=3),
            extra={"ignore_eos": True},
            sample_index=5,
        )
        await model.chat(request)
    body = stub.requests[0]
    assert body["model"] == "local" and body["temperature"] == 0.0 and body["max_tokens"] == 7 and body["seed"] == 3
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["tools"] == [TOOL] and body["parallel_tool_calls"] is True and body["ignore_eos"] is True
    assert body["messages"][1]["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert body["messages"][2] == {"role": "tool", "content": "42", "tool_call_id": "1"}
    assert "sample_index" not in body and "guided_json" not in body and "top_p" not in body


async def test_reply_maps_tool_calls_reasoning_and_usage() -> None:
    calls = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}},
    ]
    body = completion("", tool_calls=calls, finish_reason="tool_calls", reasoning="thought", completion_tokens=9)
    with StubServer(lambda request: (200, body)) as stub:
        reply = await OpenAIChatModel(stub.url, "local").chat(ChatRequest(messages=USER, tools=(TOOL,)))
    assert [call.function.arguments for call in reply.tool_calls] == ['{"x": 1}', '{"x": 2}']
    assert reply.finish_reason == "tool_calls" and reply.reasoning == "thought"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (11, 9)


@pytest.mark.parametrize("status", [429, 500, 502, 503, 504])
async def test_429_and_5xx_are_transient(status: int) -> None:
    with StubServer(lambda body: (status, {"error": {"message": "engine dead"}})) as stub:
        with pytest.raises(TransientLLMError, match=f"HTTP {status}.*engine dead"):
            await OpenAIChatModel(stub.url, "local").chat(ChatRequest(messages=USER))


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_4xx_is_final(status: int) -> None:
    with StubServer(lambda body: (status, {"error": {"message": "bad request"}})) as stub:
        with pytest.raises(LLMRequestError, match="bad request") as caught:
            await OpenAIChatModel(stub.url, "local").chat(ChatRequest(messages=USER))
    assert caught.value.status_code == status


async def test_connection_refused_is_transient() -> None:
    model = OpenAIChatModel(f"http://127.0.0.1:{free_port()}/v1", "local")
    with pytest.raises(TransientLLMError, match="APIConnectionError"):
        await model.chat(ChatRequest(messages=USER))


async def test_transport_timeout_is_transient() -> None:
    with StubServer(lambda body: (200, completion("late")), delay_s=1.0) as stub:
        with pytest.raises(TransientLLMError, match="Timeout"):
            await OpenAIChatModel(stub.url, "local", timeout_s=0.2).chat(ChatRequest(messages=USER))


async def test_client_retries_5xx_over_http_then_succeeds() -> None:
    statuses = iter([503, 200])

    def respond(body: dict) -> tuple[int, dict]:
        status = next(statuses)
        return status, completion('{"value": 4}') if status == 200 else {"error": "busy"}

    async def no_sleep(seconds: float) -> None:
        pass

    with StubServer(respond) as stub:
        client = LLMClient(OpenAIChatModel(stub.url, "local"), model_id="m", sleep=no_sleep)
        assert await client.structured(USER, Answer) == Answer(value=4)
    assert len(stub.requests) == 2
    assert stub.requests[0]["response_format"]["json_schema"]["strict"] is True


def test_open_llm_with_url_uses_cache_in_run_folder(tmp_path: Path) -> None:
    import asyncio

    config = LLMConfig(url="", served_model_name="served")
    with StubServer(lambda body: (200, completion("cached answer"))) as stub:
        config = config.model_copy(update={"url": stub.url})
        for _ in range(2):
            with open_llm(config, tmp_path) as client:
                reply = asyncio.run(client.chat(ChatRequest(messages=USER)))
                assert reply.content == "cached answer"
    assert len(stub.requests) == 1 and stub.requests[0]["model"] == "served"
    assert (tmp_path / "llm_cache.sqlite").is_file() and not (tmp_path / "llm_server.log").exists()


def test_request_body_without_seeds_drops_only_the_seed():
    request = ChatRequest(messages=USER, sampling=Sampling(temperature=0.5, max_tokens=9, seed=3))
    assert request_body(request, "m")["seed"] == 3
    body = request_body(request, "m", seeds=False)
    assert "seed" not in body and body["temperature"] == 0.5 and body["max_tokens"] == 9
