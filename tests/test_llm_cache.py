"""The SQLite response cache: shared by processes, intact after a crash mid-write."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from builder.llm import Reply, ResponseCache

WRITER = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from builder.llm import Reply, ResponseCache
cache = ResponseCache(Path({path!r}))
print("ready", flush=True)
for i in range({count}):
    cache.put(f"{prefix}-{{i}}", Reply(content="x" * 2000 + str(i)))
    cache.put("shared", Reply(content="{prefix}"))
"""


def writer(path: Path, prefix: str, count: int) -> subprocess.Popen[str]:
    root = str(Path(__file__).resolve().parents[1])
    code = WRITER.format(root=root, path=str(path), prefix=prefix, count=count)
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_processes_share_one_cache_file(tmp_path: Path) -> None:
    path = tmp_path / "llm_cache.sqlite"
    writers = [writer(path, prefix, 60) for prefix in ("a", "b", "c")]
    assert [process.wait(timeout=120) for process in writers] == [0, 0, 0]
    with ResponseCache(path) as cache:
        assert len(cache) == 3 * 60 + 1
        assert cache.get("b-59") == Reply(content="x" * 2000 + "59")
        first = cache.get("shared")
        assert first is not None and first.content in {"a", "b", "c"}  # the first writer won, once
        assert cache.stats() == {"cache_hits": 2, "cache_misses": 0}
        assert cache.get("missing") is None and cache.misses == 1


def test_cache_survives_a_crash_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "llm_cache.sqlite"
    process = writer(path, "k", 100_000)
    time.sleep(1.0)
    process.send_signal(signal.SIGKILL)
    process.wait()
    with ResponseCache(path) as cache:
        stored = len(cache)
        assert stored > 0
        assert cache.get(f"k-{stored - 2}") is not None
    assert sqlite3.connect(path).execute("PRAGMA integrity_check").fetchone() == ("ok",)
