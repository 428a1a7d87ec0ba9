"""The sandbox benchmark runs end to end and reports the issue's JSON keys (targets are checked in docs, not
here: CI machines are shared and timing assertions would be flaky)."""

import io
import json

from builder.config import SandboxConfig
from builder.sandbox.bench import bench_sandbox, sized_state

SMALL = {"2kb": 2_000, "1mb": 1_000_000}
KEYS = {"inprocess_call_us", "call_p50_us", "call_p99_us", "calls_per_s", "episode_start_p50_ms",
        "check_ms_per_episode"} | {f"{figure}_{label}" for figure in ("load_ms", "calls_per_s", "snapshot_ms",
                                                                      "diff_ms") for label in SMALL}  # fmt: skip


def test_bench_json_has_exactly_the_documented_keys():
    out = io.StringIO()
    assert bench_sandbox(as_json=True, config=SandboxConfig(), out=out, calls=300, episodes=5, sizes=SMALL,
                         sized_calls=50) == 0  # fmt: skip
    figures = json.loads(out.getvalue())
    assert set(figures) == KEYS and all(value > 0 for value in figures.values())
    assert figures["call_p50_us"] > figures["inprocess_call_us"]


def test_bench_text_report():
    out = io.StringIO()
    bench_sandbox(out=out, calls=200, episodes=3, sizes=SMALL, sized_calls=20)
    assert "sandboxed call p50/p99" in out.getvalue() and "episode start p50" in out.getvalue()
    assert "state   1mb: load" in out.getvalue()


def test_sized_state_has_about_the_asked_size():
    for size in (2_000, 1_000_000):
        assert size <= len(json.dumps(sized_state(size))) < size * 1.3
