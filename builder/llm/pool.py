"""Several model servers behind one `ChatModel` (`llm.urls`): balanced by requests in flight, routed around
failures.

Each request goes to the server with the fewest requests in flight for its limit (`pacing.InFlightLimit`), and
waits when every server is at its limit. A request with an `affinity` (the environment it belongs to) goes to
that affinity's home server instead while the home is in rotation and below its limit (cache affinity: the
requests of one environment share a long prefix, which only the server that saw it has in its prefix cache);
when the home is out of rotation or saturated it goes to the least loaded as any other.

A server that fails a request (connection refused or reset, timeout,
5xx: a `TransientLLMError`) is taken out of rotation and the request is sent to another at once, so a server
that dies mid-run loses none of its requests. A server out of rotation is probed (`GET …/v1/models`, which
every OpenAI-compatible server answers) at most every `probe_interval_s` and comes back when it answers. Only
when every server has failed the request does it fail, with `TransientLLMError`, for the client's backoff. The
last server in rotation stays in it whatever it answers: with nothing else to try, the client's backoff paces
the retries, as with one server (`llm.url` and the managed server are a pool of one).

Every attempt on a server is reported to `on_server_call` (a `ServerCall`), for per-server figures in the
stage statistics; the ledger does not see them (a re-routed request is one call there).

The pool sits under `LLMClient`, so the response cache, budgets, retries and the usage ledger do not change: a
request answered by its second server is one call, with the usage of the reply that came back. A 4xx is the
request's own fault and is raised as it is, without trying another server.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from builder.llm.base import ChatModel, ChatRequest, Reply, ServerCall
from builder.llm.errors import TransientLLMError
from builder.llm.pacing import InFlightLimit
from builder.llm.prefix import PrefixIndex, prompt_text

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One server of the pool and what the pool knows about it."""

    url: str
    backend: ChatModel
    limit: InFlightLimit
    in_flight: int = 0
    up: bool = True
    probed_at: float = float("-inf")
    answered: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0  # summed time of the answered requests, for the mean latency
    probing: bool = field(default=False, repr=False)
    # What this server's prompts began with: its prefix cache, as far as builder can tell (`builder.llm.prefix`).
    prefixes: PrefixIndex = field(default_factory=PrefixIndex, repr=False)

    def load(self) -> float:
        return self.in_flight / self.limit.current

    def summary(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "up": self.up,
            "in_flight_limit": self.limit.current,
            "answered": self.answered,
            "failed": self.failed,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "mean_latency_s": round(self.busy_s / self.answered, 3) if self.answered else 0.0,
        }


class EndpointPool:
    """A `ChatModel` over the backends of several servers.

    Args:
        endpoints: The servers, each with its own backend and in-flight limit.
        probe_interval_s: Least time between two health probes of a server out of rotation.
        probe_timeout_s: How long a probe may take.
        on_server_call: Called after every attempt on a server, answered or failed.
        clock: Injected for tests.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        probe_interval_s: float = 2.0,
        probe_timeout_s: float = 5.0,
        on_server_call: Callable[[ServerCall], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not endpoints:
            raise ValueError("a pool needs at least one server")
        self.endpoints = list(endpoints)
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.on_server_call = on_server_call
        self._clock = clock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Condition | None = None
        self._probes: set[asyncio.Task[None]] = set()
        self._waiting = 0  # requests waiting in `_acquire` for a slot on any server

    @property
    def capacity(self) -> int:
        """Requests the pool can have in flight at most (the sum of the servers' ceilings)."""
        return sum(endpoint.limit.high for endpoint in self.endpoints)

    async def chat(self, request: ChatRequest) -> Reply:
        """Answer `request` on the least loaded server, moving on to another each time one fails.

        Raises:
            TransientLLMError: every server failed this request or is out of rotation.
            LLMRequestError: a server rejected the request (4xx).
        """
        tried: set[Endpoint] = set()
        errors: list[TransientLLMError] = []
        while (endpoint := await self._acquire(tried, request.affinity)) is not None:
            tried.add(endpoint)
            start = self._clock()
            try:
                reply = await endpoint.backend.chat(request)
            except TransientLLMError as error:
                errors.append(error)
                self._report(ServerCall(url=endpoint.url, ok=False, latency_s=self._clock() - start))
                await self._failed(endpoint, error)
                continue
            finally:
                await self._release(endpoint)
            usage = reply.usage
            elapsed = self._clock() - start
            endpoint.answered += 1
            endpoint.prompt_tokens += usage.prompt_tokens
            endpoint.completion_tokens += usage.completion_tokens
            endpoint.busy_s += elapsed
            endpoint.limit.answered(usage.completion_tokens, usage.prompt_tokens)
            reused, chars = endpoint.prefixes.observe(prompt_text(request))
            self._report(
                ServerCall(
                    url=endpoint.url,
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    latency_s=elapsed,
                    prompt_chars=chars,
                    prefix_chars=reused,
                )
            )
            return reply
        # Never empty: the last server in rotation stays in it, so every request is tried somewhere.
        # The shortest Retry-After asked for: any one server taking requests again is enough.
        waits = [error.retry_after_s for error in errors if error.retry_after_s is not None]
        raise TransientLLMError(
            f"no server of {len(self.endpoints)} answered: {'; '.join(map(str, errors))}",
            status_code=errors[-1].status_code if errors else None,
            retry_after_s=min(waits) if waits else None,
        )

    async def count_prompt_tokens(self, request: ChatRequest) -> int | None:
        """The prompt's size as the least loaded server in rotation counts it (None: it cannot tell)."""
        live = [endpoint for endpoint in self.endpoints if endpoint.up]
        if not live:
            return None
        counter = getattr(min(live, key=Endpoint.load).backend, "count_prompt_tokens", None)
        return await counter(request) if counter is not None else None

    async def aclose(self) -> None:
        for task in list(self._probes):
            task.cancel()
        for endpoint in self.endpoints:
            close = getattr(endpoint.backend, "aclose", None)
            if close is not None:
                await close()

    def summary(self) -> list[dict[str, Any]]:
        """Per server: in rotation or not, its current in-flight limit, requests answered and failed, tokens."""
        return [endpoint.summary() for endpoint in self.endpoints]

    def home(self, affinity: str) -> Endpoint:
        """The server the requests of `affinity` go to while it takes them: a stable hash over every server of
        the pool (in rotation or not), so an affinity keeps its server across a run and its resumption."""
        digest = hashlib.blake2b(affinity.encode("utf-8"), digest_size=8).digest()
        return self.endpoints[int.from_bytes(digest, "big") % len(self.endpoints)]

    async def _acquire(self, tried: set[Endpoint], affinity: str | None = None) -> Endpoint | None:
        """The server for a request with a slot taken on it, None if none is left in rotation untried: the home
        of its `affinity` when that server is in rotation, untried and below its limit (its prefix cache holds
        what the affinity's requests share), else the least loaded server in rotation not yet tried."""
        changed = self._condition()
        async with changed:
            while True:
                self._probe_due()
                live = [endpoint for endpoint in self.endpoints if endpoint.up and endpoint not in tried]
                if not live:
                    return None
                free = [endpoint for endpoint in live if endpoint.in_flight < endpoint.limit.current]
                home = self.home(affinity) if affinity is not None else None
                if free:
                    chosen = home if home in free else min(free, key=Endpoint.load)  # ties go to the first listed
                    chosen.in_flight += 1
                    chosen.limit.started(chosen.in_flight)
                    return chosen
                self._waiting += 1
                for endpoint in live:
                    endpoint.limit.waiting(self._waiting)  # demand above the limit: what a higher one lets through
                try:
                    await changed.wait()
                finally:
                    self._waiting -= 1

    async def _release(self, endpoint: Endpoint) -> None:
        changed = self._condition()
        async with changed:
            endpoint.in_flight -= 1
            changed.notify_all()

    def _report(self, call: ServerCall) -> None:
        if self.on_server_call is not None:
            self.on_server_call(call)

    async def _failed(self, endpoint: Endpoint, error: TransientLLMError) -> None:
        endpoint.failed += 1
        if not any(other.up for other in self.endpoints if other is not endpoint):
            return  # the last in rotation stays: the client's backoff paces its retries
        if endpoint.up:
            logger.warning("model server %s is out of rotation: %s", endpoint.url, error)
        endpoint.up = False
        endpoint.probed_at = self._clock()  # the failure counts as the latest probe
        changed = self._condition()
        async with changed:
            changed.notify_all()  # waiters for this server must look at the others

    def _probe_due(self) -> None:
        """Start a health probe of each server out of rotation whose last probe is old enough."""
        now = self._clock()
        for endpoint in self.endpoints:
            if not endpoint.up and not endpoint.probing and now - endpoint.probed_at >= self.probe_interval_s:
                endpoint.probing = True
                endpoint.probed_at = now
                task = asyncio.get_running_loop().create_task(self._probe(endpoint))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, endpoint: Endpoint) -> None:
        healthy = getattr(endpoint.backend, "healthy", None)
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                alive = bool(await healthy()) if healthy is not None else True
        except (TimeoutError, OSError, TransientLLMError):
            alive = False
        finally:
            endpoint.probing = False
        if alive:
            logger.warning("model server %s is back in rotation", endpoint.url)
            endpoint.up = True
            changed = self._condition()
            async with changed:
                changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        # A condition belongs to one event loop; the pipeline may run each stage in its own `asyncio.run`.
        loop = asyncio.get_running_loop()
        if self._changed is None or self._loop is not loop:
            self._loop, self._changed = loop, asyncio.Condition()
            self._probes = set()
        return self._changed
