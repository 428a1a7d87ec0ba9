"""Replies carrying a lone surrogate ("\\ud800", which a JSON grammar allows) or a NUL reach no record unclean: in
plain content, structured output and tool-call arguments, over real HTTP (tests/faulty_llm.py)."""

from __future__ import annotations

import json
from pathlib import Path

from faulty_llm import Faults, FaultyServer, scripted
from llm_stub import completion
from pydantic import BaseModel

from builder.llm import ChatRequest, LLMClient, OpenAIChatModel, ResponseCache, check_tool_calls, function_tool
from builder.llm.sanitize import clean_json_text, clean_reply, clean_text, clean_value
from builder.records import ChatMessage, FunctionCall, ToolCall

USER = (ChatMessage(role="user", content="go"),)
SURROGATE = Faults(first=("surrogate",))
LOOKUP = function_tool(
    "lookup", "Look up a key", {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
)


class Named(BaseModel):
    name: str
    tags: list[str]


def client(server: FaultyServer, cache: ResponseCache | None = None) -> LLMClient:
    return LLMClient(OpenAIChatModel(server.url, "local"), model_id="m", cache=cache)


async def test_plain_content_is_cleaned_before_the_cache_and_the_record(tmp_path: Path) -> None:
    with FaultyServer(scripted("hello world"), SURROGATE) as server, ResponseCache(tmp_path / "c.sqlite") as cache:
        reply = await client(server, cache).chat(ChatRequest(messages=USER))
        again = await client(server, cache).chat(ChatRequest(messages=USER))  # from the cache, stored cleaned
    assert reply.content == "hello\ufffd world" and again.content == reply.content and len(server.requests) == 1
    assert json.loads(reply.message().model_dump_json())["content"] == "hello\ufffd world"


async def test_structured_output_with_surrogate_and_nul_escapes_validates_and_serializes() -> None:
    body = json.dumps({"name": "alpha", "tags": ["one", "two"]})
    with FaultyServer(scripted(body), SURROGATE) as server:
        named = await client(server).structured(USER, Named)
        sent = len(server.requests)
    # pydantic alone refuses "\ud800" as invalid JSON (a wasted re-ask) and keeps "\u0000": neither happens.
    assert named == Named(name="a\ufffdlpha", tags=["one", "two"]) and sent == 1
    assert json.loads(named.model_dump_json())["name"] == "a\ufffdlpha"


async def test_tool_call_arguments_are_cleaned_and_still_valid() -> None:
    call = {"id": "call_0", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "alpha"}'}}
    answer = completion(None, tool_calls=[call], finish_reason="tool_calls")
    with FaultyServer(lambda body: answer, SURROGATE) as server:
        reply = await client(server).chat(ChatRequest(messages=USER, tools=(LOOKUP,)))
    (parsed,) = check_tool_calls(reply.tool_calls, [LOOKUP])
    assert parsed.ok and parsed.arguments == {"key": "a\ufffdlpha"}
    assert json.loads(reply.message().model_dump_json())["tool_calls"][0]["function"]["name"] == "lookup"
    assert "\\u0000" not in reply.tool_calls[0].function.arguments


def test_clean_text_and_values() -> None:
    assert clean_text("a\ud800b\x00c\udfffd") == "a\ufffdbc\ufffdd"
    assert clean_text("plain ascii") == "plain ascii" and clean_text("emoji \U0001f600") == "emoji \U0001f600"
    assert clean_value({"k\x00": ["\ud800", 1, None, {"x": "y\x00"}]}) == {"k": ["\ufffd", 1, None, {"x": "y"}]}


def test_clean_json_text_keeps_clean_json_byte_for_byte() -> None:
    for kept in ('{"a":  "\\ud83d\\ude00"}', '{"path": "C:\\\\ud800"}', '{"x": 1}', "not json \\ud800"):
        assert clean_json_text(kept) == kept  # a valid pair, an escaped backslash, nothing, not JSON
    assert json.loads(clean_json_text('{"a": "x\\ud800y\\u0000z"}')) == {"a": "x\ufffdyz"}
    assert clean_json_text('{"a": "\ud800"}') == '{"a": "\ufffd"}'  # a raw lone surrogate in the text


def test_clean_reply_touches_only_what_is_bad() -> None:
    from builder.llm import Reply

    good = Reply(content="fine", tool_calls=(ToolCall(id="1", function=FunctionCall(name="f", arguments="{}")),))
    assert clean_reply(good) is good
    bad = Reply(content="a\x00", reasoning="r\ud800", tool_calls=(ToolCall(id="1\x00", function=FunctionCall(
        name="f", arguments='{"k": "\\u0000v"}')),))  # fmt: skip
    cleaned = clean_reply(bad)
    assert (cleaned.content, cleaned.reasoning, cleaned.tool_calls[0].id) == ("a", "r\ufffd", "1")
    assert json.loads(cleaned.tool_calls[0].function.arguments) == {"k": "v"}
    cleaned.model_dump_json()
