"""What the gpu profile's client really sends, over HTTP to a stub vLLM: the thinking switch, budgets that fit
the context (measured with /tokenize), growth of cut replies, `<think>` blocks, and the version check."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from llm_stub import StubServer, completion, tokenized
from pydantic import BaseModel

from builder.config import BuildConfig, load_config
from builder.llm import ChatRequest, OpenAIChatModel, PromptTooLongError, open_llm
from builder.llm.client import CONTEXT_MARGIN_TOKENS
from builder.records import ChatMessage, Sampling

SYSTEM = ChatMessage(role="system", content="You write Python environment classes.")


class Plan(BaseModel):
    name: str
    operations: list[str]


def vllm(*args: Any, **kwargs: Any) -> StubServer:
    """A stub that says it is vLLM (GET /version), so the client also uses its /tokenize."""
    return StubServer(*args, version="0.32.0", **kwargs)


def gpu_config(url: str, *overrides: str) -> BuildConfig:
    return load_config(None, [f"llm.url={url}", "llm.cache=false", *overrides], profile="gpu")


def ask(config: BuildConfig, run_dir: Path, request: ChatRequest) -> Any:
    with open_llm(config.llm, run_dir) as client:
        return asyncio.run(client.chat(request))


def plan_request(config: BuildConfig, text: str = "Plan a library lending desk.") -> ChatRequest:
    sampling = Sampling(temperature=config.llm.temperature, max_tokens=config.plan.max_tokens)
    return ChatRequest(messages=(SYSTEM, ChatMessage(role="user", content=text)), sampling=sampling)


# A prompt long enough that a 4096-token budget might not fit beside it in 32768 (one token per character), so
# the client measures it; a shorter one is sent unmeasured.
LONG_TEXT = "Plan a library lending desk." + " desk" * 6000


def test_gpu_profile_sends_thinking_off_and_measures_the_prompt(tmp_path: Path) -> None:
    with vllm(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(812))) as stub:
        config = gpu_config(stub.url)
        ask(config, tmp_path, plan_request(config, LONG_TEXT))
    body = stub.requests[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["max_tokens"] == config.plan.max_tokens == 4096
    measured = stub.tokenized[0]
    assert measured["model"] == config.llm.served_model_name and measured["add_generation_prompt"] is True
    assert measured["messages"] == body["messages"]
    assert measured["chat_template_kwargs"] == {"enable_thinking": False}


def test_thinking_on_is_sent_and_grows_the_budget_by_the_reasoning_budget(tmp_path: Path) -> None:
    with vllm(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(812))) as stub:
        config = gpu_config(stub.url, "llm.thinking=on", "llm.reasoning_budget=3000")
        ask(config, tmp_path, plan_request(config))
    body = stub.requests[0]
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert body["max_tokens"] == 4096 + 3000


def test_a_long_prompt_gets_a_budget_that_fits_the_context(tmp_path: Path) -> None:
    long_state = "\n".join(
        f"loan L-{i}: member M-{i % 97} holds isbn 978-{i:07d}, due 2025-06-{i % 28 + 1:02d}" for i in range(2500)
    )
    with vllm(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(30500))) as stub:
        config = gpu_config(stub.url, "llm.thinking=on")
        ask(config, tmp_path, plan_request(config, long_state))
    body = stub.requests[0]
    assert 30500 + body["max_tokens"] <= config.llm.max_model_len == 32768
    assert body["max_tokens"] == 32768 - 30500 - CONTEXT_MARGIN_TOKENS


def test_a_prompt_too_long_for_the_context_never_reaches_the_server(tmp_path: Path) -> None:
    with vllm(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(32700))) as stub:
        config = gpu_config(stub.url)
        with pytest.raises(PromptTooLongError) as caught:
            ask(config, tmp_path, plan_request(config, LONG_TEXT + " desk" * 1000))
    assert stub.requests == [] and len(stub.tokenized) == 1
    assert (caught.value.prompt_tokens, caught.value.context_tokens) == (32700, 32768)


def test_a_reply_cut_at_the_budget_is_answered_in_full_with_the_larger_one(tmp_path: Path) -> None:
    full = '{"name": "library_loans", "operations": ["borrow_book", "return_book", "renew_loan", "list_loans"]}'

    def respond(body: dict) -> tuple[int, dict]:
        if body["max_tokens"] < 8000:
            return 200, completion(full[:40], finish_reason="length", completion_tokens=body["max_tokens"])
        return 200, completion(full, completion_tokens=900)

    with vllm(respond, tokenize=lambda body: (200, tokenized(2000))) as stub:
        config = gpu_config(stub.url)
        with open_llm(config.llm, tmp_path) as client:
            plan = asyncio.run(
                client.structured(
                    [SYSTEM, ChatMessage(role="user", content="Plan it.")], Plan, sampling=Sampling(max_tokens=4096)
                )
            )
    assert plan.name == "library_loans" and len(plan.operations) == 4
    assert [body["max_tokens"] for body in stub.requests] == [4096, 8192]
    assert len(stub.tokenized) == 1  # the grown request has the same prompt: measured once


def test_think_blocks_in_content_without_a_reasoning_parser(tmp_path: Path) -> None:
    text = (
        '<think>\nFour operations cover lending.\n</think>\n\n{"name": "library_loans", "operations": ["borrow_book"]}'
    )
    with vllm(lambda body: (200, completion(text)), tokenize=lambda body: (200, tokenized(300))) as stub:
        config = gpu_config(stub.url, "llm.reasoning_parser=none")
        with open_llm(config.llm, tmp_path) as client:
            plan = asyncio.run(client.structured([ChatMessage(role="user", content="Plan it.")], Plan))
    assert plan == Plan(name="library_loans", operations=["borrow_book"])


def test_reasoning_is_never_sent_back(tmp_path: Path) -> None:
    history = (
        ChatMessage(role="user", content="Borrow isbn 1"),
        ChatMessage(role="assistant", content="Done.", reasoning_content="The member exists, so borrow."),
        ChatMessage(role="user", content="Thanks, and renew it." + LONG_TEXT),
    )
    with vllm(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(50))) as stub:
        ask(gpu_config(stub.url), tmp_path, ChatRequest(messages=history))
    for sent in (stub.requests[0]["messages"], stub.tokenized[0]["messages"]):
        assert sent[1] == {"role": "assistant", "content": "Done."}


def test_a_server_without_tokenize_is_asked_once_then_estimated(tmp_path: Path) -> None:
    with vllm(lambda body: (200, completion("ok"))) as stub:  # /tokenize answers 404
        config = gpu_config(stub.url)
        with open_llm(config.llm, tmp_path) as client:
            for index in range(3):
                request = plan_request(config, f"Plan desk number {index}.")
                asyncio.run(client.chat(request))
            with pytest.raises(PromptTooLongError):  # ~40k estimated tokens: refused without sending
                asyncio.run(client.chat(plan_request(config, "many words " * 12000)))
    assert len(stub.tokenized) == 1 and len(stub.requests) == 3
    assert all(body["max_tokens"] == 4096 for body in stub.requests)


@pytest.mark.parametrize(
    ("version", "warned"), [("0.30.1", "too old"), ("0.33.0", "newer than"), ("0.32.0", None), (None, None)]
)
def test_an_external_vllm_outside_the_range_is_warned_about(tmp_path, caplog, version, warned) -> None:
    with StubServer(lambda body: (200, completion("ok")), version=version) as stub:
        with caplog.at_level(logging.WARNING, logger="builder.llm.server"):
            ask(gpu_config(stub.url), tmp_path, ChatRequest(messages=(ChatMessage(role="user", content="hi"),)))
    messages = [record.getMessage() for record in caplog.records if record.name == "builder.llm.server"]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0] and ">=0.31.0,<0.33" in messages[0]
    assert len(stub.requests) == 1  # a warning, not a refusal: the server may not be vLLM at all


async def test_count_prompt_tokens_sends_tools_and_reads_the_count() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    with StubServer(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(77))) as stub:
        model = OpenAIChatModel(stub.url, "local")
        request = ChatRequest(messages=(ChatMessage(role="user", content="hi"),), tools=(tool,))
        assert await model.count_prompt_tokens(request) == 77
    assert stub.tokenized[0]["tools"] == [tool] and "chat_template_kwargs" not in stub.tokenized[0]


async def test_count_prompt_tokens_gives_none_on_a_bad_answer() -> None:
    with StubServer(lambda body: (200, completion("ok")), tokenize=lambda body: (400, {"error": "bad"})) as stub:
        model = OpenAIChatModel(stub.url, "local")
        request = ChatRequest(messages=(ChatMessage(role="user", content="hi"),))
        assert await model.count_prompt_tokens(request) is None
        assert await model.count_prompt_tokens(request) is None
    assert len(stub.tokenized) == 2  # a 400 is this request's problem: the endpoint is asked again next time
    with StubServer(lambda body: (200, completion("ok")), tokenize=lambda body: (200, {"tokens": []})) as stub:
        assert await OpenAIChatModel(stub.url, "local").count_prompt_tokens(request) is None


def test_a_server_that_is_not_vllm_is_never_asked_to_tokenize(tmp_path: Path) -> None:
    # Like an OpenAI-compatible proxy that answers every GET with 200 and queues every POST as a chat request.
    with StubServer(lambda body: (200, completion("ok")), tokenize=lambda body: (200, tokenized(5))) as stub:
        config = gpu_config(stub.url)
        ask(config, tmp_path, plan_request(config))
    assert stub.tokenized == [] and len(stub.requests) == 1
    assert stub.requests[0]["max_tokens"] == 4096  # the estimate leaves the whole budget for a short prompt
