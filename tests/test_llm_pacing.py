"""The per-server in-flight limit: climbs to a server's knee by measured throughput, and moves only on evidence."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from builder.llm.pacing import InFlightLimit


class Server:
    """A server whose throughput at `n` in flight is `rate(n)` tokens/s, driven through `limit` window by window."""

    def __init__(self, rate: Callable[[int], float]) -> None:
        self.rate = rate
        self.now = 0.0

    def windows(self, limit: InFlightLimit, count: int, *, offered: int | None = None) -> list[int]:
        seen = []
        for _ in range(count):
            in_flight = limit.current if offered is None else min(offered, limit.current)
            for _ in range(max(8, limit.current)):
                limit.started(in_flight)
                self.now += 10 / self.rate(in_flight)  # each answer is 10 tokens
                limit.answered(10)
            seen.append(limit.current)
        return seen


def knee_at(knee: int) -> Callable[[int], float]:
    return lambda n: 100.0 * min(n, knee) / knee


def test_the_limit_climbs_to_the_knee_and_settles_there() -> None:
    server = Server(knee_at(64))
    limit = InFlightLimit(16, high=256, clock=lambda: server.now)
    # Up by half while the throughput rises; 122 does no better than 81, so back to 81, the first past the knee.
    assert server.windows(limit, 12) == [24, 36, 54, 81, 122] + [81] * 7


def test_past_the_knee_it_goes_back_to_the_smaller_limit() -> None:
    server = Server(knee_at(20))
    limit = InFlightLimit(16, high=256, clock=lambda: server.now)
    assert server.windows(limit, 6) == [24, 36, 24, 24, 24, 24]


def test_a_limit_that_hurts_is_turned_round() -> None:
    # Throughput falls beyond 16 (preemption): the climb turns round and comes back down.
    server = Server(lambda n: 100.0 if n <= 16 else 100.0 * 16 / n)
    limit = InFlightLimit(16, high=256, clock=lambda: server.now)
    # 24 hurt: down again, and on while it helps; 10 did as well as 16, so it stays.
    assert server.windows(limit, 6) == [24, 16, 10, 10, 10, 10]


def test_windows_below_the_limit_say_nothing_and_move_nothing() -> None:
    server = Server(knee_at(64))
    limit = InFlightLimit(16, clock=lambda: server.now)
    assert server.windows(limit, 5, offered=4) == [16] * 5


def test_a_fixed_limit_never_moves() -> None:
    server = Server(knee_at(64))
    limit = InFlightLimit(16, fixed=True, clock=lambda: server.now)
    assert server.windows(limit, 5) == [16] * 5


def test_the_limit_stays_within_its_bounds() -> None:
    server = Server(knee_at(1000))
    limit = InFlightLimit(16, high=40, clock=lambda: server.now)
    assert max(server.windows(limit, 8)) == 40
    with pytest.raises(ValueError, match="outside"):
        InFlightLimit(50, high=40)


def test_the_kv_cache_caps_the_limit_at_the_requests_it_holds() -> None:
    now = [0.0]
    # 2,000 tokens of cache; each answer is 10 completion tokens and 90 prompt tokens: 20 requests fit.
    limit = InFlightLimit(16, high=256, kv_tokens=2000, clock=lambda: now[0])
    assert limit.ceiling == 256  # nothing answered yet: no size known
    for _ in range(3):
        for _ in range(max(8, limit.current)):
            limit.started(limit.current)
            now[0] += 10 / limit.current  # throughput grows with every request more in flight
            limit.answered(10, prompt_tokens=90)
    assert limit.ceiling == 20 and limit.current == 20  # it would have gone on to 36


def test_a_limit_above_the_cache_comes_down_when_requests_grow() -> None:
    now = [0.0]
    limit = InFlightLimit(64, high=256, kv_tokens=6400, clock=lambda: now[0])
    for _ in range(64):
        limit.started(64)
        now[0] += 0.1
        limit.answered(100, prompt_tokens=300)  # 400 tokens a request: 16 fit
    assert limit.current == 16
