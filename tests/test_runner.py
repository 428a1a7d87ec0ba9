import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from builder.config import BuildConfig, load_config
from builder.errors import RunError
from builder.records import SeedTask, Topic
from builder.run.executor import run_stages
from builder.run.folder import INPUT_ID
from builder.run.stage import BatchStage, ItemStage, StageContext, earlier_sources
from builder.stats import StageStats
from builder.tables import from_frame

FIXTURE = Path(__file__).parent / "fixtures" / "toy_pipeline.py"
sys.path.insert(0, str(FIXTURE.parent))
import toy_pipeline  # noqa: E402


def start(run_dir: Path, calls: Path, *args: str, delay: float = 0.0, items: int = 20) -> subprocess.Popen:
    calls.mkdir(exist_ok=True)
    env = {**os.environ, "TOY_DELAY": str(delay), "TOY_ITEMS": str(items)}
    return subprocess.Popen(
        [sys.executable, str(FIXTURE), str(run_dir), str(calls), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def calls_per_input(calls: Path) -> dict[str, int]:
    return {path.name: len(path.read_text().splitlines()) for path in calls.iterdir()}


def wait_for_journal_lines(path: Path, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never reached {count} lines")


async def test_stages_write_kept_and_rejected_tables(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    stats = await run_stages(toy_pipeline.STAGES, BuildConfig(), tmp_path / "run")
    run = tmp_path / "run"
    topics = from_frame(Topic, pl.read_parquet(run / "topics.parquet").drop(INPUT_ID))
    rejected = pl.read_parquet(run / "topics.rejected.parquet")
    assert len(topics) == 15  # 20 seeds - 4 multiples of 5 - the one that raised
    assert sorted(rejected["reason"].to_list()) == ["exception:ValueError"] + ["too_round"] * 4
    raised = rejected.filter(pl.col("reason") == "exception:ValueError").row(0, named=True)
    assert "seven is unlucky" in raised["detail"]
    assert rejected.filter(pl.col("reason") == "too_round")["raw_output"].to_list() == ["{raw}"] * 4
    # Rejected records do not flow into the next stage; kept ones do.
    summary = pl.read_parquet(run / "summary.parquet")
    assert summary["description"].to_list() == ["15"]
    assert stats["topics"].inputs == 20
    assert stats["topics"].kept == 15
    assert dict(stats["topics"].dropped) == {"too_round": 4, "exception:ValueError": 1}
    assert stats["topics"].usage.calls == 20 and stats["topics"].usage.prompt_tokens == 200
    saved = json.loads((run / "stats.json").read_text())
    assert saved["stages"]["topics"]["dropped"] == {"exception:ValueError": 1, "too_round": 4}
    assert saved["stages"]["topics"]["wall_s"] > 0
    # CPU seconds of the process while the stage ran (no sandbox here): some, and no more than wall time allows on
    # this machine's cores.
    assert 0 < saved["stages"]["topics"]["cpu_s"] <= saved["stages"]["topics"]["wall_s"] * os.cpu_count() + 0.05
    assert saved["stages"]["topics"]["tokens_per_kept"] == 300 / 15  # (10 + 5) tokens x 20 calls over 15 kept
    assert (run / "config.json").exists() and json.loads((run / "run.json").read_text())["config_hash"]


async def test_a_stage_can_read_a_record_an_earlier_stage_kept(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    await run_stages(toy_pipeline.STAGES, BuildConfig(), tmp_path / "run")
    kept = from_frame(Topic, pl.read_parquet(tmp_path / "run" / "topics.parquet").drop(INPUT_ID))
    ctx = StageContext(BuildConfig(), "h", tmp_path / "run", StageStats("later"), needs={Topic: "topics"})
    assert ctx.earlier_record(Topic, kept[3].id) == kept[3]
    assert ctx.earlier_record(Topic, "topic-0000000000000000") is None
    never_ran = StageContext(BuildConfig(), "h", tmp_path / "run", StageStats("later"), needs={Topic: "plan"})
    assert never_ran.earlier_record(Topic, kept[3].id) is None  # a stage that never ran in this folder
    with pytest.raises(RunError, match="reads SeedTask records it did not declare"):
        ctx.earlier(SeedTask)


def test_a_stage_is_handed_the_records_of_the_nearest_earlier_stage_of_the_type_it_needs():
    make = BatchStage("make", lambda inputs, ctx: inputs, input=None, output=Topic)
    refine = ItemStage("refine", lambda item, ctx: item, input=Topic, output=Topic)
    use = ItemStage("use", lambda item, ctx: item, input=Topic, output=SeedTask, needs=(Topic,))
    assert earlier_sources((make, refine, use), 2) == {Topic: "refine"}
    assert earlier_sources((make, use), 1) == {Topic: "make"}
    assert earlier_sources((use,), 0) == {Topic: None}  # no stage makes them: it finds none


async def test_rerun_skips_everything_done(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    await run_stages(toy_pipeline.STAGES, BuildConfig(), tmp_path / "run")
    first = (tmp_path / "run" / "topics.parquet").read_bytes()
    before = calls_per_input(tmp_path / "calls")
    stats = await run_stages(toy_pipeline.STAGES, BuildConfig(), tmp_path / "run")
    assert calls_per_input(tmp_path / "calls") == before  # no input processed twice
    assert stats["topics"].resumed == 20 and stats["topics"].kept == 15
    assert stats["topics"].usage.calls == 20  # usage accumulates over attempts, nothing new was spent
    assert (tmp_path / "run" / "topics.parquet").read_bytes() == first  # byte-identical


async def test_until_and_only(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    run = tmp_path / "run"
    stats = await run_stages(toy_pipeline.STAGES, BuildConfig(), run, until="topics")
    assert list(stats) == ["seeds", "topics"]
    assert not (run / "summary.parquet").exists()
    stats = await run_stages(toy_pipeline.STAGES, BuildConfig(), run, only="summary")
    assert (run / "summary.parquet").exists()
    with pytest.raises(RunError, match="unknown stage 'nope'"):
        await run_stages(toy_pipeline.STAGES, BuildConfig(), run, until="nope")
    with pytest.raises(RunError, match="cannot be combined"):
        await run_stages(toy_pipeline.STAGES, BuildConfig(), run, until="seeds", only="topics")


async def test_only_needs_upstream_output(tmp_path):
    with pytest.raises(RunError, match="stage 'seeds' has no output"):
        await run_stages(toy_pipeline.STAGES, BuildConfig(), tmp_path / "run", only="topics")


async def test_run_folder_is_bound_to_its_config(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    run = tmp_path / "run"
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run, until="seeds")
    operational = load_config(None, ["llm.url=http://elsewhere/v1", "llm.max_concurrency=3"])
    await run_stages(toy_pipeline.STAGES, operational, run, until="seeds")  # allowed: same output
    with pytest.raises(RunError, match="was made with config"):
        await run_stages(toy_pipeline.STAGES, load_config(None, ["llm.temperature=0.1"]), run)


async def test_batch_stage_reruns_only_when_inputs_change(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    run = tmp_path / "run"
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    stamp = (run / "summary.parquet").stat().st_mtime_ns
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run, only="summary")
    assert (run / "summary.parquet").stat().st_mtime_ns == stamp
    # New upstream output (here: a topic row removed by hand) changes the batch stage's input fingerprint.
    topics = pl.read_parquet(run / "topics.parquet")
    topics.head(3).write_parquet(run / "topics.parquet")
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run, only="summary")
    assert pl.read_parquet(run / "summary.parquet")["description"].to_list() == ["3"]


def test_kill_9_mid_stage_then_resume_loses_only_in_flight_work(tmp_path):
    run, calls = tmp_path / "run", tmp_path / "calls"
    process = start(run, calls, delay=0.2)
    wait_for_journal_lines(run / "topics.journal.jsonl", 6)
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    journal_lines = len((run / "topics.journal.jsonl").read_text().splitlines())
    assert not (run / "topics.parquet").exists()  # killed before the stage finished

    # A torn last line (the process died mid-write) costs that one input, nothing else.
    with (run / "topics.journal.jsonl").open("a") as journal:
        journal.write('{"input": "seed-torn", "kept": [')

    process = start(run, calls, delay=0.0)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    counts = calls_per_input(calls)
    assert len(counts) == 20
    redone = [name for name, count in counts.items() if count > 1]
    # Only inputs that were in flight at the kill (concurrency 2) are processed again.
    assert len(redone) <= 2, redone
    assert sum(counts.values()) <= 20 + 2
    assert journal_lines >= 6
    topics = pl.read_parquet(run / "topics.parquet")
    rejected = pl.read_parquet(run / "topics.rejected.parquet")
    assert topics.height == 15 and rejected.height == 5
    assert topics["id"].is_unique().all()
    # The journal stays, whole: one entry per input (the torn line and the redone in-flight inputs aside).
    entries = [json.loads(line) for line in (run / "topics.journal.jsonl").read_text().splitlines()]
    assert {entry["input"] for entry in entries} == set(topics[INPUT_ID]) | set(rejected[INPUT_ID])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_and_resumes(tmp_path, signum):
    run, calls = tmp_path / "run", tmp_path / "calls"
    process = start(run, calls, delay=0.3)
    wait_for_journal_lines(run / "topics.journal.jsonl", 3)
    process.send_signal(signum)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 128 + signum, err
    assert "rerun the same command to resume" in err
    stats = json.loads((run / "stats.json").read_text())
    assert stats["stages"]["topics"]["usage"]["calls"] >= 3  # work done before the stop is accounted
    process = start(run, calls, delay=0.0)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert pl.read_parquet(run / "topics.parquet").height == 15
    assert sum(calls_per_input(calls).values()) <= 20 + 2


async def test_run_totals_and_gpu_hour_estimate(tmp_path, monkeypatch):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    config = load_config(None, ["llm.server_tok_s=50"])
    await run_stages(toy_pipeline.STAGES, config, tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "stats.json").read_text())
    assert saved["usage"]["completion_tokens"] == 100 and saved["usage"]["prompt_tokens"] == 200
    assert saved["usage"]["calls"] == 20
    assert saved["gpu_hours_estimate"] == pytest.approx(100 / 50 / 3600)
    without = tmp_path / "run2"
    await run_stages(toy_pipeline.STAGES, BuildConfig(), without)
    assert "gpu_hours_estimate" not in json.loads((without / "stats.json").read_text())


async def test_a_damaged_table_is_rebuilt_from_its_journal(tmp_path, monkeypatch, caplog):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    run = tmp_path / "run"
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    before = {name: pl.read_parquet(run / name) for name in ("topics.parquet", "topics.rejected.parquet")}
    for name in before:  # a disk that filled up mid-write: the files are cut short
        data = (run / name).read_bytes()
        (run / name).write_bytes(data[: len(data) // 2])
    calls = sum(calls_per_input(tmp_path / "calls").values())
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    for name, frame in before.items():
        assert pl.read_parquet(run / name).equals(frame)
    assert sum(calls_per_input(tmp_path / "calls").values()) == calls  # nothing was redone
    assert "topics.parquet is damaged" in caplog.text and "rebuilding it from topics.journal.jsonl" in caplog.text


@pytest.mark.parametrize("folder_kind", ["journal deleted", "made before journals were kept"])
async def test_a_damaged_table_with_no_whole_journal_says_how_to_redo_the_stage(tmp_path, monkeypatch, folder_kind):
    (tmp_path / "calls").mkdir()
    monkeypatch.setattr(toy_pipeline, "CALLS", tmp_path / "calls")
    run = tmp_path / "run"
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    if folder_kind == "journal deleted":
        (run / "topics.journal.jsonl").unlink()
    else:
        state = json.loads((run / "run.json").read_text())
        del state["journals"]
        (run / "run.json").write_text(json.dumps(state))
    (run / "topics.parquet").write_bytes(b"PAR1 cut short")
    with pytest.raises(RunError, match=r"topics\.parquet is damaged .* move topics\.parquet and topics\.rejected"):
        await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    # Following the advice redoes the stage.
    for name in ("topics.parquet", "topics.rejected.parquet", "topics.journal.jsonl"):
        (run / name).unlink(missing_ok=True)
    await run_stages(toy_pipeline.STAGES, BuildConfig(), run)
    assert pl.read_parquet(run / "topics.parquet").height == 15


async def test_the_executor_alone_persists_and_a_dropped_verdict_leaves_the_store(tmp_path):
    from builder.records import Selection
    from builder.run.stage import BatchStage
    from builder.store import Store

    config = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'store'))}"])
    keep = {"traj-a", "traj-b"}

    def selection(ctx: StageContext, subject: str) -> Selection:
        return Selection(provenance=ctx.provenance([subject]), kind="sft", split="train", subject_id=subject,
                         scenario_id="scen-1", env_id="env-1", pass_rate=0.5, num_rollouts=2)  # fmt: skip

    async def choose(_, ctx):
        return [selection(ctx, s) if s in keep else ctx.reject(s, "not_solved") for s in ("traj-a", "traj-b")]

    stages = (BatchStage("select", choose, input=None, output=Selection, persist="selections"),)
    await run_stages(stages, config, tmp_path / "run-1")
    store = Store(config.store.path)
    assert sorted(s.subject_id for s in store.read("selections")) == ["traj-a", "traj-b"]
    keep.discard("traj-b")  # a later run judges traj-b again and drops it
    await run_stages(stages, config, tmp_path / "run-2")
    assert [s.subject_id for s in store.read("selections")] == ["traj-a"]


async def test_an_item_error_rejects_its_item_with_its_reason_and_an_operator_error_stops_the_run(tmp_path):
    from builder.envs.session import SessionError
    from builder.errors import ConfigError
    from builder.llm import LLMRequestError

    async def make(_inputs, ctx):
        return [Topic(provenance=ctx.provenance(), name=f"t{i}", description="d", domain="x") for i in range(3)]

    async def judge(topic, ctx):
        if topic.name == "t0":
            raise SessionError("worker_died", "the sandbox worker died")
        if topic.name == "t1":
            raise LLMRequestError("LLM request failed after 5 attempts: HTTP 429 slow down", status_code=429)
        return [topic]

    stages = (BatchStage("make", make, input=None, output=Topic), ItemStage("judge", judge, input=Topic, output=Topic))
    stats = await run_stages(stages, BuildConfig(), tmp_path / "run")
    assert (stats["judge"].kept, dict(stats["judge"].dropped)) == (1, {"llm_request": 1, "session_failed": 1})
    rejected = pl.read_parquet(tmp_path / "run" / "judge.rejected.parquet")
    assert any("HTTP 429" in detail for detail in rejected["detail"].to_list())

    async def misconfigured(topic, ctx):
        raise ConfigError("llm.url is not a URL")

    stages = (stages[0], ItemStage("judge", misconfigured, input=Topic, output=Topic))
    with pytest.raises(ConfigError, match="not a URL"):
        await run_stages(stages, BuildConfig(), tmp_path / "run-2")
