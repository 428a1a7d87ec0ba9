"""The sandbox benchmark runs end to end and reports the issue's JSON keys (targets are checked in docs, not
here: CI machines are shared and timing assertions would be flaky)."""

import io
import json

from builder.config import SandboxConfig
from builder.sandbox.bench import bench_sandbox

KEYS = {"inprocess_call_us", "call_p50_us", "call_p99_us", "calls_per_s", "episode_start_p50_ms",
        "check_ms_per_episode"}  # fmt: skip


def test_bench_json_has_exactly_the_documented_keys():
    out = io.StringIO()
    assert bench_sandbox(as_json=True, config=SandboxConfig(), out=out, calls=300, episodes=5) == 0
    figures = json.loads(out.getvalue())
    assert set(figures) == KEYS and all(value > 0 for value in figures.values())
    assert figures["call_p50_us"] > figures["inprocess_call_us"]


def test_bench_text_report():
    out = io.StringIO()
    bench_sandbox(out=out, calls=200, episodes=3)
    assert "sandboxed call p50/p99" in out.getvalue() and "episode start p50" in out.getvalue()
