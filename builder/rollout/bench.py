"""`python -m builder bench rollout`: how fast episodes run, and whether anything but the model slows them down.

Runs many episodes of `builder.rollout.episode.run_episode` at once against real sandbox sessions of a small counter
environment, graded by its check. With the scripted agent (default; `--latency-ms` simulates a model's reply
time) it prints episodes per second and the share of wall time during which no model call was in flight (the
rollout machinery's own cost). With `--real` the configured model answers (`llm.urls`, `llm.url` or a managed
server), through the same `EndpointPool` as every other model use, so each server is paced by its own in-flight
limit (`llm.max_concurrency`, moved by its throughput with `llm.adaptive_concurrency`) as in a real run. The
completion tokens per second achieved during rollouts are then compared with the server's best on the same work:
every request the rollouts sent is sent again through that same pool, all queued at once, with nothing waiting
between them (no turn waits for the previous one, no tool runs, no grading); each server again takes as many as
its limit allows, starting from where the rollouts left it. Over the whole run that is `ratio`; over the steady
phase, while every slot is kept full, `steady_ratio` (the figure a long rollout run sees; target >= 0.90). A
decode-only baseline (`bench llm`) would not do: an agent's requests are mostly prompt (the tools, the
conversation so far), and on a CPU prompt processing dominates the server's time.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from builder.config import BuildConfig
from builder.envs.checks import CheckSpec
from builder.envs.session import Session
from builder.llm import ChatRequest, Reply, ScriptedModel, tool_reply
from builder.records import Action, Sampling
from builder.rollout.episode import Limits, run_episode
from builder.rollout.reward import gold_paths, grade
from builder.rollout.runner import SandboxRunner
from builder.sandbox.bench import BENCH_CHECK, BENCH_ENV
from builder.sandbox.runtime import Sandbox

TASK = "Increase the counter by 3, one step at a time, then say that you are done."
SYSTEM = "You operate a counter through its tools. Do what the user asks, then answer without a tool call."
GOLD = (Action(name="increment", arguments={"by": 3}),)


class BusyClock:
    """Wraps a model and measures the wall time during which at least one of its calls is in flight."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.active = 0
        self.busy_s = 0.0
        self.completion_tokens = 0
        self.replies: list[tuple[float, int]] = []  # (when it arrived, completion tokens)
        self._since = 0.0

    async def chat(self, request: ChatRequest) -> Reply:
        if self.active == 0:
            self._since = time.perf_counter()
        self.active += 1
        try:
            reply = await self.model.chat(request)
        finally:
            self.active -= 1
            if self.active == 0:
                self.busy_s += time.perf_counter() - self._since
        self.completion_tokens += reply.usage.completion_tokens
        self.replies.append((time.perf_counter(), reply.usage.completion_tokens))
        return reply

    def tokens_between(self, start: float, end: float) -> int:
        return sum(tokens for when, tokens in self.replies if start <= when <= end)


class _SlowScripted:
    """The scripted counter agent, answering after `latency_s` like a model would."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.model = ScriptedModel(_counter_agent)

    async def chat(self, request: ChatRequest) -> Reply:
        await asyncio.sleep(self.latency_s)
        return await self.model.chat(request)


class RecordingBackend:
    """Passes requests on to a backend and keeps every one the server answered, for the replay baseline."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.requests: list[ChatRequest] = []

    async def chat(self, request: ChatRequest) -> Reply:
        reply = await self.backend.chat(request)
        self.requests.append(request)
        return reply

    async def aclose(self) -> None:
        close = getattr(self.backend, "aclose", None)
        if close is not None:
            await close()


async def replay(client: Any, requests: list[ChatRequest]) -> dict:
    """Send `requests` again through `client` (its concurrency limit applies), all queued at once: the completion
    tokens per second the server gives this exact work when nothing waits between requests."""
    tokens = 0

    async def one(request: ChatRequest) -> None:
        nonlocal tokens
        reply = await client.chat(request)  # not `tokens += await ...`: that reads `tokens` before suspending
        tokens += reply.usage.completion_tokens

    started = time.perf_counter()
    try:
        await asyncio.gather(*(one(request) for request in requests))
    finally:
        await client.aclose()
    wall = time.perf_counter() - started
    return {
        "replay_requests": len(requests),
        "replay_tokens": tokens,
        "replay_s": round(wall, 3),
        "replay_tok_s": round(tokens / wall, 1),
    }


def _counter_agent(request: ChatRequest) -> Reply | str:
    done = sum(message.role == "tool" for message in request.messages)
    return tool_reply(("increment", {"by": 1})) if done < 3 else "Done: the counter went up by 3."


async def run_rollouts(model: Any, sandbox: Sandbox, episodes: int, in_flight: int, config: BuildConfig) -> dict:
    """Run `episodes` graded episodes, `in_flight` at a time; the figures as a dict."""
    clock = BusyClock(model)
    allowed = gold_paths(sandbox, BENCH_ENV, {"value": 0}, GOLD)
    check = CheckSpec(name="grew", source=BENCH_CHECK)
    limits = Limits(config.rollout.max_turns, config.rollout.max_tool_calls, config.rollout.max_tokens)
    gate = asyncio.Semaphore(in_flight)
    # Sandbox calls block on a worker's pipe, not the CPU: a thread per episode in flight, as a run gives them.
    threads = ThreadPoolExecutor(max_workers=in_flight + 4, thread_name_prefix="sandbox")
    asyncio.get_running_loop().set_default_executor(threads)
    solved = 0
    starts: list[float] = []

    async def one(index: int) -> None:
        nonlocal solved
        async with gate:
            starts.append(time.perf_counter())
            session = await asyncio.to_thread(Session, sandbox, BENCH_ENV, {"value": 0})
            try:
                episode = await run_episode(
                    clock, list(session.tools), SandboxRunner(session), system=SYSTEM, opening=TASK, limits=limits,
                    sampling=Sampling(temperature=config.rollout.temperature,
                                      max_tokens=config.rollout.max_reply_tokens),
                    sample_index=index,
                )  # fmt: skip
                final = await asyncio.to_thread(session.snapshot)
            finally:
                await asyncio.to_thread(session.close)
            verdict = await asyncio.to_thread(grade, sandbox, [check.source], {"value": 0}, final, allowed)
            solved += verdict.solved and episode.end_reason == "agent_done"

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(episodes)))
    wall = time.perf_counter() - started
    # Steady state: until the last episode starts, every slot is refilled as an episode ends, as in a real run of
    # thousands of episodes; after it the batch drains, a tail a long run pays once. None without a steady phase.
    steady_s = max(starts) - started if episodes > in_flight else 0.0
    return {
        "episodes": episodes,
        "in_flight": in_flight,
        "solved": solved,
        "wall_s": round(wall, 3),
        "episodes_per_s": round(episodes / wall, 2),
        "share_outside_model": round(max(0.0, 1 - clock.busy_s / wall), 4),
        "completion_tokens": clock.completion_tokens,
        "rollout_tok_s": round(clock.completion_tokens / wall, 1),
        "steady_s": round(steady_s, 3),
        "steady_tok_s": round(clock.tokens_between(started, started + steady_s) / steady_s, 1) if steady_s else None,
    }


def bench_rollout(
    config: BuildConfig, run_dir: Path, *, episodes: int = 200, latency_ms: float = 20.0, real: bool = False
) -> dict:
    """The benchmark's figures (see the module docstring); with `real`, also the server's best and the ratio."""
    in_flight = config.rollout.episodes_in_flight
    with ExitStack() as stack:
        sandbox = stack.enter_context(Sandbox(config.sandbox))
        if not real:
            return asyncio.run(run_rollouts(_SlowScripted(latency_ms / 1000), sandbox, episodes, in_flight, config))
        from builder.llm.connect import client_for, endpoint_pool, model_servers, over_pool, served_model_id

        llm = config.llm
        urls, context, seeds = stack.enter_context(model_servers(llm, run_dir))
        pool = endpoint_pool(llm, urls, seeds=seeds)
        recording = RecordingBackend(pool)

        def client(backend: Any) -> Any:
            return client_for(
                over_pool(llm, pool), backend, model_id=served_model_id(llm), cache=None, context_tokens=context
            )

        async def rollouts() -> dict:
            rollout_client = client(recording)
            try:
                return await run_rollouts(rollout_client, sandbox, episodes, in_flight, config)
            finally:
                await rollout_client.aclose()

        figures = asyncio.run(rollouts())
        figures["servers"] = [
            {"url": endpoint.url, "answered": endpoint.answered, "in_flight_limit": endpoint.limit.current}
            for endpoint in pool.endpoints
        ]
        figures.update(asyncio.run(replay(client(pool), recording.requests)))
        best, steady = figures["replay_tok_s"], figures["steady_tok_s"]
        figures.update(
            ratio=round(figures["rollout_tok_s"] / best, 3) if best else 0.0,
            steady_ratio=round(steady / best, 3) if best and steady is not None else None,
        )
        return figures


def to_text(figures: dict) -> str:
    lines = [f"{key}: {value}" for key, value in figures.items() if key != "servers"]
    for server in figures.get("servers", ()):
        lines.append(
            f"server {server['url']}: answered {server['answered']} in rollouts, "
            f"in-flight limit {server['in_flight_limit']} after them"
        )
    if "ratio" in figures:
        steady = figures["steady_ratio"]
        if steady is None:
            lines.append("no steady phase: use more --episodes than rollout.episodes_in_flight to judge the target")
        else:
            lines.append("ok" if steady >= 0.90 else "BELOW TARGET 0.90 (raise rollout.episodes_in_flight?)")
    return "\n".join(lines)


def main(config: BuildConfig, run_dir: Path, *, as_json: bool, **options: Any) -> str:
    figures = bench_rollout(config, run_dir, **options)
    return json.dumps(figures) if as_json else to_text(figures)
