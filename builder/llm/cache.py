"""Content-addressed response cache in SQLite, so a crashed or repeated run never pays twice for a call.

One row per cache key (see `ChatRequest.cache_key`) holding the reply as JSON. SQLite in WAL mode makes each
write an atomic transaction, so a crash leaves either the whole row or nothing, and several processes (or
threads) can share one file: readers never block, writers wait up to `busy_timeout_s` for each other.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from types import TracebackType

from builder.llm.base import Reply
from builder.llm.errors import LLMError

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    reply TEXT NOT NULL,
    created REAL NOT NULL
)
"""


class ResponseCache:
    """A reply cache in one SQLite file; `hits` and `misses` count lookups since it was opened.

    Only successful replies are stored; a failed call is retried on the next run. The first stored reply for a
    key wins, so concurrent writers of the same key cannot flip an answer under a reader.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = 60.0) -> None:
        self.path = Path(path)
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # One connection shared by the event loop's thread and helper threads; `_lock` serialises use.
            self._db = sqlite3.connect(self.path, timeout=busy_timeout_s, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: atomic and durable enough for a cache
            self._db.execute(_SCHEMA)
            self._db.commit()
        except sqlite3.DatabaseError as error:
            raise LLMError(f"cannot open the LLM response cache {self.path}: {error}") from None

    def get(self, key: str) -> Reply | None:
        """The stored reply for `key`, or None; counts a hit or a miss."""
        with self._lock:
            row = self._db.execute("SELECT reply FROM responses WHERE key = ?", (key,)).fetchone()
            if row is None:
                self.misses += 1
                return None
            self.hits += 1
        return Reply.model_validate_json(row[0])

    def put(self, key: str, reply: Reply) -> None:
        """Store `reply` under `key` unless a reply is already stored there."""
        data = reply.model_dump_json()
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO responses (key, reply, created) VALUES (?, ?, ?)",
                (key, data, time.time()),
            )
            self._db.commit()

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def stats(self) -> dict[str, int]:
        """Hit and miss counts, for the stage stats."""
        return {"cache_hits": self.hits, "cache_misses": self.misses}

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> ResponseCache:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
