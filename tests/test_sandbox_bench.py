"""The sandbox benchmark runs end to end and reports the issue's JSON keys (targets are checked in docs, not
here: CI machines are shared and timing assertions would be flaky)."""

import io
import json

from builder.config import SandboxConfig
from builder.sandbox.bench import bench_sandbox, sized_state

SMALL = {"2kb": 2_000, "1mb": 1_000_000}
KEYS = {"inprocess_call_us", "call_p50_us", "call_p99_us", "calls_per_s", "episode_start_p50_ms",
        "check_ms_per_episode", "replay_ratio"} | {
    f"{figure}_{label}" for figure in ("load_ms", "calls_per_s", "snapshot_ms", "diff_ms", "replay_s",
                                       "replay_step_ms") for label in SMALL}  # fmt: skip


def test_bench_json_has_exactly_the_documented_keys():
    out = io.StringIO()
    assert bench_sandbox(as_json=True, config=SandboxConfig(), out=out, calls=300, episodes=5, sizes=SMALL,
                         sized_calls=50, replay_sizes=SMALL, replay_calls=20, replay_repeats=1) == 0  # fmt: skip
    figures = json.loads(out.getvalue())
    assert set(figures) == KEYS and all(value > 0 for value in figures.values())
    assert figures["call_p50_us"] > figures["inprocess_call_us"]


def test_bench_text_report():
    out = io.StringIO()
    bench_sandbox(out=out, calls=200, episodes=3, sizes=SMALL, sized_calls=20, replay_sizes=SMALL, replay_calls=20,
                  replay_repeats=1)  # fmt: skip
    text = out.getvalue()
    assert "sandboxed call p50/p99" in text and "episode start p50" in text
    assert "state   1mb: load" in text
    replay = next(line for line in text.splitlines() if line.startswith("replay of 20 calls"))
    assert "2kb" in replay and "1mb" in replay and "1mb/2kb = " in replay and "x (target <= 3x)" in replay
    assert "call + snapshot + diff, per call: 2kb" in text


def test_sized_state_has_about_the_asked_size():
    for size in (2_000, 1_000_000):
        assert size <= len(json.dumps(sized_state(size))) < size * 1.3
