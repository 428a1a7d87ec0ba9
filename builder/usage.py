"""The one usage ledger: what model calls cost, counted by one rule everywhere (`Usage`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from builder.frozen import Frozen


class Usage(Frozen):
    """Model usage by the one rule every count in builder follows: a stage's `stats.json`, the client's `totals`,
    an environment's `evaluation.usage`, a trajectory's `usage` and the dataset card. Sums with `+`.

    - `calls`: requests the model server answered. A cut reply asked again with a grown budget is one more call;
      a request retried after a transient failure (connection, timeout, 5xx) is one call.
    - `cached_calls`: requests answered from the run's response cache. The attempt that first asked them paid
      for them (and counted them then), so a cache hit counts here and nowhere else.
    - `failed_calls`: requests that got no reply: refused by the server, or still failing after the retries.
    - `regrowths`: of the requests sent (`calls` and `failed_calls`), those that re-asked a cut reply with a
      grown completion budget.
    - `retries`: of the requests sent (`calls` and `failed_calls`), the tries after the first that transient
      failures (HTTP 429 or 5xx, a dropped connection, a timeout, an unreadable body) made necessary: a request
      answered at its third try is one call and two retries.
    - `prompt_tokens`, `completion_tokens`: what the server reported for `calls`; a failed request reports none.

    So `calls` and the tokens are what the run paid for, every request counts in exactly one of `calls`,
    `cached_calls` and `failed_calls`, and a resumed run adds no cost twice. A record's usage is thus what its
    run paid for it: one redone after an interruption (or asking what another item had just asked) shows the
    replayed requests as `cached_calls`. One request's entry is `builder.llm.CallRecord.usage`; everything else
    is a sum of such entries.
    """

    calls: int = 0
    cached_calls: int = 0
    failed_calls: int = 0
    regrowths: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(**{name: getattr(self, name) + getattr(other, name) for name in Usage.model_fields})

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens together."""
        return self.prompt_tokens + self.completion_tokens


class Tally:
    """The usage of the requests made inside one `tally()` block (mutable: each request adds to it)."""

    def __init__(self) -> None:
        self.usage = Usage()


_TALLIES: ContextVar[tuple[Tally, ...]] = ContextVar("usage_tallies", default=())


@contextmanager
def tally() -> Iterator[Tally]:
    """Count the usage of every request an `LLMClient` makes inside this block, in this task and the asyncio
    tasks it starts (they inherit the context): what one piece of work costs, e.g. one scenario slot, while the
    client's `totals` and `on_call` keep the stage's ledger. Blocks nest; each counts its own."""
    counted = Tally()
    token = _TALLIES.set((*_TALLIES.get(), counted))
    try:
        yield counted
    finally:
        _TALLIES.reset(token)


def add_to_tallies(usage: Usage) -> None:
    """Add one request's usage to every open `tally()` block (the client calls it with each `CallRecord`)."""
    for counted in _TALLIES.get():
        counted.usage += usage
