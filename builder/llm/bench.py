"""`python -m builder bench llm`: is the client ever the bottleneck?

In one run against one server it measures (a) the server's own best throughput with many concurrent raw HTTP
requests, and (b) the throughput through the full client path (cache off) at the same offered load, the
server's requests in flight paced as in a run (`connect.server_limit`: starting at llm.max_concurrency, bounded
by the KV cache the server reports; fixed with llm.adaptive_concurrency off), after an untimed pacing pass in
which the limit finds its place: the offered load kept in flight until the limit reaches it or settles, as it
would over the thousands of requests of a run. It reports b/a, the adaptive client's throughput over the server's best
at the same offered load (target >= 0.95), the limit reached, and the time the client adds per request (p50,
p99; target p99 <= 1 s): wall time of `chat` minus the HTTP exchange, measured with transport hooks, and the part
of it a request waited in the pool for a slot under the pacer's limit (p99).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
from pydantic import BaseModel

from builder.config import LLMConfig
from builder.llm.base import ChatRequest
from builder.llm.connect import SERVER_LOG, client_for, server_limit
from builder.llm.openai_backend import OpenAIChatModel
from builder.llm.pool import Endpoint, EndpointPool
from builder.llm.server import VLLMServer
from builder.records import ChatMessage, Sampling

_exchange: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar("exchange", default=None)


class BenchResult(BaseModel):
    """The benchmark's figures; `summary()` keeps exactly the keys the issue fixes for `--json`."""

    server_tok_s: float
    client_tok_s: float
    ratio: float
    overhead_p50_ms: float
    overhead_p99_ms: float
    slot_wait_p99_ms: float = 0.0  # of the overhead, the wait in the pool for a slot under the in-flight limit
    requests: int
    max_tokens: int
    server_concurrency: int
    client_concurrency: int  # the client's in-flight limit at the end (where pacing took it)
    start_concurrency: int  # where it started (llm.max_concurrency)
    pacing_requests: int = 0  # untimed requests sent before (b) for the limit to find its place
    kv_ceiling: int | None = None  # the most in flight the server's KV cache holds (None: it reports no size)
    load_average: tuple[float, float] = (0.0, 0.0)  # this machine's 1-minute load at the start and the end

    def summary(self) -> dict[str, float]:
        return {key: round(getattr(self, key), 3) for key in SUMMARY_KEYS}

    def to_text(self) -> str:
        verdict = "ok" if self.ratio >= TARGET_RATIO else f"BELOW TARGET {TARGET_RATIO}"
        late = "ok" if self.overhead_p99_ms <= TARGET_OVERHEAD_P99_MS else f"ABOVE TARGET {TARGET_OVERHEAD_P99_MS} ms"
        return "\n".join(
            [
                f"requests: {self.requests} x {self.max_tokens} tokens",
                f"server (raw HTTP, {self.server_concurrency} in flight): {self.server_tok_s:.1f} tok/s",
                f"client (full path, cache off, {self.server_concurrency} offered, in-flight limit "
                f"{self.start_concurrency} -> {self.client_concurrency} after {self.pacing_requests} pacing "
                f"requests): {self.client_tok_s:.1f} tok/s",
                f"ratio client/server: {self.ratio:.3f}  {verdict}",
                f"client overhead per request: p50 {self.overhead_p50_ms:.2f} ms, p99 {self.overhead_p99_ms:.2f} ms"
                f"  {late} (of it waiting for a slot under the limit: p99 {self.slot_wait_p99_ms:.2f} ms)",
                f"KV-cache ceiling: {self.kv_ceiling if self.kv_ceiling is not None else 'not reported'} in flight",
                f"machine load (1 min) at start / end: {self.load_average[0]:.2f} / {self.load_average[1]:.2f}",
            ]
        )


TARGET_RATIO = 0.95
TARGET_OVERHEAD_P99_MS = 1000.0
PACING_ROUNDS = 6  # the pacing pass sends at most this many times `requests`
SUMMARY_KEYS = ("server_tok_s", "client_tok_s", "ratio", "overhead_p50_ms", "overhead_p99_ms")


def run_bench(
    config: LLMConfig,
    run_dir: Path,
    *,
    requests: int = 64,
    max_tokens: int = 64,
    server_concurrency: int = 0,
    pacing_requests: int | None = None,
) -> BenchResult:
    """Run the benchmark against `config.url` (or the first of `config.urls`), or a managed server started (and
    stopped) for it.

    Args:
        requests: Requests per phase; every one generates exactly `max_tokens` tokens (`ignore_eos`).
        server_concurrency: In-flight raw requests for phase (a), and the load offered to the client in (b);
            0 means max(64, 2 x llm.max_concurrency).
        pacing_requests: Untimed requests through the client before (b) at most, for its limit to climb, sent
            with the offered load in flight until the limit reaches it or settles (`pace`); default 6 x `requests`
            (from 16 to 64 in flight takes about 130 answers when every step is kept; on a loaded machine noise
            undoes some, and each costs a window or two).
    """
    concurrency = min(requests, server_concurrency or max(64, 2 * config.max_concurrency))
    pacing = PACING_ROUNDS * requests if pacing_requests is None else pacing_requests
    with ExitStack() as stack:
        url = config.url or (config.urls[0] if config.urls else None)
        url = url or stack.enter_context(VLLMServer(config, Path(run_dir) / SERVER_LOG)).url
        return asyncio.run(_measure(config, url, requests, max_tokens, concurrency, pacing))


async def _measure(
    config: LLMConfig, url: str, requests: int, max_tokens: int, concurrency: int, pacing: int
) -> BenchResult:
    load_start = os.getloadavg()[0]
    bodies = [_body(config.served_model_name, index, max_tokens) for index in range(requests)]
    # All raw requests run at once and each lasts the whole phase: a slow server must not time them out.
    timeout = max(config.request_timeout_s, 3600.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as http:
        await _raw_phase(http, url, bodies[:2], 2)  # warm-up: first requests pay one-off costs
        server_tok_s = await _raw_phase(http, url, bodies, concurrency)
    backend = OpenAIChatModel(
        url,
        config.served_model_name,
        timeout_s=config.request_timeout_s,
        http_client_factory=_timed_http_client,
    )
    limit = server_limit(config, url)
    pool = EndpointPool([Endpoint(url=url, backend=_Dispatched(backend), limit=limit)])
    # Every request generates exactly max_tokens (`ignore_eos`), so each ends at "length": never grow it. The
    # pool paces the server; the client's own bound must not.
    update = {"max_budget_growths": 0, "max_concurrency": pool.capacity}
    client = client_for(config.model_copy(update=update), pool, model_id=f"bench:{url}")
    start_limit = limit.current

    async def send(index: int) -> None:
        await client.chat(_request(_body(config.served_model_name, requests + index, max_tokens), max_tokens))

    paced = await pace(limit, send, concurrency, pacing)
    chat_requests = [_request(body, max_tokens) for body in bodies]
    overheads: list[float] = []
    slot_waits: list[float] = []

    async def one(request: ChatRequest) -> int:
        exchange: dict[str, float] = {}
        _exchange.set(exchange)
        start = time.perf_counter()
        reply = await client.chat(request)
        total = time.perf_counter() - start
        overheads.append(total - (exchange["response"] - exchange["request"]))
        slot_waits.append(exchange["dispatched"] - start)
        return reply.usage.completion_tokens

    client_tok_s = await _pool(chat_requests, one, concurrency)
    await client.aclose()
    overheads.sort()
    slot_waits.sort()
    return BenchResult(
        server_tok_s=server_tok_s,
        client_tok_s=client_tok_s,
        ratio=client_tok_s / server_tok_s if server_tok_s else 0.0,
        overhead_p50_ms=statistics.median(overheads) * 1000,
        overhead_p99_ms=_p99(overheads) * 1000,
        slot_wait_p99_ms=_p99(slot_waits) * 1000,
        requests=requests,
        max_tokens=max_tokens,
        server_concurrency=concurrency,
        client_concurrency=limit.current,
        start_concurrency=start_limit,
        pacing_requests=paced,
        kv_ceiling=limit.ceiling if limit.kv_tokens is not None else None,
        load_average=(load_start, os.getloadavg()[0]),
    )


def _p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


class _Dispatched:
    """The backend, noting when the pool hands it a request (the end of the request's wait for a slot)."""

    def __init__(self, backend: OpenAIChatModel) -> None:
        self.backend = backend

    async def chat(self, request: ChatRequest) -> Any:
        if (exchange := _exchange.get()) is not None:
            exchange["dispatched"] = time.perf_counter()
        return await self.backend.chat(request)

    def __getattr__(self, name: str) -> Any:  # count_prompt_tokens, healthy, aclose: the backend's own
        return getattr(self.backend, name)


async def pace(limit: Any, send: Any, concurrency: int, cap: int) -> int:
    """The pacing pass: `send(index)` with `concurrency` requests in flight without a pause, as the thousands of
    requests of a run keep the load up, until the limit reaches the offered load or settles (or is fixed), or
    `cap` requests were sent; returns how many were sent.

    Not in rounds: a round that ends lets the requests in flight drain to none before the next starts, and a
    window of the pacer that spans that tail measures the drain, not the limit. It made a move up look like a
    loss and settled the limit below the load offered (54 of 64 on 2026-12-05, and the 10 others waited a round
    in the pool: p99 overhead 29 s)."""
    sent = 0

    def done() -> bool:
        return limit.fixed or limit.settled or limit.current >= concurrency

    async def worker() -> None:
        nonlocal sent
        while sent < cap and not done():
            sent += 1
            await send(sent - 1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


async def _raw_phase(http: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]], concurrency: int) -> float:
    async def one(body: dict[str, Any]) -> int:
        response = await http.post(f"{url}/chat/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]["completion_tokens"]

    return await _pool(bodies, one, concurrency)


async def _pool(items: list[Any], work: Any, workers: int) -> float:
    """Run `work` over `items` with `workers` coroutines; return tokens per second of wall time."""
    tokens, seconds = await count_tokens(items, work, workers)
    return tokens / seconds


async def count_tokens(items: list[Any], work: Any, workers: int) -> tuple[int, float]:
    """Run `work` (item -> tokens) over `items` with `workers` coroutines; return (tokens, wall seconds)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            done = await work(queue.get_nowait())
            tokens += done  # not `tokens += await …`: that reads `tokens` before awaiting and loses updates

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(workers, len(items)))))
    return tokens, time.perf_counter() - start


def _body(model: str, index: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"Count upwards from {index}, one number per line."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # every request generates exactly max_tokens, so both phases do equal work
    }


def _request(body: dict[str, Any], max_tokens: int) -> ChatRequest:
    return ChatRequest(
        messages=tuple(ChatMessage(**message) for message in body["messages"]),
        sampling=Sampling(temperature=0.0, max_tokens=max_tokens),
        extra={"ignore_eos": True},
    )


def _timed_http_client() -> Any:
    """The SDK's default async HTTP client with hooks that time each exchange of the current task."""

    async def on_request(request: Any) -> None:
        if (exchange := _exchange.get()) is not None:
            exchange["request"] = time.perf_counter()

    async def on_response(response: Any) -> None:
        if (exchange := _exchange.get()) is not None:
            exchange["response"] = time.perf_counter()

    hooks = {"request": [on_request], "response": [on_response]}
    return openai.DefaultAsyncHttpxClient(event_hooks=hooks)


def bench_llm(config: LLMConfig, run_dir: Path, *, as_json: bool = False, requests: int = 64) -> str:
    """The text `python -m builder bench llm [--json]` prints."""
    result = run_bench(config, run_dir, requests=requests)
    return json.dumps(result.summary()) if as_json else result.to_text()
