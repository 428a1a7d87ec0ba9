"""Several model servers (`llm.urls`): balancing by requests in flight, a killed server routed around with
nothing lost or answered twice, probes bringing a server back, the cache and the ledger unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from llm_stub import StubServer, completion
from pydantic import ValidationError

from builder.config import LLMConfig
from builder.llm import ChatRequest, LLMRequestError, OpenAIChatModel, TransientLLMError, open_llm
from builder.llm.base import CallRecord, Reply, TokenUsage
from builder.llm.pacing import InFlightLimit
from builder.llm.pool import Endpoint, EndpointPool
from builder.records import ChatMessage, Sampling


def ask(index: int) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage(role="user", content=f"q{index}"),), sampling=Sampling(max_tokens=8))


def echo(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return 200, completion(f"a:{body['messages'][0]['content']}")


class Concurrency:
    """A responder that answers like `echo` after `delay_s` and records the most requests it held at once."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(self.delay_s)
        with self._lock:
            self.now -= 1
        return echo(body)


def config(*urls: str, **more: Any) -> LLMConfig:
    return LLMConfig(urls=urls, max_model_len=4096, **{"max_retries": 2, **more})


def test_requests_are_spread_by_in_flight_and_each_server_kept_to_its_limit(tmp_path: Path) -> None:
    first, second = Concurrency(0.05), Concurrency(0.05)
    with StubServer(first) as a, StubServer(second) as b:
        cfg = config(a.url, b.url, max_concurrency=3, adaptive_concurrency=False)
        with open_llm(cfg, tmp_path, cache=False) as client:

            async def run() -> list[Reply]:
                replies = await asyncio.gather(*(client.chat(ask(i)) for i in range(24)))
                await client.aclose()
                return list(replies)

            replies = asyncio.run(run())
    assert [reply.content for reply in replies] == [f"a:q{i}" for i in range(24)]
    assert len(a.requests) + len(b.requests) == 24 and min(len(a.requests), len(b.requests)) >= 8
    assert first.peak == 3 and second.peak == 3  # both kept full, neither given more than its limit


def test_a_server_killed_mid_run_loses_nothing_and_answers_nothing_twice(tmp_path: Path) -> None:
    records: list[CallRecord] = []
    with StubServer(echo, delay_s=0.05) as a, StubServer(echo, delay_s=0.05) as b:
        cfg = config(a.url, b.url, max_concurrency=4)
        with open_llm(cfg, tmp_path, on_call=records.append) as client:

            async def run() -> list[Reply]:
                tasks = [asyncio.ensure_future(client.chat(ask(i))) for i in range(40)]
                while len(a.requests) < 6:
                    await asyncio.sleep(0.01)
                a.kill()  # four of its requests are in flight and are never answered
                replies = await asyncio.gather(*tasks)
                await client.aclose()
                return list(replies)

            replies = asyncio.run(run())
            totals = client.totals
    assert [reply.content for reply in replies] == [f"a:q{i}" for i in range(40)]
    answered_by_b = [body["messages"][0]["content"] for body in b.requests]
    assert len(answered_by_b) == len(set(answered_by_b))  # no request sent to the survivor twice
    assert len(a.requests) + len(b.requests) > 40  # some were sent to the dead server and then re-routed
    # The ledger: one call per request, each with the usage of the one reply that came back.
    assert len(records) == 40 and all(record.ok and record.attempts == 1 for record in records)
    assert totals.calls == 40 and totals.failed_calls == 0
    assert sum(reply.cost.calls for reply in replies) == 40


def test_the_response_cache_is_shared_by_all_servers(tmp_path: Path) -> None:
    with StubServer(echo) as a, StubServer(echo) as b:
        with open_llm(config(a.url, b.url), tmp_path) as client:
            first = asyncio.run(client.chat(ask(1)))
        with open_llm(config(b.url, a.url), tmp_path) as client:  # another order: same model, same cache
            again = asyncio.run(client.chat(ask(1)))
    assert len(a.requests) + len(b.requests) == 1
    assert again.content == first.content and again.cost.cached_calls == 1


def test_a_rejected_request_is_not_sent_to_another_server(tmp_path: Path) -> None:
    with StubServer(lambda body: (400, {"message": "bad tool"})) as a, StubServer(echo) as b:
        with open_llm(config(a.url, b.url), tmp_path, cache=False) as client:
            with pytest.raises(LLMRequestError, match="bad tool") as caught:
                asyncio.run(client.chat(ask(1)))
    assert caught.value.status_code == 400 and len(b.requests) == 0


def test_every_server_down_from_the_start_stops_the_run_after_the_clients_retries(tmp_path: Path) -> None:
    from builder.errors import OperatorError

    with StubServer(echo) as a, StubServer(echo) as b:
        a.kill()
        b.kill()
        cfg = config(a.url, b.url, max_retries=1)
        with open_llm(cfg, tmp_path, cache=False) as client:
            client.retry = dataclasses.replace(client.retry, base_s=0.01)
            with pytest.raises(OperatorError, match="no server of 2 answered") as caught:
                asyncio.run(client.chat(ask(1)))
    assert isinstance(caught.value.__cause__, LLMRequestError) and caught.value.__cause__.retryable


class Flaky:
    """A backend that answers while `alive`, fails like a dead server otherwise, and is probed by `healthy`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.alive = True
        self.asked = 0

    async def chat(self, request: ChatRequest) -> Reply:
        self.asked += 1
        if not self.alive:
            raise TransientLLMError(f"connection refused ({self.name})")
        return Reply(content=self.name, usage=TokenUsage(completion_tokens=1))

    async def healthy(self) -> bool:
        return self.alive


def pool_of(*backends: Flaky, clock: Any = time.monotonic) -> EndpointPool:
    endpoints = [Endpoint(url=b.name, backend=b, limit=InFlightLimit(2, fixed=True)) for b in backends]
    return EndpointPool(endpoints, probe_interval_s=10.0, clock=clock)


async def test_a_failed_server_comes_back_after_a_successful_probe() -> None:
    now = [0.0]
    a, b = Flaky("a"), Flaky("b")
    pool = pool_of(a, b, clock=lambda: now[0])
    a.alive = False
    assert (await pool.chat(ask(1))).content == "b"  # a failed it and b answered
    assert [e.up for e in pool.endpoints] == [False, True]
    a.alive = True
    assert (await pool.chat(ask(2))).content == "b"  # too early for a probe: a stays out
    now[0] = 10.0
    await pool.chat(ask(3))  # starts the probe
    await asyncio.sleep(0)
    assert [e.up for e in pool.endpoints] == [True, True]
    assert (await pool.chat(ask(4))).content == "a"  # the least loaded, first listed
    assert pool.summary()[0]["failed"] == 1 and pool.summary()[1]["answered"] == 3


async def test_a_server_that_fails_its_probe_stays_out() -> None:
    now = [0.0]
    a, b = Flaky("a"), Flaky("b")
    pool = pool_of(a, b, clock=lambda: now[0])
    a.alive = False
    await pool.chat(ask(1))
    now[0] = 10.0
    await pool.chat(ask(2))
    await asyncio.sleep(0)
    assert not pool.endpoints[0].up and a.asked == 1  # probed, not sent requests


async def test_the_last_server_in_rotation_stays_in_it_for_the_clients_retries() -> None:
    a, b = Flaky("a"), Flaky("b")
    a.alive = b.alive = False
    pool = pool_of(a, b)
    with pytest.raises(TransientLLMError, match="no server of 2 answered: connection refused"):
        await pool.chat(ask(1))
    assert [e.up for e in pool.endpoints] == [False, True]  # b failed too, but is the last one left
    b.alive = True
    assert (await pool.chat(ask(2))).content == "b"  # tried again at once, no probe needed
    assert (a.asked, b.asked) == (1, 2)


async def test_a_pool_of_one_keeps_trying_its_server() -> None:
    a = Flaky("a")
    a.alive = False
    pool = pool_of(a)
    for index in range(2):
        with pytest.raises(TransientLLMError, match="no server of 1 answered: connection refused"):
            await pool.chat(ask(index))
    a.alive = True
    assert (await pool.chat(ask(2))).content == "a" and a.asked == 3 and pool.endpoints[0].up


def test_an_empty_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one server"):
        EndpointPool([])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "http://a/v1", "urls": ("http://b/v1",)}, "not both"),
        ({"urls": ("http://a/v1", "http://a/v1")}, "twice"),
        ({"urls": ("http://a/v1",), "max_concurrency": 300}, "max_in_flight_per_server"),
    ],
)
def test_contradictory_server_settings_are_config_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LLMConfig(**fields)


async def test_the_http_probe_tells_a_live_server_from_a_dead_one() -> None:
    with StubServer(echo) as stub:
        backend = OpenAIChatModel(stub.url, "local", timeout_s=5.0)
        assert await backend.healthy()
        stub.kill()
        assert not await backend.healthy()
        await backend.aclose()


def test_urls_are_set_from_the_command_line_and_do_not_change_the_config_hash() -> None:
    from builder.config import load_config
    from builder.config.tree import config_hash

    config = load_config(None, ['llm.urls=["http://a:8000/v1", "http://b:8000/v1"]', "llm.max_in_flight_per_server=64"])
    assert config.llm.urls == ("http://a:8000/v1", "http://b:8000/v1")
    assert config_hash(config) == config_hash(load_config(None, []))  # where the servers are changes no output


def for_env(index: int, env: str) -> ChatRequest:
    return ask(index).model_copy(update={"affinity": env})


async def test_the_requests_of_one_environment_go_to_one_server_while_it_takes_them() -> None:
    backends = [Flaky(name) for name in "abc"]
    pool = pool_of(*backends)
    homes = {env: pool.home(env).url for env in ("env-1", "env-2", "env-3", "env-4", "env-5", "env-6")}
    assert len(set(homes.values())) > 1  # environments are spread over the servers
    for env, home in homes.items():
        answers = {(await pool.chat(for_env(index, env))).content for index in range(6)}
        assert answers == {home}  # every request of the environment, not only the least loaded server's turn
    assert pool.home("env-1") is pool.home("env-1") and ask(1).cache_key("m") == for_env(1, "x").cache_key("m")


async def test_an_environment_moves_to_the_least_loaded_server_when_its_home_is_down_or_full() -> None:
    now = [0.0]
    a, b = Flaky("a"), Flaky("b")
    pool = pool_of(a, b, clock=lambda: now[0])
    env = next(name for name in (f"env-{i}" for i in range(50)) if pool.home(name).url == "a")
    a.alive = False
    assert (await pool.chat(for_env(1, env))).content == "b"  # the home failed it: routed to the other
    assert (await pool.chat(for_env(2, env))).content == "b"  # the home is out of rotation
    a.alive, now[0] = True, 10.0
    await pool.chat(ask(3))  # starts the probe
    await asyncio.sleep(0)
    assert (await pool.chat(for_env(4, env))).content == "a"  # back home once it is in rotation again
    # Saturated: with the home's two slots taken, the request goes to the other server instead of waiting.
    home = pool.endpoints[0]
    home.in_flight = home.limit.current
    assert (await pool.chat(for_env(5, env))).content == "b"
    home.in_flight = 0
    assert (await pool.chat(for_env(6, env))).content == "a"


class FlatServer:
    """A server in virtual time whose throughput is level from 16 in flight on (it batches 16, queues the rest):
    each reply of 10 tokens moves `now` on by 10 / throughput. It records the most requests it held at once."""

    def __init__(self) -> None:
        self.now = 0.0
        self.in_flight = 0
        self.peak = 0

    async def chat(self, request: ChatRequest) -> Reply:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(0.001)  # the others sent meanwhile are in flight with it
        self.now += 10 / (100.0 * min(self.in_flight, 16) / 16)
        self.in_flight -= 1
        return Reply(content="x", finish_reason="length", usage=TokenUsage(prompt_tokens=20, completion_tokens=10))


async def test_requests_offered_above_a_level_servers_knee_stop_waiting_in_the_pool() -> None:
    # The bench: 64 offered to a server whose throughput is flat past 16. The limit used to go back to 16
    # ("it did as well"), so 48 of every 64 waited in the pool for a slot, and that wait was the client's overhead.
    server = FlatServer()
    pool = EndpointPool([Endpoint(url="flat", backend=server, limit=InFlightLimit(16, clock=lambda: server.now))])

    async def offer(count: int) -> None:
        queue = list(range(count))

        async def worker() -> None:
            while queue:
                await pool.chat(ask(queue.pop()))

        await asyncio.gather(*(worker() for _ in range(64)))

    await offer(192)  # the bench's pacing pass
    assert pool.endpoints[0].limit.current >= 64
    server.peak = 0
    await offer(64)  # the measured phase: every request goes out at once, none waits in the pool
    assert server.peak == 64 and pool._waiting == 0
