"""LLMClient logic with the scripted model: structured retries, tools, reasoning, cache, backoff,
accounting."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import BaseModel

from builder.llm import (
    CallRecord,
    ChatRequest,
    LLMClient,
    LLMRequestError,
    Reply,
    ResponseCache,
    ScriptedModel,
    StructuredOutputError,
    TransientLLMError,
    check_tool_calls,
    estimate_gpu_hours,
    function_tool,
    text_reply,
    tool_reply,
)
from builder.llm.retry import backoff_delay
from builder.records import ChatMessage, Sampling
from builder.usage import Usage


class Verdict(BaseModel):
    keep: bool
    score: float


USER = (ChatMessage(role="user", content="judge this"),)
LOOKUP = function_tool(
    "lookup",
    "Look up a key",
    {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
)


def make_client(model: ScriptedModel, **kwargs: object) -> tuple[LLMClient, list[CallRecord], list[float]]:
    records: list[CallRecord] = []
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    kwargs.setdefault("sleep", fake_sleep)
    client = LLMClient(model, model_id="scripted", on_call=records.append, rng=lambda: 0.5, **kwargs)
    return client, records, sleeps


async def test_chat_returns_reply_and_reports_usage() -> None:
    client, records, _ = make_client(ScriptedModel(lambda request: "hello there"))
    reply = await client.chat(ChatRequest(messages=USER))
    assert reply.content == "hello there" and reply.finish_reason == "stop"
    assert len(records) == 1
    record = records[0]
    assert record.ok and not record.cached and record.attempts == 1
    assert record.prompt_tokens > 0 and record.completion_tokens > 0 and record.latency_s >= 0
    assert client.totals.calls == 1


async def test_sampling_defaults_fill_only_missing_fields() -> None:
    model = ScriptedModel(lambda request: "ok")
    client, _, _ = make_client(model, default_sampling=Sampling(temperature=0.7, max_tokens=100))
    await client.chat(ChatRequest(messages=USER, sampling=Sampling(temperature=0.0)))
    assert model.requests[0].sampling == Sampling(temperature=0.0, max_tokens=100)


async def test_reasoning_is_kept_out_of_content() -> None:
    client, _, _ = make_client(ScriptedModel(lambda request: "<think>let me see</think>The answer."))
    reply = await client.chat(ChatRequest(messages=USER))
    assert reply.content == "The answer." and reply.reasoning == "let me see"
    # The trajectory keeps what the model thought; backends never send it back (test_llm_openai).
    assert reply.message() == ChatMessage(role="assistant", content="The answer.", reasoning_content="let me see")


async def test_structured_returns_validated_object_and_sends_strict_schema() -> None:
    model = ScriptedModel(lambda request: '{"keep": true, "score": 0.9}')
    client, _, _ = make_client(model)
    verdict = await client.structured(USER, Verdict)
    assert verdict == Verdict(keep=True, score=0.9)
    fmt = model.requests[0].response_format
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["schema"]["required"] == ["keep", "score"]


async def test_structured_feeds_validation_error_back_then_succeeds() -> None:
    model = ScriptedModel.sequence(['{"keep": "maybe"}', '{"keep": false, "score": 0.1}'])
    client, records, _ = make_client(model)
    verdict = await client.structured(USER, Verdict)
    assert verdict.keep is False
    retry = model.requests[1].messages
    assert retry[-2] == ChatMessage(role="assistant", content='{"keep": "maybe"}')
    assert retry[-1].role == "user" and "keep: Input should be a valid boolean" in retry[-1].content
    assert len(records) == 2


async def test_structured_failure_is_typed_and_carries_raw_text() -> None:
    model = ScriptedModel(lambda request: "I think it is good")
    client, _, _ = make_client(model, structured_retries=2)
    with pytest.raises(StructuredOutputError) as caught:
        await client.structured(USER, Verdict)
    error = caught.value
    assert error.raw_text == "I think it is good" and error.attempts == 3 and len(error.errors) == 3
    assert len(model.requests) == 3


async def test_structured_reasks_show_only_the_latest_failed_reply() -> None:
    model = ScriptedModel.sequence(['{"keep": 1}', '{"keep": 2}', '{"keep": 3}', '{"keep": true, "score": 1}'])
    client, _, _ = make_client(model, structured_retries=3)
    await client.structured(USER, Verdict)
    last = model.requests[3].messages
    assert len(last) == len(USER) + 2  # the prompt, the third reply and its error: not every earlier attempt
    assert last[-2].content == '{"keep": 3}'
    assert all(m.content not in ('{"keep": 1}', '{"keep": 2}') for m in last)


async def test_a_repeated_bad_reply_is_asked_again_not_answered_from_the_cache(tmp_path) -> None:
    from builder.llm.cache import ResponseCache

    model = ScriptedModel(lambda request: '{"keep": "maybe"}')  # the same invalid reply every time
    client, _, _ = make_client(model, structured_retries=3, cache=ResponseCache(tmp_path / "cache.sqlite"))
    with pytest.raises(StructuredOutputError):
        await client.structured(USER, Verdict)
    assert len(model.requests) == 4  # each re-ask is a fresh sample, so none is a cache hit of the one before
    assert [r.sample_index for r in model.requests] == [0, 1, 2, 3]


async def test_truncated_structured_reply_says_the_budget_was_used_up_not_to_be_brief() -> None:
    model = ScriptedModel.sequence([text_reply('{"keep": tr', finish_reason="length"), '{"keep": true, "score": 1}'])
    client, _, _ = make_client(model)
    await client.structured(USER, Verdict)
    feedback = model.requests[1].messages[-1].content
    assert "used up its whole token budget" in feedback
    assert "brief" not in feedback and "shorter" not in feedback


async def test_tools_get_strict_and_named_choice_is_checked() -> None:
    loose = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    model = ScriptedModel(lambda request: tool_reply(("lookup", {"key": "a"})))
    client, _, _ = make_client(model)
    reply = await client.chat(ChatRequest(messages=USER, tools=(loose,), tool_choice="lookup"))
    assert model.requests[0].tools[0]["function"]["strict"] is True
    assert reply.finish_reason == "tool_calls" and reply.tool_calls[0].function.name == "lookup"
    with pytest.raises(ValueError, match="tool_choice 'missing'"):
        await client.chat(ChatRequest(messages=USER, tools=(loose,), tool_choice="missing"))


async def test_parallel_tool_calls_with_malformed_arguments_give_clear_errors() -> None:
    reply_with_bad_args = tool_reply(("lookup", {"key": "a"}), ("lookup", '{"key": '), ("lookup", {"k": 1}))
    client, _, _ = make_client(ScriptedModel(lambda request: reply_with_bad_args))
    reply = await client.chat(ChatRequest(messages=USER, tools=(LOOKUP,), tool_choice="required"))
    good, broken, wrong = check_tool_calls(reply.tool_calls, [LOOKUP])
    assert good.arguments == {"key": "a"}
    assert "not valid JSON" in broken.error
    assert "'key' is a required property" in wrong.error


async def test_cache_hit_on_rerun_and_sample_index_separates(tmp_path: Path) -> None:
    model = ScriptedModel(lambda request: f"reply {len(model.requests)}")
    with ResponseCache(tmp_path / "cache.sqlite") as cache:
        client, records, _ = make_client(model, cache=cache)
        first = await client.chat(ChatRequest(messages=USER))
        again = await client.chat(ChatRequest(messages=USER))
        other = await client.chat(ChatRequest(messages=USER, sample_index=1))
        assert first.model_copy(update={"cost": again.cost}) == again and other.content != first.content
        # The hit replays the reply (its usage: what the conversation holds) but costs nothing in this run.
        assert first.cost == Usage(calls=1, prompt_tokens=first.usage.prompt_tokens,
                                   completion_tokens=first.usage.completion_tokens)  # fmt: skip
        assert again.usage == first.usage and again.cost == Usage(cached_calls=1)
        assert client.totals == first.cost + again.cost + other.cost
        assert len(model.requests) == 2
        assert [r.cached for r in records] == [False, True, False]
        assert cache.stats() == {"cache_hits": 1, "cache_misses": 2}
    with ResponseCache(tmp_path / "cache.sqlite") as reopened:  # a new run reuses the file
        client, records, _ = make_client(model, cache=reopened)
        assert (await client.chat(ChatRequest(messages=USER))).content == first.content
        assert records[0].cached and records[0].attempts == 0


async def test_cache_key_depends_on_model_and_request() -> None:
    request = ChatRequest(messages=USER)
    assert request.cache_key("a") == ChatRequest(messages=USER).cache_key("a")
    assert request.cache_key("a") != request.cache_key("b")
    assert request.cache_key("a") != ChatRequest(messages=USER, sampling=Sampling(seed=1)).cache_key("a")
    assert request.cache_key("a") != ChatRequest(messages=USER, tools=(LOOKUP,)).cache_key("a")


async def test_failed_calls_are_not_cached(tmp_path: Path) -> None:
    model = ScriptedModel.sequence([LLMRequestError("HTTP 400", status_code=400), "fine"])
    with ResponseCache(tmp_path / "cache.sqlite") as cache:
        client, records, _ = make_client(model, cache=cache)
        with pytest.raises(LLMRequestError):
            await client.chat(ChatRequest(messages=USER))
        assert (await client.chat(ChatRequest(messages=USER))).content == "fine"
        assert [r.ok for r in records] == [False, True]
        assert records[0].error == "HTTP 400"


async def test_transient_errors_are_retried_with_growing_backoff() -> None:
    failures = [TransientLLMError("HTTP 503"), TransientLLMError("connection refused"), "finally"]
    client, records, sleeps = make_client(ScriptedModel.sequence(failures), backoff_base_s=1.0)
    reply = await client.chat(ChatRequest(messages=USER))
    assert reply.content == "finally"
    assert sleeps == [0.75, 1.5]  # rng 0.5: half fixed + half jitter of 1 s, then of 2 s
    assert records[0].attempts == 3


async def test_a_server_never_reached_is_an_operator_error_and_a_later_failure_an_items() -> None:
    from builder.errors import ItemError, OperatorError
    from builder.llm import ServerUnreachable

    down = ScriptedModel(lambda request: TransientLLMError("connection refused"))
    client, _, sleeps = make_client(down, max_retries=2)
    with pytest.raises(ServerUnreachable, match="no model server answered 'scripted'") as caught:
        await client.chat(ChatRequest(messages=USER))
    assert isinstance(caught.value, OperatorError) and len(sleeps) == 2  # it was retried first
    flaky = ScriptedModel.sequence(["fine"] + [TransientLLMError("connection reset")] * 3)
    client, _, _ = make_client(flaky, max_retries=2)
    assert (await client.chat(ChatRequest(messages=USER))).content == "fine"
    with pytest.raises(LLMRequestError, match="connection reset") as later:
        await client.chat(ChatRequest(messages=[*USER, ChatMessage(role="user", content="again")]))
    assert isinstance(later.value, ItemError) and not isinstance(later.value, OperatorError)


async def test_4xx_is_never_retried() -> None:
    model = ScriptedModel.sequence([LLMRequestError("HTTP 400 bad schema", status_code=400)])
    client, _, sleeps = make_client(model)
    with pytest.raises(LLMRequestError, match="bad schema"):
        await client.chat(ChatRequest(messages=USER))
    assert sleeps == [] and len(model.requests) == 1


async def test_retries_run_out_with_a_clear_error() -> None:
    model = ScriptedModel(lambda request: TransientLLMError("HTTP 502", status_code=502))
    client, records, sleeps = make_client(model, max_retries=2)
    with pytest.raises(LLMRequestError, match="failed after 3 attempts: HTTP 502") as caught:
        await client.chat(ChatRequest(messages=USER))
    assert caught.value.retryable and len(sleeps) == 2 and not records[0].ok


async def test_hung_request_times_out_and_is_retried() -> None:
    calls = 0

    class Hangs:
        async def chat(self, request: ChatRequest) -> Reply:
            nonlocal calls
            calls += 1
            if calls == 1:
                await asyncio.sleep(60)
            return text_reply("awake")

    client, _, sleeps = make_client(ScriptedModel(lambda r: "unused"), request_timeout_s=0.05)
    client.backend = Hangs()
    assert (await client.chat(ChatRequest(messages=USER))).content == "awake"
    assert calls == 2 and len(sleeps) == 1


def test_backoff_delay_is_capped_and_jittered() -> None:
    assert backoff_delay(0, base_s=0.5, cap_s=30, rng=lambda: 0.0) == 0.25
    assert backoff_delay(0, base_s=0.5, cap_s=30, rng=lambda: 1.0) == 0.5
    assert backoff_delay(3, base_s=0.5, cap_s=30, rng=lambda: 1.0) == 4.0
    assert backoff_delay(20, base_s=0.5, cap_s=30, rng=lambda: 1.0) == 30.0


async def test_concurrency_is_bounded() -> None:
    in_flight = peak = 0

    class Slow:
        async def chat(self, request: ChatRequest) -> Reply:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1
            return text_reply("ok")

    client = LLMClient(Slow(), model_id="slow", max_concurrency=3)
    requests = [ChatRequest(messages=USER, sample_index=i) for i in range(20)]
    replies = await asyncio.gather(*(client.chat(request) for request in requests))
    assert len(replies) == 20 and peak == 3


def test_client_works_across_event_loops() -> None:
    client = LLMClient(ScriptedModel(lambda request: "ok"), model_id="m", max_concurrency=1)

    async def three_calls() -> None:
        await asyncio.wait_for(asyncio.gather(*(client.chat(ChatRequest(messages=USER)) for _ in range(3))), 5)

    for _ in range(2):  # the pipeline may run each stage in its own asyncio.run
        asyncio.run(three_calls())


def test_call_records_in_the_ledger_and_gpu_hours() -> None:
    answered = CallRecord(model="m", key="k", prompt_tokens=10, completion_tokens=20, latency_s=1.0)
    cached = CallRecord(model="m", key="k", prompt_tokens=10, completion_tokens=20, cached=True)
    regrown = CallRecord(model="m", key="k", prompt_tokens=10, completion_tokens=40, regrowth=1)
    failed = CallRecord(model="m", key="k", ok=False, error="x", regrowth=2)
    total = sum((record.usage for record in (answered, cached, regrown, failed)), Usage())
    assert total.model_dump() == {
        "calls": 2,  # answered by the server: the cache hit and the failure are counted apart
        "cached_calls": 1,
        "failed_calls": 1,
        "regrowths": 2,
        "retries": 0,
        "prompt_tokens": 20,  # the cache hit's tokens were spent by the attempt that asked first
        "completion_tokens": 60,
    }
    assert total.tokens == 80 and Usage() + total == total
    assert estimate_gpu_hours(3_600_000, 1000.0) == 1.0
    assert estimate_gpu_hours(3_600_000, 1000.0, num_gpus=2) == 2.0
    with pytest.raises(ValueError):
        estimate_gpu_hours(1, 0.0)


def test_call_record_is_frozen_json() -> None:
    record = CallRecord(model="m", key="k", prompt_tokens=1)
    with pytest.raises(ValueError):
        record.prompt_tokens = 2  # type: ignore[misc]
    assert json.loads(record.model_dump_json())["cached"] is False
