"""The deterministic world of a sandbox episode: a fixed clock and seeded randomness (stdlib only).

Generated tools stamp records with `datetime.now()` and make ids with `uuid.uuid4()`. With the real clock and
entropy two runs of the same calls differ (the determinism gates fail for no fault of the task) and "today" is the
day the run happens, not the scenario's. So inside a worker:

- `datetime.datetime.now()/today()/utcnow()`, `datetime.date.today()`, `time.time()/time_ns()`,
  `time.clock_gettime(CLOCK_REALTIME)`, and `time.localtime/gmtime/ctime/asctime/strftime` without a time
  argument all read the episode's `now`. The clock is frozen: every read returns exactly `now`, however many
  reads a call makes. A clock advancing per read would also replay identically, but only for the same sequence
  of reads: the session's crash recovery replays calls without the failed one, checks read the clock on their
  own, and stamps like `09:00:00.000003` match nothing the agent was told. The cost: a tool that waits for the
  clock to move never returns (it times out), and ids made from the clock collide.
- `random` (the module-level functions, and any `random.Random()` or `random.seed()` without a seed) is seeded
  from the episode seed; `uuid.uuid4()` and `uuid.uuid1()` draw from their own stream of that seed, so adding
  a uuid call does not shift the `random` draws.
- The sandbox's local time zone is UTC (`TZ=UTC` in the runtime's clean environment), so `now` is local time
  and UTC alike, on every machine.

`datetime` and `date` are C types that refuse new attributes, so `install` writes the replacement class methods
into the types' own dicts: they stay the real classes (isinstance, `type(x) is datetime`, subclasses, pickling,
arithmetic, isoformat all behave as before) and no unpatched base class sits behind them. Known limits, all
closed to linted code (no dunder access, no `os`): the originals stay reachable through the replacements'
`__globals__`; `time.monotonic/perf_counter/process_time` (durations, not dates) and `random.SystemRandom`
(entropy by design) stay real, so code that stores them is nondeterministic and the determinism gates say so.

The zygote calls `install()` once after preloading (before any worker forks) and each worker calls `begin(now,
seed)` when a `load` or `check` request arrives. The parent imports only `DEFAULT_NOW`, `DEFAULT_SEED`,
`parse_now`, `describe_now` and `derive_seed` from here.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import hashlib
import random
import time
import uuid
from typing import Any

DEFAULT_NOW = "2024-06-01T09:00:00"  # a Saturday morning; any fixed moment works, this one is documented
DEFAULT_SEED = 0


def parse_now(text: str) -> datetime.datetime:
    """The naive local date-time of an ISO 8601 `YYYY-MM-DDTHH:MM[:SS[.ffffff]]`; raises ValueError otherwise."""
    if not isinstance(text, str) or len(text) < 16 or text[10:11] != "T":
        raise ValueError(f"now must be an ISO 8601 date-time like {DEFAULT_NOW!r}, not {text!r}")
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError as error:  # an impossible date such as 2024-02-30, or no date-time at all
        raise ValueError(f"now {text!r} is not an ISO 8601 date-time: {error}") from None
    if moment.tzinfo is not None:
        raise ValueError(f"now must be a naive local date-time (no time zone), not {text!r}")
    if not 1971 <= moment.year <= 2999:
        raise ValueError(f"now must lie between the years 1971 and 2999, not {text!r}")
    return moment


def normalized_now(text: str) -> str:
    """`text` (a model's "today") as `YYYY-MM-DDTHH:MM:SS`; raises ValueError starting with "now:" otherwise."""
    try:
        return parse_now(text).isoformat(timespec="seconds")
    except ValueError as error:
        raise ValueError(f"now: {error}") from None


def describe_now(now: str) -> str:
    """`now` as prompts show it, with its weekday so that "tomorrow" and "next Monday" come out right."""
    return f"{now} ({parse_now(now):%A})"


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts (ids, indexes), the same on every machine and Python run."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


# ----------------------------------------------------------------------------------------- inside a worker

_real_clock_gettime = time.clock_gettime
_real_clock_gettime_ns = time.clock_gettime_ns
_real_localtime, _real_gmtime, _real_strftime = time.localtime, time.gmtime, time.strftime
_real_asctime = time.asctime
_real_seed = random.Random.seed
_real_uuid1 = uuid.uuid1


class _Episode:
    """The clock and seeds of the running episode (one per worker process)."""

    timestamp_ns = 0
    seed = DEFAULT_SEED
    unseeded = 0  # Random objects (and random.seed() calls) that asked for entropy so far
    uuids = random.Random(0)


def begin(now: str, seed: int) -> None:
    """Start an episode at `now` with `seed`: set the clock, reseed `random` and the uuid stream."""
    moment = parse_now(now)
    # A naive moment is local time (UTC in the sandbox); whole seconds convert exactly, microseconds are added.
    seconds = int(moment.replace(microsecond=0).timestamp())
    _Episode.timestamp_ns = seconds * 10**9 + moment.microsecond * 1000
    _Episode.seed, _Episode.unseeded = int(seed), 0
    _real_seed(_Episode.uuids, f"{seed}/uuid")
    random.seed(int(seed))
    uuid._last_timestamp = None  # type: ignore[attr-defined]  # uuid1's monotonic guard restarts with the clock


def _time() -> float:
    return _Episode.timestamp_ns / 1e9


def _time_ns() -> int:
    return _Episode.timestamp_ns


def _clock_gettime(clock: int) -> float:
    return _time() if clock == time.CLOCK_REALTIME else _real_clock_gettime(clock)


def _clock_gettime_ns(clock: int) -> int:
    return _time_ns() if clock == time.CLOCK_REALTIME else _real_clock_gettime_ns(clock)


def _localtime(seconds: float | None = None) -> time.struct_time:
    return _real_localtime(_time() if seconds is None else seconds)


def _gmtime(seconds: float | None = None) -> time.struct_time:
    return _real_gmtime(_time() if seconds is None else seconds)


def _ctime(seconds: float | None = None) -> str:
    return _real_asctime(_localtime(seconds))


def _asctime(moment: Any = None) -> str:
    return _real_asctime(_localtime() if moment is None else moment)


def _strftime(format: str, moment: Any = None) -> str:  # noqa: A002 - time.strftime's own parameter name
    return _real_strftime(format, _localtime() if moment is None else moment)


def _now(cls: type, tz: datetime.tzinfo | None = None) -> Any:
    return cls.fromtimestamp(_time(), tz)  # exactly how datetime.py defines now(), on the episode's clock


def _utcnow(cls: type) -> Any:
    return cls.fromtimestamp(_time(), datetime.UTC).replace(tzinfo=None)


def _today(cls: type) -> Any:
    return cls.fromtimestamp(_time())


def _seed(self: random.Random, a: Any = None, version: int = 2) -> None:
    if a is None:  # entropy asked for: the next seed of the episode's sequence instead
        _Episode.unseeded += 1
        a = f"{_Episode.seed}/random/{_Episode.unseeded}"
    _real_seed(self, a, version)


def _uuid4() -> uuid.UUID:
    return uuid.UUID(bytes=_Episode.uuids.randbytes(16), version=4)


def _uuid1(node: int | None = None, clock_seq: int | None = None) -> uuid.UUID:
    # With both given, uuid1 takes its pure-Python path, whose timestamp comes from time.time_ns(): the clock.
    if node is None:
        node = _Episode.uuids.getrandbits(48) | 1 << 40  # the multicast bit marks a random node (RFC 4122 4.5)
    if clock_seq is None:
        clock_seq = _Episode.uuids.getrandbits(14)
    return _real_uuid1(node=node, clock_seq=clock_seq)


def _set_type_attribute(cls: type, name: str, value: Any) -> None:
    """`setattr` for an immutable (C) type: write its dict directly, then invalidate the method caches."""
    gc.get_referents(cls.__dict__)[0][name] = value
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(cls))


def install() -> None:
    """Route the clock and entropy of `datetime`, `time`, `random` and `uuid` through the episode (once)."""
    _set_type_attribute(datetime.datetime, "now", classmethod(_now))
    _set_type_attribute(datetime.datetime, "utcnow", classmethod(_utcnow))
    _set_type_attribute(datetime.date, "today", classmethod(_today))
    replacements = {
        "time": _time, "time_ns": _time_ns, "clock_gettime": _clock_gettime, "clock_gettime_ns": _clock_gettime_ns,
        "localtime": _localtime, "gmtime": _gmtime, "ctime": _ctime, "asctime": _asctime, "strftime": _strftime,
    }  # fmt: skip
    for name, function in replacements.items():
        function.__name__ = function.__qualname__ = name
        setattr(time, name, function)
    random.Random.seed = _seed  # type: ignore[method-assign]
    random.seed = random._inst.seed  # type: ignore[attr-defined]  # bound at import time to the original
    uuid.uuid4, uuid.uuid1 = _uuid4, _uuid1
    _uuid4.__name__ = _uuid4.__qualname__ = "uuid4"
    _uuid1.__name__ = _uuid1.__qualname__ = "uuid1"
    begin(DEFAULT_NOW, DEFAULT_SEED)
