"""Budgets that fit the context and the thinking switch, in `LLMClient` with the scripted model: prompt
measurement, the max_tokens cap, PromptTooLongError before sending, growth of cut replies, reasoning kept in
trajectories but never sent back, and `<think>` blocks in content."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from builder.config import load_config
from builder.llm import (
    CallRecord,
    ChatRequest,
    LLMClient,
    PromptTooLongError,
    ResponseCache,
    ScriptedModel,
    text_reply,
    tool_reply,
)
from builder.llm.client import CONTEXT_MARGIN_TOKENS, MIN_COMPLETION_TOKENS, estimate_prompt_tokens
from builder.llm.connect import client_for
from builder.pipeline import LazyModel
from builder.records import ChatMessage, Sampling
from builder.rollout.episode import Limits, run_episode
from builder.stages.code.pieces import extract_code
from builder.stats import StageStats

USER = (ChatMessage(role="user", content="Write the method."),)


def spanning(tokens: int) -> tuple[ChatMessage, ...]:
    """A prompt long enough to hold `tokens` tokens (one character each), so the client cannot rule out that it
    does and measures it (a short prompt whose budget surely fits is sent unmeasured)."""
    return (ChatMessage(role="user", content="Write the method." + " w" * (tokens // 2)),)


CONTEXT = 32768

# What a capable model writes: a long method, the wall clock and fresh ids (not a two-line toy reply).
LONG_METHOD = "\n".join(
    [
        "def borrow_book(self, member_id: str, isbn: str) -> dict:",
        '    """Lend a copy of `isbn` to `member_id` for 21 days."""',
        "    member = self.members.get(member_id)",
        "    if member is None:",
        '        return {"success": False, "error": f"unknown member {member_id}"}',
        *[f"    check_{i} = len(self.loans) + {i}  # bookkeeping line {i}" for i in range(60)],
        "    loan_id = str(uuid.uuid4())",
        "    due = datetime.datetime.now() + datetime.timedelta(days=21)",
        '    self.loans[loan_id] = {"member": member_id, "isbn": isbn, "due": due.isoformat()}',
        '    return {"success": True, "loan_id": loan_id, "due": due.isoformat()}',
    ]
)


class Verdict(BaseModel):
    keep: bool
    score: float
    reasons: list[str]


def client(model: ScriptedModel, **kwargs: Any) -> tuple[LLMClient, list[CallRecord]]:
    records: list[CallRecord] = []
    kwargs.setdefault("context_tokens", CONTEXT)
    return LLMClient(model, model_id="m", on_call=records.append, **kwargs), records


def sized(tokens: int):
    """A `prompt_tokens` script: every prompt measures `tokens`."""
    return lambda request: tokens


# ------------------------------------------------------------------------------------------------ thinking


async def test_thinking_off_is_sent_and_leaves_the_budget_alone() -> None:
    model = ScriptedModel(lambda request: "ok")
    llm, _ = client(model, thinking=False, reasoning_budget=2048)
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=3072)))
    sent = model.requests[0]
    assert sent.extra["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent.sampling.max_tokens == 3072


async def test_thinking_on_adds_the_reasoning_budget_and_keeps_other_template_kwargs() -> None:
    model = ScriptedModel(lambda request: "ok")
    llm, _ = client(model, thinking=True, reasoning_budget=2048)
    extra = {"chat_template_kwargs": {"documents": []}, "top_k": 20}
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=3072), extra=extra))
    sent = model.requests[0]
    assert sent.extra == {"chat_template_kwargs": {"enable_thinking": True, "documents": []}, "top_k": 20}
    assert sent.sampling.max_tokens == 3072 + 2048


async def test_no_thinking_switch_sends_no_template_kwargs() -> None:
    model = ScriptedModel(lambda request: "ok")
    llm, _ = client(model)
    await llm.chat(ChatRequest(messages=USER))
    assert "chat_template_kwargs" not in model.requests[0].extra


def test_client_for_takes_thinking_and_context_from_the_config() -> None:
    config = load_config(None, ["llm.thinking=on", "llm.max_model_len=20000"])
    llm = client_for(config.llm, ScriptedModel(lambda r: "ok"), model_id="m")
    assert (llm.thinking, llm.reasoning_budget, llm.context_tokens) == (True, config.llm.reasoning_budget, 20000)
    assert (
        client_for(config.llm, ScriptedModel(lambda r: "ok"), model_id="m", context_tokens=8192).context_tokens == 8192
    )


# ------------------------------------------------------------------------------------------------- fitting


async def test_budget_is_capped_at_what_the_context_leaves() -> None:
    model = ScriptedModel(lambda request: "ok", prompt_tokens=sized(30000))
    llm, _ = client(model)
    await llm.chat(ChatRequest(messages=spanning(30000), sampling=Sampling(max_tokens=4096)))
    budget = model.requests[0].sampling.max_tokens
    assert budget == CONTEXT - 30000 - CONTEXT_MARGIN_TOKENS
    assert 30000 + budget <= CONTEXT


async def test_a_budget_that_fits_is_sent_as_asked_and_none_becomes_the_room() -> None:
    model = ScriptedModel(lambda request: "ok", prompt_tokens=sized(1000))
    llm, _ = client(model)
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=4096)))
    await llm.chat(ChatRequest(messages=USER, sample_index=1))
    assert [r.sampling.max_tokens for r in model.requests] == [4096, CONTEXT - 1000 - CONTEXT_MARGIN_TOKENS]


async def test_too_long_a_prompt_raises_before_anything_is_sent() -> None:
    model = ScriptedModel(lambda request: "never", prompt_tokens=sized(CONTEXT - 100))
    llm, records = client(model)
    with pytest.raises(PromptTooLongError) as caught:
        await llm.chat(ChatRequest(messages=spanning(CONTEXT), sampling=Sampling(max_tokens=4096)))
    error = caught.value
    assert (error.prompt_tokens, error.context_tokens, error.min_completion) == (CONTEXT - 100, CONTEXT, 256)
    assert "llm.max_model_len" in str(error) and not error.retryable
    assert model.requests == [] and records == []


async def test_a_small_budget_needs_only_itself() -> None:
    # 200 tokens of room: too little for a 4096 budget (needs 256), enough for a 64-token one.
    model = ScriptedModel(lambda request: "ok", prompt_tokens=sized(CONTEXT - 200 - CONTEXT_MARGIN_TOKENS))
    llm, _ = client(model)
    with pytest.raises(PromptTooLongError):
        await llm.chat(ChatRequest(messages=spanning(CONTEXT), sampling=Sampling(max_tokens=4096)))
    await llm.chat(ChatRequest(messages=spanning(CONTEXT), sampling=Sampling(max_tokens=64)))
    assert [r.sampling.max_tokens for r in model.requests] == [64]
    assert MIN_COMPLETION_TOKENS == 256


async def test_a_budget_that_surely_fits_is_sent_without_measuring_the_prompt() -> None:
    measured: list[ChatRequest] = []

    def count(request: ChatRequest) -> int:
        measured.append(request)
        return 10

    model = ScriptedModel(lambda request: "ok", prompt_tokens=count)
    llm, _ = client(model)
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=4096)))  # fits whatever its size
    assert measured == [] and model.requests[0].sampling.max_tokens == 4096
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=CONTEXT - 100)))  # might not fit
    assert len(measured) == 1 and model.requests[1].sampling.max_tokens == CONTEXT - 100


async def test_structured_raises_prompt_too_long_too() -> None:
    model = ScriptedModel(lambda request: "{}", prompt_tokens=sized(CONTEXT))
    llm, _ = client(model)
    with pytest.raises(PromptTooLongError):
        await llm.structured(USER, Verdict)
    assert model.requests == []


async def test_without_a_counting_backend_the_estimate_errs_large() -> None:
    prompt = "word " * 30000  # 150k characters: about 30k real tokens, estimated at 50k
    model = ScriptedModel(lambda request: "never")  # no prompt_tokens: cannot count
    llm, _ = client(model)
    with pytest.raises(PromptTooLongError) as caught:
        await llm.chat(ChatRequest(messages=(ChatMessage(role="user", content=prompt),)))
    assert caught.value.prompt_tokens > 45000 and model.requests == []
    ascii_only = ChatRequest(messages=(ChatMessage(role="user", content="a" * 3000),))
    cjk = ChatRequest(messages=(ChatMessage(role="user", content="字" * 3000),))
    assert estimate_prompt_tokens(ascii_only) >= 1000 and estimate_prompt_tokens(cjk) >= 6000


async def test_the_prompt_is_measured_once_per_prompt() -> None:
    model = ScriptedModel(lambda request: "ok", prompt_tokens=sized(500))
    llm, _ = client(model)
    for index in range(3):  # samples of one prompt
        await llm.chat(ChatRequest(messages=USER, sample_index=index))
    await llm.chat(ChatRequest(messages=(ChatMessage(role="user", content="another prompt"),)))
    assert len(model.counted) == 2 and len(model.requests) == 4


async def test_without_a_known_context_budgets_go_as_asked_and_nothing_is_measured() -> None:
    model = ScriptedModel(lambda request: text_reply("cut", finish_reason="length"), prompt_tokens=sized(10**6))
    llm, _ = client(model, context_tokens=None)
    reply = await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=100)))
    assert reply.finish_reason == "length" and model.counted == []
    assert [r.sampling.max_tokens for r in model.requests] == [100]


# -------------------------------------------------------------------------------------------------- growth


def cut_below(needed: int, full: str):
    """Answers in full when the budget is at least `needed`, else a reply cut at the budget."""

    def answer(request: ChatRequest):
        if request.sampling.max_tokens >= needed:
            return text_reply(full)
        return text_reply(full[: request.sampling.max_tokens], finish_reason="length")

    return answer


async def test_a_cut_reply_is_asked_again_with_a_doubled_budget(tmp_path: Path) -> None:
    full = f"```python\n{LONG_METHOD}\n```"
    with ResponseCache(tmp_path / "cache.sqlite") as cache:
        model = ScriptedModel(cut_below(5000, full), prompt_tokens=sized(2000))
        llm, records = client(model, cache=cache)
        reply = await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=3072)))
        assert reply.content == full and reply.finish_reason == "stop"
        assert [r.sampling.max_tokens for r in model.requests] == [3072, 6144]
        assert [(r.regrowth, r.finish_reason) for r in records] == [(0, "length"), (1, "stop")]
        assert records[0].key != records[1].key  # the grown request is its own cache entry
        # A rerun replays both replies from the cache, the cut one and the full one.
        again = ScriptedModel(lambda request: "must not be asked", prompt_tokens=sized(2000))
        llm2, records2 = client(again, cache=cache)
        assert (await llm2.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=3072)))).content == full
        assert again.requests == [] and [r.cached for r in records2] == [True, True]
    assert extract_code(reply.content)[0].strip() == LONG_METHOD


async def test_growth_stops_at_the_context_and_the_last_reply_stays_cut() -> None:
    model = ScriptedModel(lambda request: text_reply("loop " * 10, finish_reason="length"), prompt_tokens=sized(26000))
    llm, records = client(model, max_budget_growths=5)
    reply = await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=4096)))
    room = CONTEXT - 26000 - CONTEXT_MARGIN_TOKENS
    assert [r.sampling.max_tokens for r in model.requests] == [4096, room]  # never past the context
    assert reply.finish_reason == "length" and [r.regrowth for r in records] == [0, 1]
    assert all(26000 + r.sampling.max_tokens <= CONTEXT for r in model.requests)


async def test_growth_is_bounded_by_max_budget_growths() -> None:
    model = ScriptedModel(lambda request: text_reply("x", finish_reason="length"), prompt_tokens=sized(100))
    llm, _ = client(model, max_budget_growths=2)
    await llm.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=1000)))
    assert [r.sampling.max_tokens for r in model.requests] == [1000, 2000, 4000]
    none, _ = client(model2 := ScriptedModel(lambda r: text_reply("x", finish_reason="length")), max_budget_growths=0)
    await none.chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=1000)))
    assert len(model2.requests) == 1


async def test_a_reply_cut_while_thinking_is_grown_too() -> None:
    def answer(request: ChatRequest):
        if request.sampling.max_tokens < 8000:
            return text_reply("<think>First the members, then the loans, then", finish_reason="length")
        return text_reply('<think>Members, loans.</think>{"keep": true, "score": 0.8, "reasons": ["stateful"]}')

    model = ScriptedModel(answer, prompt_tokens=sized(1500))
    llm, _ = client(model, thinking=True, reasoning_budget=2048)
    verdict = await llm.structured(USER, Verdict, sampling=Sampling(max_tokens=4096))
    assert verdict.keep and [r.sampling.max_tokens for r in model.requests] == [6144, 12288]


async def test_regrowths_are_counted_in_the_stage_stats() -> None:
    config = load_config(None, [])
    model = ScriptedModel(cut_below(3000, "done"), prompt_tokens=sized(100))
    lazy = LazyModel(config.llm, lambda on_call: client_for(config.llm, model, model_id="m", on_call=on_call))
    stats = StageStats("code")
    await lazy.for_stage(stats).chat(ChatRequest(messages=USER, sampling=Sampling(max_tokens=2000)))
    assert stats.usage.calls == 2 and stats.usage.regrowths == 1
    assert stats.to_json()["usage"]["regrowths"] == 1 and StageStats.from_json(stats.to_json()).usage.regrowths == 1


# --------------------------------------------------------------------------------------- <think> in content


async def test_think_preamble_before_json_is_not_seen_by_structured_output() -> None:
    verbose = (
        "<think>\nThe library has members and loans; a loan changes state, so this is stateful.\n"
        "Score: high, maybe 0.9.\n</think>\n\n"
        '{\n  "keep": true,\n  "score": 0.9,\n  "reasons": [\n    "loans change state",\n    "members persist"\n  ]\n}'
    )
    model = ScriptedModel(lambda request: verbose)
    llm, _ = client(model)
    assert await llm.structured(USER, Verdict) == Verdict(
        keep=True, score=0.9, reasons=["loans change state", "members persist"]
    )
    # A lone closing tag (the template opened the block in the prompt) too.
    lone = ScriptedModel(lambda request: 'Let me think.</think>{"keep": false, "score": 0.1, "reasons": []}')
    assert (await client(lone)[0].structured(USER, Verdict)).keep is False


async def test_think_preamble_before_a_code_fence_is_not_seen_by_code_extraction() -> None:
    text = f"<think>\nI need uuid and datetime; use now() for the due date.\n</think>\n\n```python\n{LONG_METHOD}\n```"
    llm, _ = client(ScriptedModel(lambda request: text))
    reply = await llm.chat(ChatRequest(messages=USER))
    assert reply.reasoning.startswith("I need uuid") and "<think>" not in reply.content
    code, fixes = extract_code(reply.content)
    assert code.strip() == LONG_METHOD and fixes == ["stripped_fences"]


# ------------------------------------------------------------------------------------ reasoning in episodes


class Runner:
    async def call(self, name: str, arguments: dict[str, Any]):
        class Outcome:
            ok, error_kind = True, None

            def content(self) -> str:
                return '{"success": true}'

        return Outcome()


async def test_the_agent_keeps_its_reasoning_in_the_trajectory() -> None:
    tool = {"type": "function", "function": {"name": "borrow", "parameters": {"type": "object"}}}
    replies = [
        tool_reply(("borrow", {"isbn": "1"})).model_copy(update={"reasoning": "Borrow first."}),
        text_reply("<think>It worked.</think>Done: the book is yours."),
    ]
    model = ScriptedModel.sequence(replies)
    llm, _ = client(model, thinking=True)
    episode = await run_episode(
        llm, [tool], Runner(), system="s", opening="Borrow isbn 1", limits=Limits(5, 5, 10**6), sampling=Sampling()
    )
    assistant = [m for m in episode.messages if m.role == "assistant"]
    assert [m.reasoning_content for m in assistant] == ["Borrow first.", "It worked."]
    assert assistant[1].content == "Done: the book is yours."
    # The request of the second turn holds the conversation, but what goes on the wire has no reasoning.
    second = model.requests[1]
    assert second.messages[2].reasoning_content == "Borrow first."
    assert all("reasoning_content" not in message for message in second.wire_messages())
