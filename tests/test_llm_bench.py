"""`bench llm` against the stub server: both phases run, the JSON has exactly the issue's keys."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from llm_stub import StubServer, completion

from builder.config import LLMConfig
from builder.llm.bench import SUMMARY_KEYS, bench_llm, count_tokens, pace, run_bench


def respond(body: dict) -> tuple[int, dict]:
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    return 200, completion("1 2 3", completion_tokens=body["max_tokens"])


def test_bench_measures_both_phases(tmp_path: Path) -> None:
    with StubServer(respond, delay_s=0.02) as stub:
        config = LLMConfig(url=stub.url, max_concurrency=4)
        result = run_bench(config, tmp_path, requests=12, max_tokens=16, server_concurrency=8)
    # Warm-up, raw phase, the pacing pass (8 in flight until the limit reached the 8 offered), client phase.
    assert 8 <= result.pacing_requests <= 72 and len(stub.requests) == 2 + 12 + result.pacing_requests + 12
    assert result.server_tok_s > 0 and result.client_tok_s > 0
    assert result.ratio == result.client_tok_s / result.server_tok_s
    # Figures, not a timing target (a loaded machine may take any time): ordered and finite.
    assert 0 <= result.overhead_p50_ms <= result.overhead_p99_ms < float("inf")
    assert 0 <= result.slot_wait_p99_ms <= result.overhead_p99_ms  # the wait for a slot is part of the overhead
    assert (result.server_concurrency, result.start_concurrency) == (8, 4)
    # The stub answers in parallel, so more in flight pays: the limit climbed past the fixed 4 to the offered 8.
    assert result.client_concurrency >= 8
    assert "ratio client/server" in result.to_text() and "waiting for a slot under the limit" in result.to_text()


def test_bench_with_fixed_concurrency_keeps_the_client_at_its_limit(tmp_path: Path) -> None:
    with StubServer(respond, delay_s=0.02) as stub:
        config = LLMConfig(url=stub.url, max_concurrency=3, adaptive_concurrency=False)
        result = run_bench(config, tmp_path, requests=12, max_tokens=16, server_concurrency=8)
    assert len(stub.requests) == 2 + 12 + 12 and result.pacing_requests == 0  # a fixed limit: no pacing pass
    assert (result.start_concurrency, result.client_concurrency) == (3, 3)
    # 8 offered, 3 let through, 20 ms a reply: the last of the 12 waits three replies' time in the pool for a slot.
    assert result.slot_wait_p99_ms >= 40 and "ABOVE TARGET" not in result.to_text()


def test_bench_json_has_exactly_the_issue_keys(tmp_path: Path) -> None:
    with StubServer(respond) as stub:
        output = bench_llm(LLMConfig(url=stub.url), tmp_path, as_json=True, requests=4)
    data = json.loads(output)
    assert (
        tuple(data) == SUMMARY_KEYS == ("server_tok_s", "client_tok_s", "ratio", "overhead_p50_ms", "overhead_p99_ms")
    )
    assert all(isinstance(value, float) for value in data.values())


async def test_every_token_is_counted_across_workers() -> None:
    async def work(item: int) -> int:
        await asyncio.sleep(0.001 * (item % 3))
        return item

    tokens, seconds = await count_tokens(list(range(100)), work, 7)
    assert tokens == sum(range(100)) and seconds > 0


def test_bench_reports_the_kv_ceiling_and_the_machine_load(tmp_path: Path) -> None:
    metrics = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="2700",num_gpu_blocks="10"} 1.0\n'
    with StubServer(respond, metrics=metrics) as stub:
        config = LLMConfig(url=stub.url, max_concurrency=4)
        result = run_bench(config, tmp_path, requests=4, max_tokens=16, server_concurrency=4, pacing_requests=0)
    # Requests of 27 tokens (11 prompt + 16 completion): 2700 tokens of cache hold 100 of them.
    assert result.kv_ceiling == 100 and "KV-cache ceiling: 100 in flight" in result.to_text()
    assert all(load >= 0 for load in result.load_average) and "machine load" in result.to_text()
    with StubServer(respond) as stub:
        plain = run_bench(LLMConfig(url=stub.url), tmp_path, requests=2, max_tokens=4, pacing_requests=0)
    assert plain.kv_ceiling is None and "not reported" in plain.to_text()


def test_the_pacing_pass_stops_within_its_cap(tmp_path: Path) -> None:
    with StubServer(respond, delay_s=0.01) as stub:
        config = LLMConfig(url=stub.url, max_concurrency=1)
        result = run_bench(config, tmp_path, requests=12, max_tokens=4, server_concurrency=12)
    # From 1 in flight, up by half a window (8 answers or more) at a time towards the 12 offered, at most 6 x 12
    # requests, stopping once the limit reaches 12 or settles (this machine's timing decides which).
    assert 8 <= result.pacing_requests <= 72 and len(stub.requests) == 2 + 12 + result.pacing_requests + 12


class _Limit:
    """A pacer that reaches the offered load after `climb` requests were answered."""

    def __init__(self, climb: int) -> None:
        self.current, self.fixed, self.settled, self.climb = 4, False, False, climb


async def test_the_pacing_pass_keeps_the_offered_load_in_flight_without_a_pause_until_the_limit_is_there() -> None:
    limit, in_flight, seen = _Limit(climb=50), [0], []

    async def send(index: int) -> None:
        in_flight[0] += 1
        seen.append(in_flight[0])
        await asyncio.sleep(0.001 * (1 + index % 3))
        in_flight[0] -= 1
        limit.climb -= 1
        if limit.climb == 0:
            limit.current = 16

    sent = await pace(limit, send, concurrency=16, cap=1000)
    # Never in rounds: once 16 were started, every request started with the other 15 still in flight (a round
    # would drain to a few before the next began).
    assert min(seen[16:]) == 16
    # It stopped once the limit reached the 16 offered: those in flight then were let finish, no new one sent.
    assert 50 <= sent <= 50 + 15


async def test_the_pacing_pass_stops_at_its_cap_and_sends_nothing_when_there_is_nothing_to_find() -> None:
    async def send(index: int) -> None:
        await asyncio.sleep(0)

    assert await pace(_Limit(climb=10**6), send, concurrency=8, cap=40) == 40
    fixed = _Limit(climb=10**6)
    fixed.fixed = True
    assert await pace(fixed, send, concurrency=8, cap=40) == 0
