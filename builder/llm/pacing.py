"""How many requests one server gets in flight, set by the throughput it answers with.

A fixed number is wrong both ways: below a server's knee it leaves throughput behind (the measured 16 in flight
made 0.72 of the best), above it requests only queue for the KV cache and wait longer. `InFlightLimit` climbs:
after each window of answered requests it compares the window's completion tokens/s with the previous window's
and keeps moving the limit the way that helped and turns round when it hurt. A change within the noise means the
knee is passed: a server whose KV cache is full queues what it cannot batch, so more in flight stops paying; the
limit goes back to the smaller value, which did as well, and stays until the throughput changes.

Two ceilings bound it: `high` (llm.max_in_flight_per_server) and, when the server reports the size of its KV
cache (`kv_tokens`, from vLLM's /metrics), as many requests as the cache holds at the mean size (prompt +
completion) of the requests answered so far: beyond that vLLM preempts or queues, so more in flight cannot help.

Only windows in which the limit was reached count: a server offered fewer requests than its limit answers with
the demand's throughput, which says nothing about a higher limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# A change of throughput within this fraction is noise: the limit stays.
TOLERANCE = 0.05
# Upwards the limit grows by half (the knee is often several times the start), downwards it shrinks by a third.
GROWTH = 1.5
SHRINK = 2 / 3
MIN_WINDOW = 8  # answered requests in the shortest window: fewer give too noisy a rate


class InFlightLimit:
    """The in-flight limit of one server; `fixed` keeps it at `start` (llm.adaptive_concurrency off).

    Call `started(in_flight)` when a request is sent (with the count including it) and `answered(tokens)` when
    it is answered; `current` is the limit to keep.
    """

    def __init__(
        self,
        start: int,
        *,
        low: int = 1,
        high: int = 256,
        fixed: bool = False,
        kv_tokens: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not low <= start <= high:
            raise ValueError(f"the start limit {start} is outside [{low}, {high}]")
        self.current = start
        self.low = low
        self.high = high
        self.fixed = fixed
        self.kv_tokens = kv_tokens
        self._request_tokens = 0  # prompt + completion tokens of every answered request, for their mean size
        self._requests = 0
        self._clock = clock
        self._direction = 1
        self._previous: float | None = None  # tokens/s of the last window that counted
        self._before = start  # the limit before the last move
        self._reset()

    def started(self, in_flight: int) -> None:
        self._saturated = self._saturated or in_flight >= self.current

    @property
    def ceiling(self) -> int:
        """The most the limit may reach now: `high`, or fewer when that many requests of the mean size seen so
        far would not fit the server's KV cache."""
        if self.kv_tokens is None or not self._requests:
            return self.high
        fits = self.kv_tokens * self._requests // max(1, self._request_tokens)
        return max(self.low, min(self.high, fits))

    def answered(self, completion_tokens: int, prompt_tokens: int = 0) -> None:
        self._request_tokens += prompt_tokens + completion_tokens
        self._requests += 1
        self._tokens += completion_tokens
        self._answers += 1
        elapsed = self._clock() - self._start
        if self._answers < max(MIN_WINDOW, self.current) or elapsed <= 0:
            return
        rate = self._tokens / elapsed
        if self._saturated and not self.fixed:
            self._step(rate)
            self.current = min(self.current, self.ceiling)  # requests grew: fewer fit the cache
        self._reset()

    def _step(self, rate: float) -> None:
        previous, self._previous = self._previous, rate
        if previous is not None:
            if rate < previous * (1 - TOLERANCE):
                self._direction = -self._direction
            elif rate <= previous * (1 + TOLERANCE):
                if self._direction > 0:
                    # Past the knee: more in flight only queued. Back to the smaller limit, which did as well.
                    self._direction = -1
                    self.current, self._before = self._before, self.current
                return
        factor = GROWTH if self._direction > 0 else SHRINK
        moved = math.ceil(self.current * factor) if self._direction > 0 else math.floor(self.current * factor)
        self._before = self.current
        self.current = max(self.low, min(self.ceiling, moved))

    def _reset(self) -> None:
        self._start = self._clock()
        self._tokens = 0
        self._answers = 0
        self._saturated = False
