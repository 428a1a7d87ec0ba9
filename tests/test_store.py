import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import polars as pl
import pytest

from builder.errors import StoreError
from builder.records import SCHEMA_VERSION, ChatMessage, Environment, Provenance, Sampling, Scenario, Trajectory
from builder.store import Store
from builder.tables import to_frame
from builder.usage import Usage
from tests.fixtures.scenarios import PROVENANCE, bank_scenario, verification


def env(provenance: Provenance, code: str, status: str = "candidate") -> Environment:
    return Environment(
        provenance=provenance,
        plan_id="plan-1",
        name="counter",
        class_name="CounterEnv",
        description="counts",
        domain="toy",
        code=code,
        tools=[],
        state_schema={},
        status=status,
    )


def scenario(provenance: Provenance, env_id: str, task: str) -> Scenario:
    return Scenario(
        provenance=provenance,
        env_id=env_id,
        mode="non_conversational",
        initial_state={"count": 0},
        task=task,
        checklist=("count is 1",),
        checks=("def check(i, f):\n    return f['count'] == 1\n",),
        gold_actions=(),
        difficulty="easy",
        verification=verification((), 1),
    )


def test_empty_store_reads_empty(tmp_path):
    store = Store(tmp_path / "store")
    assert store.environments() == []
    assert store.read_frame("scenarios").height == 0
    assert store.get("environments", "env-x") is None


def test_upsert_inserts_replaces_and_queries(tmp_path, provenance):
    store = Store(tmp_path)
    a, b = env(provenance, "a = 1"), env(provenance, "b = 2")
    assert store.upsert("environments", [a, b]) == 2
    accepted = a.model_copy(update={"status": "accepted"})
    assert store.upsert("environments", [accepted]) == 2  # same code → same id → replaced, not added
    assert [e.id for e in store.environments(status="accepted")] == [a.id]
    assert [e.id for e in store.environments(status="candidate")] == [b.id]
    assert store.get("environments", b.id) == b
    store.upsert("scenarios", [scenario(provenance, a.id, "t1"), scenario(provenance, b.id, "t2")])
    assert [s.task for s in store.scenarios(env_id=b.id)] == ["t2"]
    manifest = store.manifest()
    assert manifest["schema_version"] == SCHEMA_VERSION
    assert manifest["tables"]["environments"]["rows"] == 2
    assert manifest["tables"]["scenarios"]["rows"] == 2


def test_upsert_is_deterministic(tmp_path, provenance):
    records = [env(provenance, f"x = {i}") for i in range(5)]
    one, two = Store(tmp_path / "1"), Store(tmp_path / "2")
    one.upsert("environments", records)
    two.upsert("environments", list(reversed(records)))
    assert one.read_frame("environments").equals(two.read_frame("environments"))


def test_upsert_rejects_wrong_record_type(tmp_path, provenance):
    with pytest.raises(TypeError, match="holds Environment"):
        Store(tmp_path).upsert("environments", [scenario(provenance, "env-1", "t")])
    with pytest.raises(StoreError, match="unknown store table"):
        Store(tmp_path).read("planets")


def test_damaged_file_is_detected_and_left_untouched(tmp_path, provenance):
    store = Store(tmp_path)
    store.upsert("environments", [env(provenance, "a = 1")])
    store.upsert("environments", [env(provenance, "b = 2")])
    path = store.path("environments")
    damaged = path.read_bytes()[: len(path.read_bytes()) // 2]
    path.write_bytes(damaged)
    with pytest.raises(StoreError, match="damaged.*previous generation is kept"):
        store.environments()
    with pytest.raises(StoreError, match="damaged"):
        store.upsert("environments", [env(provenance, "c = 3")])
    assert path.read_bytes() == damaged  # nothing overwrote the evidence
    previous = pl.read_parquet(tmp_path / "environments.prev.parquet")
    assert previous.height == 1  # the last good generation survives


def test_foreign_parquet_file_is_reported(tmp_path):
    store = Store(tmp_path)
    pl.DataFrame({"x": [1]}).write_parquet(store.path("environments"))
    with pytest.raises(StoreError, match="columns"):
        store.environments()


def test_newer_schema_is_refused(tmp_path, provenance):
    store = Store(tmp_path)
    store.upsert("environments", [env(provenance, "a = 1")])
    (tmp_path / "manifest.json").write_text('{"schema_version": 99, "tables": {}}')
    with pytest.raises(StoreError, match="newer builder"):
        store.environments()


def test_crash_during_write_keeps_the_old_table(tmp_path, provenance, monkeypatch):
    store = Store(tmp_path)
    store.upsert("environments", [env(provenance, "a = 1")])
    before = store.path("environments").read_bytes()

    def crash(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(pl.DataFrame, "write_parquet", crash)
    with pytest.raises(OSError):
        store.upsert("environments", [env(provenance, "b = 2")])
    monkeypatch.undo()
    assert store.path("environments").read_bytes() == before
    assert len(store.environments()) == 1


def test_lock_blocks_a_second_writer(tmp_path, provenance):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, time
            from filelock import FileLock
            lock = FileLock({str(tmp_path / ".lock")!r}); lock.acquire()
            print("locked", flush=True); time.sleep(30)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreError, match="locked by another builder process"):
            Store(tmp_path, lock_timeout_s=0.3).upsert("environments", [env(provenance, "a = 1")])
    finally:
        holder.kill()
        holder.wait()
    Store(tmp_path, lock_timeout_s=5).upsert("environments", [env(provenance, "a = 1")])  # lock released by death


def _writer(root: str, start: int) -> None:
    provenance = Provenance(config_hash="x")
    store = Store(Path(root))
    for i in range(start, start + 15):
        store.upsert("environments", [env(provenance, f"v = {i}")])


def test_concurrent_writers_lose_nothing(tmp_path):
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_writer, args=(str(tmp_path), start)) for start in (0, 100, 200)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert len(Store(tmp_path).environments()) == 45
    assert not [name for name in os.listdir(tmp_path) if name.endswith(".tmp")]


def trajectory() -> Trajectory:
    messages = (ChatMessage(role="user", content="Move 300 cents."), ChatMessage(role="assistant", content="Done."))
    return Trajectory(
        provenance=PROVENANCE, scenario_id="scenario-a", env_id="env-a", mode="non_conversational", model="m",
        sampling=Sampling(seed=0), sample_index=0, messages=messages, tools=[], reward=1.0, solved=True,
        checks_passed=(True,), end_reason="agent_done",
    )  # fmt: skip


def test_tables_of_an_older_builder_read_with_the_columns_added_and_retired_since(tmp_path):
    # Schema 1 had no reasoning_content in the message struct; schema 2 had a `selected` column in scenarios
    # and trajectories (schema 3 keeps select's verdicts in the selections table).
    store = Store(tmp_path / "store")
    scenario = bank_scenario()
    store.upsert("scenarios", [scenario])
    old = pl.read_parquet(store.path("scenarios")).with_columns(selected=pl.lit(True))
    old.write_parquet(store.path("scenarios"))
    (back,) = store.scenarios()
    assert back == scenario
    trajectory_row = to_frame(Trajectory, [trajectory()])
    older_messages = pl.List(pl.Struct({k: v for k, v in trajectory_row.schema["messages"].inner.to_schema().items()
                                        if k != "reasoning_content"}))  # fmt: skip
    trajectory_row.with_columns(pl.col("messages").cast(older_messages)).write_parquet(store.path("trajectories"))
    (read,) = store.trajectories()
    assert read.messages == trajectory().messages and all(m.reasoning_content is None for m in read.messages)
    # Schema 3's usage had calls and tokens only: the counts added since read as 0, also in the frame exports use.
    counted = trajectory().model_copy(update={"usage": Usage(calls=2, prompt_tokens=30, completion_tokens=4)})
    kept = [pl.col("usage").struct.field(name) for name in ("calls", "prompt_tokens", "completion_tokens")]
    to_frame(Trajectory, [counted]).with_columns(pl.struct(kept).alias("usage")).write_parquet(
        store.path("trajectories")
    )
    assert store.trajectories() == [counted]
    usage = store.read_frame("trajectories")["usage"].to_list()
    assert usage == [{**Usage().model_dump(), "calls": 2, "prompt_tokens": 30, "completion_tokens": 4}]
    # A column that disappeared is not papered over: the table is reported, not guessed at.
    old.drop("task").write_parquet(store.path("scenarios"))
    with pytest.raises(StoreError, match="damaged"):
        store.scenarios()
