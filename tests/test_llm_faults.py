"""Transient failures over real HTTP (tests/faulty_llm.py): 429 bursts, Retry-After, non-JSON bodies, drops and
timeouts are retried within llm.max_retries and llm.retry_budget_s, counted, and named when they win."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from faulty_llm import CONTENT, TRANSIENT, Faults, FaultyServer, scripted
from llm_stub import completion
from pydantic import BaseModel

from builder.config import LLMConfig, config_hash, load_config
from builder.llm import (
    CallRecord,
    ChatRequest,
    LLMClient,
    LLMRequestError,
    OpenAIChatModel,
    ScriptedModel,
    TransientLLMError,
    check_tool_calls,
    function_tool,
    open_llm,
)
from builder.llm.retry import retry_after_seconds
from builder.records import ChatMessage
from builder.stats import StageStats


def ask(index: int = 0) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage(role="user", content=f"question {index}"),))


class FakeTime:
    """An injected clock and sleep: every wait is recorded and moves the clock, nothing really waits."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def client_for(server: FaultyServer, time: FakeTime, **options: object) -> tuple[LLMClient, list[CallRecord]]:
    records: list[CallRecord] = []
    options.setdefault("rng", lambda: 0.5)
    client = LLMClient(
        OpenAIChatModel(server.url, "local", timeout_s=options.pop("timeout_s", 30.0)),  # type: ignore[arg-type]
        model_id="m",
        on_call=records.append,
        sleep=time.sleep,
        clock=time.clock,
        **options,  # type: ignore[arg-type]
    )
    return client, records


async def test_a_429_burst_then_success_is_kept_and_each_wait_honors_retry_after() -> None:
    time = FakeTime()
    faults = Faults(first=("status_429",) * 3, retry_after="7")
    with FaultyServer(scripted("fine"), faults) as server:
        client, records = client_for(server, time, max_retries=4)
        reply = await client.chat(ask())
    assert reply.content == "fine"
    assert time.sleeps == [7.0, 7.0, 7.0]  # Retry-After is longer than the backoff (0.375, 0.75, 1.5 s)
    assert records[-1].attempts == 4 and records[-1].retries == 3 and records[-1].ok
    assert reply.cost.retries == 3 and reply.cost.calls == 1 and client.totals.failed_calls == 0


async def test_a_short_retry_after_does_not_shorten_the_backoff() -> None:
    time = FakeTime()
    with FaultyServer(scripted("fine"), Faults(first=("status_429",) * 2, retry_after="0")) as server:
        client, _ = client_for(server, time, backoff_base_s=2.0)
        assert (await client.chat(ask())).content == "fine"
    assert time.sleeps == [1.5, 3.0]  # rng 0.5: three quarters of 2 s, then of 4 s


async def test_retry_after_as_an_http_date_is_honored() -> None:
    when = format_datetime(datetime.now(UTC) + timedelta(seconds=40), usegmt=True)
    time = FakeTime()
    with FaultyServer(scripted("fine"), Faults(first=("status_429",), retry_after=when)) as server:
        client, _ = client_for(server, time)
        assert (await client.chat(ask())).content == "fine"
    assert len(time.sleeps) == 1 and 35.0 < time.sleeps[0] <= 40.0


def test_retry_after_values() -> None:
    now = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_seconds("120") == 120.0 and retry_after_seconds(" 1.5 ") == 1.5
    assert retry_after_seconds("Thu, 01 Jan 2026 12:00:30 GMT", now=now) == 30.0
    assert retry_after_seconds("Thu, 01 Jan 2026 11:00:00 GMT", now=now) == 0.0  # already past: no extra wait
    assert retry_after_seconds("-5") == 0.0
    for unreadable in (None, "", "soon", "nan", "inf"):
        assert retry_after_seconds(unreadable) is None


async def test_a_retry_after_beyond_the_budget_fails_at_once_naming_the_status() -> None:
    time = FakeTime()
    with FaultyServer(scripted("fine"), Faults(first=("status_429",), retry_after="3600")) as server:
        client, records = client_for(server, time, retry_budget_s=900.0)
        with pytest.raises(LLMRequestError, match=r"after 1 attempts .*llm.retry_budget_s.*HTTP 429") as caught:
            await client.chat(ask())
    assert caught.value.status_code == 429 and caught.value.retryable
    assert time.sleeps == [] and len(server.requests) == 1
    assert records[-1].usage.failed_calls == 1 and records[-1].retries == 0


async def test_the_budget_bounds_the_waits() -> None:
    time = FakeTime()
    with FaultyServer(scripted("never"), Faults(rate=1.0, kinds=("status_500",))) as server:
        client, _ = client_for(server, time, max_retries=10, retry_budget_s=5.0, backoff_base_s=1.0)
        with pytest.raises(LLMRequestError, match="HTTP 500"):
            await client.chat(ask())
    assert time.sleeps == [0.75, 1.5] and len(server.requests) == 3  # a third wait (3 s) would end past 5 s


async def test_the_budget_counts_the_time_of_the_tries_too() -> None:
    time = FakeTime()

    def slow_failure(request: ChatRequest) -> TransientLLMError:
        time.now += 100.0  # each try takes 100 s on the injected clock before it fails
        return TransientLLMError("HTTP 502 from gateway", status_code=502)

    client = LLMClient(ScriptedModel(slow_failure), model_id="m", sleep=time.sleep, clock=time.clock, rng=lambda: 0.5)
    client.retry = dataclasses.replace(client.retry, max_retries=10, budget_s=250.0)
    with pytest.raises(LLMRequestError, match="after 3 attempts .*HTTP 502") as caught:
        await client.chat(ask())
    assert caught.value.status_code == 502 and len(time.sleeps) == 2


async def test_after_max_retries_the_error_names_the_status_and_the_retries_are_counted() -> None:
    time = FakeTime()
    with FaultyServer(scripted("never"), Faults(rate=1.0, kinds=("status_503",))) as server:
        client, records = client_for(server, time, max_retries=2)
        with pytest.raises(LLMRequestError, match=r"failed after 3 attempts: HTTP 503 .*injected status_503") as caught:
            await client.chat(ask())
    assert caught.value.status_code == 503 and caught.value.attempts == 3
    assert (records[-1].ok, records[-1].attempts, records[-1].retries) == (False, 3, 2)
    assert caught.value.cost.failed_calls == 1 and caught.value.cost.retries == 2
    stats = StageStats(stage="mine")
    stats.add_call(records[-1])
    assert stats.to_json()["usage"]["retries"] == 2  # what stats.json shows


@pytest.mark.parametrize("fault", ["non_json", "drop", "status_502", "slow"])
async def test_each_transient_fault_is_retried(fault: str) -> None:
    time = FakeTime()
    with FaultyServer(scripted('{"value": 1}'), Faults(first=(fault, fault), slow_s=3.0)) as server:
        client, records = client_for(server, time, request_timeout_s=1.0)
        reply = await client.chat(ask())
    assert reply.content == '{"value": 1}' and records[-1].retries == 2
    assert server.injected[fault] == 2 and len(server.requests) == 3


async def test_a_non_json_body_is_transient_at_the_backend() -> None:
    with FaultyServer(scripted("ok"), Faults(first=("non_json", "non_json"))) as server:
        model = OpenAIChatModel(server.url, "local")
        with pytest.raises(TransientLLMError, match="not a chat completion.*Bad Gateway"):
            await model.chat(ask())  # a proxy's HTML page
        with pytest.raises(TransientLLMError, match="is not JSON"):
            await model.chat(ask())  # the JSON body cut short
        assert (await model.chat(ask())).content == "ok"


async def test_at_20_percent_transient_faults_every_reply_gets_through() -> None:
    """The client against the fault-injecting endpoint: with llm.max_retries = 4 nothing is lost."""
    time = FakeTime()

    def numbered(body: dict) -> dict:
        return completion(f"answer to {body['messages'][-1]['content']}")

    faults = Faults(rate=0.2, kinds=TRANSIENT, seed=3, retry_after="2", slow_s=4.0)
    with FaultyServer(numbered, faults) as server:
        client, records = client_for(server, time, max_retries=4, request_timeout_s=2.0, max_concurrency=16)
        replies = await asyncio.gather(*(client.chat(ask(index)) for index in range(80)))
    assert [reply.content for reply in replies] == [f"answer to question {index}" for index in range(80)]
    injected = sum(server.injected.values())
    assert 8 <= injected <= 30 and len(server.injected) >= 5, server.injected  # ~20% of ~100 sends, most kinds
    assert client.totals.calls == 80 and client.totals.failed_calls == 0
    # Every fault cost one retry; a loaded machine may time out a good answer too, which is retried as well.
    assert client.totals.retries == sum(record.retries for record in records) >= injected


def test_open_llm_retries_a_rate_limited_server(tmp_path) -> None:
    """The production path (a pool of one over llm.url): a 429 keeps its status through the pool."""
    with FaultyServer(scripted("pooled"), Faults(first=("status_429", "status_429"), retry_after="0")) as server:
        config = LLMConfig(url=server.url, max_retries=1, cache=False)
        with open_llm(config, tmp_path) as client:
            with pytest.raises(LLMRequestError, match="after 2 attempts: no server of 1 answered: HTTP 429") as caught:
                asyncio.run(client.chat(ask()))
            assert caught.value.status_code == 429
            assert asyncio.run(client.chat(ask())).content == "pooled"


def test_the_retry_budget_is_operational() -> None:
    base = load_config(None, [], "none")
    assert config_hash(load_config(None, ["llm.retry_budget_s=30"], "none")) == config_hash(base)


class Item(BaseModel):
    name: str


async def test_reply_faults_are_asked_again_or_flagged_never_raised() -> None:
    """Empty, cut, off-schema and surrogate replies: structured output re-asks the unusable ones (the surrogate
    one is cleaned and kept); a bad tool call comes back for `check_tool_calls` to refuse."""
    time = FakeTime()

    def items(body: dict) -> dict:
        if body.get("tools"):
            call = {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k"}'}}
            return completion(None, tool_calls=[call], finish_reason="tool_calls")
        return completion(json.dumps({"name": body["messages"][0]["content"]}))

    faults = Faults(rate=0.3, kinds=CONTENT, seed=5)
    with FaultyServer(items, faults) as server:
        client, _ = client_for(server, time, structured_retries=4)
        got = await asyncio.gather(*(client.structured(ask(index).messages, Item) for index in range(40)))
    tools = (function_tool("lookup", "Look up", {"type": "object", "properties": {"key": {"type": "string"}}}),)
    with FaultyServer(items, Faults(rate=0.5, kinds=("bad_tool_call", "surrogate"), seed=5)) as tool_server:
        client, _ = client_for(tool_server, time)
        replies = [await client.chat(ask(index).model_copy(update={"tools": tools})) for index in range(20)]
    assert [item.name.replace("\ufffd", "") for item in got] == [f"question {index}" for index in range(40)]
    assert all(json.loads(item.model_dump_json()) for item in got)
    verdicts = [parsed for reply in replies for parsed in check_tool_calls(reply.tool_calls, tools)]
    assert any(not parsed.ok and "unknown tool 'no_such_tool'" in parsed.error for parsed in verdicts)
    assert any(parsed.ok and parsed.arguments == {"key": "k"} for parsed in verdicts)
    assert all(parsed.arguments in (None, {"key": "k"}, {"key": "k\ufffd"}) for parsed in verdicts)
    assert {"empty", "cut", "off_schema", "surrogate"} <= set(server.injected)
    assert set(tool_server.injected) == {"bad_tool_call", "surrogate"}
