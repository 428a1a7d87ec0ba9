"""What builder measures of the prompts a server has seen: the share a prefix cache can reuse (`prefix_reuse`)."""

from __future__ import annotations

import asyncio
import os

from builder.llm import ChatRequest, ScriptedModel
from builder.llm.base import ServerCall
from builder.llm.pacing import InFlightLimit
from builder.llm.pool import Endpoint, EndpointPool
from builder.llm.prefix import BLOCK_CHARS, PrefixIndex, prompt_text
from builder.records import ChatMessage
from builder.stats import StageStats

SYSTEM = "You review one call to a tool of a software environment. " * 20  # ~1,100 characters, the same each time


def request(user: str) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage(role="system", content=SYSTEM), ChatMessage(role="user", content=user)))


def test_a_prompt_reuses_the_whole_blocks_an_earlier_prompt_began_with():
    index = PrefixIndex()
    first = prompt_text(request("call 1: get_account acc-1"))
    assert index.observe(first) == (0, len(first))  # nothing seen yet
    second = prompt_text(request("call 2: transfer acc-1 acc-2"))
    reused, chars = index.observe(second)
    shared = len(os.path.commonprefix([first, second]))  # the system message and "call "
    assert chars == len(second) and reused == shared // BLOCK_CHARS * BLOCK_CHARS > 1000
    # The same start after a different one is no prefix: blocks count only while everything before them matches.
    other = prompt_text(ChatRequest(messages=(ChatMessage(role="user", content="x" + SYSTEM),)))
    assert index.observe(other)[0] == 0


def test_the_pool_reports_each_servers_reuse_and_the_stage_sums_it():
    stats = StageStats("evaluate")
    endpoints = [Endpoint(f"http://s{i}/v1", ScriptedModel(lambda r: "ok"), InFlightLimit(4)) for i in (1, 2)]
    pool = EndpointPool(endpoints, on_server_call=stats.add_server_call)

    async def run() -> None:
        for n in range(6):
            await pool.chat(request(f"call {n}"))

    asyncio.run(run())
    figures = stats.to_json()
    assert 0.5 < figures["prefix_reuse"] < 1  # each server saw the long system prompt at least twice
    for server in figures["servers"].values():
        assert server["prompt_chars"] > 0 and server["prefix_reuse"] is not None
    assert StageStats.from_json(figures).prefix_reuse == figures["prefix_reuse"]  # read back from stats.json
    assert ServerCall(url="u").prefix_chars == 0
