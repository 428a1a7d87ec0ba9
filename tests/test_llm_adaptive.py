"""Requests in flight set by measurement, per server, over real HTTP: the limit climbs while a server's throughput
rises and comes back when it falls, the KV cache a vLLM reports bounds it, every server (one URL or the managed
one too) goes through the pool, and each server's figures reach the stage statistics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llm_stub import StubServer, completion

from builder.config import LLMConfig, load_config
from builder.errors import ConfigError
from builder.llm import ChatRequest, OpenAIChatModel, open_llm
from builder.llm.base import Reply, ServerCall
from builder.llm.pacing import InFlightLimit
from builder.llm.pool import Endpoint, EndpointPool
from builder.llm.roles import rl_agent_config
from builder.llm.server import kv_cache_tokens
from builder.records import ChatMessage, Sampling
from builder.stages.rollout import user_model
from builder.stats import StageStats

METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",engine="0",kv_cache_size_tokens="%s",num_gpu_blocks="364"} 1.0\n'
)


def ask(index: int) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage(role="user", content=f"q{index}"),), sampling=Sampling(max_tokens=8))


class Modelled:
    """A server whose total throughput with `n` requests in flight is `rate(n)` tokens/s, in virtual time: the
    requests go over real HTTP to a stub, and each reply (10 tokens) moves `now` on by 10 / rate(n) as it
    arrives, n being what the pool has in flight on the server then. The pool's limit reads `now`, so what it
    measures does not depend on how busy this machine is."""

    def __init__(self, rate: Callable[[int], float], url: str, *, fixed: bool = False) -> None:
        self.rate = rate
        self.now = 0.0
        self.http = OpenAIChatModel(url, "local", timeout_s=30.0)
        limit = InFlightLimit(4, high=64, fixed=fixed, clock=lambda: self.now)
        self.endpoint = Endpoint(url=url, backend=self, limit=limit)

    async def chat(self, request: ChatRequest) -> Reply:
        reply = await self.http.chat(request)
        self.now += reply.usage.completion_tokens / self.rate(self.endpoint.in_flight)
        return reply

    async def aclose(self) -> None:
        await self.http.aclose()


def ten_tokens(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, completion("x", completion_tokens=10)


async def drive(pool: EndpointPool, count: int, offered: int) -> list[int]:
    """Send `count` requests, `offered` at a time; the limit after each answer."""
    queue = list(range(count))
    limits: list[int] = []

    async def worker() -> None:
        while queue:
            await pool.chat(ask(queue.pop()))
            limits.append(pool.endpoints[0].limit.current)

    await asyncio.gather(*(worker() for _ in range(offered)))
    return limits


async def test_the_limit_rises_while_throughput_rises_and_falls_back_when_it_drops() -> None:
    with StubServer(ten_tokens, delay_s=0.01) as stub:
        server = Modelled(lambda n: 100.0 * min(n, 16) / 16, stub.url)  # more in flight pays up to 16
        pool = EndpointPool([server.endpoint])
        limit = server.endpoint.limit
        climbed = await drive(pool, 160, offered=64)
        assert climbed[0] == 4 and max(climbed) >= 16  # it climbed to the knee at least
        reached = limit.current
        # The server degrades: beyond 4 in flight every request more costs throughput (say, preemption).
        server.rate = lambda n: 100.0 if n <= 4 else 100.0 * 4 / n
        fell = await drive(pool, 640, offered=64)
        await pool.aclose()
    # Past the knee the throughput held level and requests waited, so it went on to the ceiling (64); then it came
    # back down, each step down confirmed by the larger limit measured again, to the new best (4 or fewer).
    assert reached == 64 and fell[-1] <= 4 and limit.settled


async def test_a_fixed_limit_stays_where_it_starts_over_http() -> None:
    with StubServer(ten_tokens, delay_s=0.01) as stub:
        pool = EndpointPool([Modelled(lambda n: 100.0 * min(n, 16) / 16, stub.url, fixed=True).endpoint])
        assert set(await drive(pool, 60, offered=32)) == {4}
        await pool.aclose()


def test_the_kv_cache_size_is_read_from_vllms_metrics() -> None:
    with (
        StubServer(lambda body: (200, completion()), metrics=METRICS % "46592") as vllm,
        StubServer(lambda body: (200, completion())) as other,
    ):
        assert kv_cache_tokens(vllm.url) == 46592
        assert kv_cache_tokens(other.url) is None  # no Prometheus text: no bound
        vllm.kill()
        assert kv_cache_tokens(vllm.url) is None  # unreachable: no bound


def test_blocks_times_block_size_stand_in_for_a_missing_token_count() -> None:
    metrics = METRICS.replace('kv_cache_size_tokens="%s",', "")
    with StubServer(lambda body: (200, completion()), metrics=metrics) as vllm:
        assert kv_cache_tokens(vllm.url) == 364 * 128


def test_a_pool_of_one_reads_its_kv_bound_and_only_when_adaptive(tmp_path: Path) -> None:
    with StubServer(lambda body: (200, completion()), metrics=METRICS % "1600") as stub:
        for adaptive, expected in ((True, 1600), (False, None)):
            config = LLMConfig(url=stub.url, max_model_len=4096, adaptive_concurrency=adaptive, max_concurrency=4)
            with open_llm(config, tmp_path, cache=False) as client:
                pool = client.backend
                assert isinstance(pool, EndpointPool) and len(pool.endpoints) == 1  # llm.url: a pool of one
                assert pool.endpoints[0].limit.kv_tokens == expected
                asyncio.run(client.chat(ask(1)))
                # 1600 tokens of cache, requests of 16 (11 prompt + 5 completion): 100 fit.
                assert pool.endpoints[0].limit.ceiling == (100 if adaptive else 256)


def test_each_servers_figures_reach_the_stage_stats_when_one_is_killed(tmp_path: Path) -> None:
    stats = StageStats("mine")
    with (
        StubServer(lambda body: (200, completion()), delay_s=0.05) as a,
        StubServer(lambda body: (200, completion()), delay_s=0.05) as b,
    ):
        config = LLMConfig(urls=(a.url, b.url), max_model_len=4096, max_concurrency=4)
        with open_llm(config, tmp_path, cache=False, on_server_call=stats.add_server_call) as client:

            async def run() -> list[str | None]:
                tasks = [asyncio.ensure_future(client.chat(ask(i))) for i in range(40)]
                while len(a.requests) < 6:
                    await asyncio.sleep(0.01)
                a.kill()
                replies = await asyncio.gather(*tasks)
                await client.aclose()
                return [reply.content for reply in replies]

            assert asyncio.run(run()) == ["hello"] * 40  # every request answered
    stats.wall_s = 2.0
    servers = stats.to_json()["servers"]
    first, second = servers[a.url], servers[b.url]
    assert first["requests"] + second["requests"] == 40  # answered once each
    assert first["failures"] >= 1 and second["failures"] == 0
    assert second["completion_tokens"] == 5 * second["requests"] and second["prompt_tokens"] == 11 * second["requests"]
    assert second["mean_in_flight"] == pytest.approx(second["busy_s"] / 2.0, abs=0.01) and second["busy_s"] > 0
    assert second["completion_tok_s"] == second["completion_tokens"] / 2.0
    again = StageStats.from_json(stats.to_json())  # stats.json round trip (the derived figures are dropped)
    assert {
        url: (s.requests, s.failures, s.prompt_tokens, s.completion_tokens) for url, s in again.servers.items()
    } == {url: (s["requests"], s["failures"], s["prompt_tokens"], s["completion_tokens"]) for url, s in servers.items()}


def test_stage_stats_count_failed_and_answered_attempts_per_server() -> None:
    stats = StageStats("plan")
    stats.add_server_call(ServerCall(url="http://a/v1", ok=False, latency_s=1.0))
    stats.add_server_call(ServerCall(url="http://a/v1", prompt_tokens=3, completion_tokens=7, latency_s=2.0))
    assert stats.to_json()["servers"]["http://a/v1"] == {
        "requests": 1,
        "failures": 1,
        "prompt_tokens": 3,
        "completion_tokens": 7,
        "busy_s": 3.0,
        "prompt_chars": 0,  # the calls carry no prompt size (a pool measures it: tests/test_llm_prefix.py)
        "prefix_chars": 0,
        "prefix_reuse": None,
        "mean_in_flight": None,  # no wall time yet
        "completion_tok_s": None,
        "cache_queries": None,  # the server's own prefix-cache counters: none read here
        "cache_hits": None,
        "server_prefix_hit_rate": None,
    }
    assert StageStats.from_json(StageStats("old").to_json()).servers == {}  # stats.json before per-server figures


def test_the_rl_agent_takes_a_list_of_servers() -> None:
    config = load_config(
        None,
        [
            "rollout.rl_agent_model=policy",
            'rollout.rl_agent_urls=["http://a/v1", "http://b/v1"]',
            'llm.urls=["http://s1/v1", "http://s2/v1"]',
        ],
    )
    rl = rl_agent_config(config)
    assert rl is not None and rl.urls == ("http://a/v1", "http://b/v1") and rl.url is None
    assert rl.served_model_name == "policy"
    managed = rl_agent_config(load_config(None, ["rollout.rl_agent_model=policy", 'llm.urls=["http://s1/v1"]']))
    assert managed is not None and managed.urls == () and managed.url is None  # its own managed server


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (['rollout.rl_agent_urls=["http://a/v1"]'], "rl_agent_urls is set but rollout.rl_agent_model is not"),
        (
            ["rollout.rl_agent_model=p", "rollout.rl_agent_url=http://a/v1", 'rollout.rl_agent_urls=["http://b/v1"]'],
            "not both",
        ),
        (["rollout.rl_agent_model=p", 'rollout.rl_agent_urls=["http://a/v1", "http://a/v1"]'], "twice"),
        (["llm.max_concurrency=300"], "max_in_flight_per_server"),
    ],
)
def test_contradictory_server_lists_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_the_user_simulator_runs_on_the_llm_urls_servers(tmp_path: Path) -> None:
    from contextlib import ExitStack

    from builder.pipeline import open_resources
    from builder.stats import StageStats

    with (
        StubServer(lambda body: (200, completion(f"user:{body['model']}"))) as a,
        StubServer(lambda body: (200, completion(f"user:{body['model']}"))) as b,
        ExitStack() as stack,
    ):
        config = load_config(None, [f'llm.urls=["{a.url}", "{b.url}"]', "rollout.user_model=simulator"])
        stats = StageStats("rollout")
        ctx = open_resources(config, tmp_path, stack).context(config, "h", tmp_path, stats)
        model = user_model(ctx)

        async def run() -> list[Any]:
            replies = list(await asyncio.gather(*(model.chat(ask(i)) for i in range(6))))
            await model.aclose()
            return replies

        replies = asyncio.run(run())
        pool = model._client.backend
    assert {reply.content for reply in replies} == {"user:simulator"}
    assert isinstance(pool, EndpointPool) and [e.url for e in pool.endpoints] == [a.url, b.url]
    # Counted in the running stage's stats, like every other model's calls.
    assert stats.usage.calls == 6 and set(stats.servers) == {a.url, b.url}
    with pytest.raises(ConfigError, match="llm.url or llm.urls"), ExitStack() as stack:
        open_resources(load_config(None, ["rollout.user_model=simulator"]), tmp_path, stack)
