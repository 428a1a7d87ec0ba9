"""How many requests one server gets in flight, set by the throughput it answers with.

A fixed number is wrong both ways: below a server's knee it leaves throughput behind (the measured 16 in flight
made 0.72 of the best), and a limit below the load builder offers makes the rest of the requests wait inside
builder, where the server cannot start them (measured: 0.89 of the server's best, and requests waiting 9.5 s in
the client, when the limit had settled below the 64 offered). Above the knee a server with a KV cache to spare
only queues what it cannot batch yet: the same wait as in builder, but without a round trip before each request
starts. So `InFlightLimit` moves by trial, window by window (at least MIN_WINDOW answered requests, at least the
limit), comparing each window's completion tokens/s with the rate at the limit it came from (the reference):

- a move up is kept when throughput held level or rose (the requests it let through wait in the server's queue
  instead of builder's); it is made only while requests wait for a slot (the offered load is above the limit);
- a move down is kept only when throughput rose by more than the noise (a server that preempts: fewer do more);
- whenever the smaller of the two limits did better, the larger is not given up on one window: the old limit is
  measured again, and the smaller must have done better than the larger on both sides in time (a machine that
  slows down under other work makes every move up look worse than the window before it);
- a move not kept goes back to the limit it came from, and the next move tries the other way; the reference is
  that limit's rate, never a window that lost (comparing with a chance low window would make the next move
  look good and ratchet the limit down on noise);
- after both ways have failed the limit is settled and stays while the throughput stays within the noise.

Two ceilings bound it: `high` (llm.max_in_flight_per_server) and, when the server reports the size of its KV
cache (`kv_tokens`, from vLLM's /metrics), as many requests as the cache holds at the mean size (prompt +
completion) of the requests answered so far: beyond that vLLM preempts or queues, so more in flight cannot help.

Only windows in which the limit was reached count: a server offered fewer requests than its limit answers with
the demand's throughput, which says nothing about another limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# A change of throughput within this fraction is noise.
TOLERANCE = 0.05
# Upwards the limit grows by half (the knee is often several times the start), downwards it shrinks by a third.
GROWTH = 1.5
SHRINK = 2 / 3
MIN_WINDOW = 8  # answered requests in the shortest window: fewer give too noisy a rate
SETTLE_AFTER = 2  # moves not kept in a row (one each way) before the limit settles


class InFlightLimit:
    """The in-flight limit of one server; `fixed` keeps it at `start` (llm.adaptive_concurrency off).

    Call `started(in_flight)` when a request is sent (with the count including it), `waiting(count)` when
    requests wait because the server is at its limit, and `answered(tokens)` when one is answered; `current` is the
    limit to keep.
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
        self._direction = 1  # the way the next move goes
        self._from = start  # the limit the last move left (== current: no move pending)
        self._reference: float | None = None  # tokens/s measured at `_from`
        self._failed = 0  # moves in a row that were not kept
        self._pending: tuple[int, float] | None = None  # a move that looked worse than its limit: (limit, rate)
        self._reset()

    def started(self, in_flight: int) -> None:
        self._saturated = self._saturated or in_flight >= self.current

    def waiting(self, count: int) -> None:
        """`count` requests wait for a slot because this server is at its limit: the offered load is the limit
        plus them."""
        self._offered = max(self._offered, self.current + count)

    @property
    def settled(self) -> bool:
        return self._failed >= SETTLE_AFTER

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
            self._judge(rate)
        if self.current > self.ceiling:  # requests grew: fewer fit the cache
            self.current = self._from = self.ceiling
            self._reference = self._pending = None
        self._reset()

    def _judge(self, rate: float) -> None:
        """Keep or undo the last move by the window's `rate`, then make the next one."""
        reference = self._reference
        if self._pending is not None:  # this window measured the old limit again, after the move
            moved, moved_rate = self._pending
            self._pending = None
            self._reference = rate
            if _smaller_did_better(moved, moved_rate, self.current, rate) == (moved > self.current):
                self._fail()  # the smaller limit did better on both sides in time: the move really was worse
            else:  # the machine changed, not the move (up), or the move down did better on both sides
                self._failed = 0
                self.current = self._from = moved
                self._reference = moved_rate
                self._move()
            return
        if reference is None or self.current == self._from:  # no move to judge: this window is the reference
            if self.settled and reference is not None and abs(rate - reference) <= TOLERANCE * reference:
                return  # settled, and nothing has changed
            self._failed = 0
            self._reference = rate
            self._move()
            return
        up = self.current > self._from
        if _smaller_did_better(self.current, rate, self._from, reference):
            # Before the limit comes down on it, the old limit is measured again: a machine that slowed (or sped
            # up) between the two windows says nothing about the limits.
            self._pending = (self.current, rate)
            self.current = self._from
        elif up:  # level or better with more in flight: kept
            self._failed = 0
            self._from, self._reference = self.current, rate
            self._move()
        else:  # fewer in flight did no better: back, the old limit's rate stays the reference
            self._fail()

    def _fail(self) -> None:
        """Undo the last move and try the other way next (or settle, when both ways failed)."""
        self._failed += 1
        self.current = self._from
        self._direction = -self._direction
        if not self.settled:
            self._move()

    def _move(self) -> None:
        """Move the limit one step the current way (`_from` keeps where it was); up only while requests wait for
        a slot and the ceiling allows, else down (a server that preempts does more with fewer)."""
        self._from = self.current
        if self._direction > 0 and (self._offered <= self.current or self.current >= self.ceiling):
            if self._failed:  # back from a move down that was not kept, and up is no use: settled here
                self._failed = SETTLE_AFTER
                return
            self._direction = -1
        if self._direction > 0:
            self.current = min(self.ceiling, math.ceil(self.current * GROWTH))
        else:
            self.current = max(self.low, math.floor(self.current * SHRINK))

    def _reset(self) -> None:
        self._start = self._clock()
        self._tokens = 0
        self._answers = 0
        self._saturated = False
        self._offered = 0  # the most requests that wanted this server at once, when more than its limit did


def _smaller_did_better(one: int, one_rate: float, other: int, other_rate: float) -> bool:
    """Whether the smaller of two limits made more tokens/s than the larger, by more than the noise."""
    (_, small), (_, large) = sorted([(one, one_rate), (other, other_rate)])
    return small > large * (1 + TOLERANCE)
