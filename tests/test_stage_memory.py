"""A stage's memory does not grow with its table: its inputs, the earlier records it looks up and its end (compacting
the journal, counting, upserting into the store) hold tables as columns, and a record only for the rows at hand."""

import json
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import polars as pl
import pytest

from builder import tables
from builder.config import load_config
from builder.records import Environment, SeedTask, Topic
from builder.run.executor import run_stages
from builder.run.folder import RunFolder
from builder.run.stage import BatchStage, ItemStage, StageContext
from builder.stats import StageStats
from builder.store import Store
from builder.tables import RecordsById, from_frame, schema, to_frame

ENVIRONMENTS = 1_000
CODE_CHARS = 3_000  # a generated environment's code is several kilobytes; 1,000 of them are 3 MB of text


def _code(index: int) -> str:
    lines = [
        f"    def tool_{index}_{n}(self, record_id: str) -> dict:\n        return {{'id': record_id}}\n"
        for n in range(40)
    ]
    return (f"class Desk{index}Env:\n" + "".join(lines))[:CODE_CHARS]


async def _seeds(_, ctx):
    return [SeedTask(provenance=ctx.provenance(), source="memory", source_ref=str(i), request=f"desk {i}")
            for i in range(ENVIRONMENTS)]  # fmt: skip


async def _environment(seed: SeedTask, ctx):
    index = int(seed.source_ref)
    return [Environment(provenance=ctx.provenance([seed]), plan_id=f"plan-{index}", name=f"desk_{index}",
                        class_name=f"Desk{index}Env", description="a lending desk", domain="library",
                        code=_code(index), tools=[], state_schema={}, status="accepted")]  # fmt: skip


STAGES = (
    BatchStage("seeds", _seeds, input=None, output=SeedTask),
    ItemStage("code", _environment, input=SeedTask, output=Environment, persist="environments"),
)


async def test_an_item_stage_over_many_records_peaks_below_its_tables_size(tmp_path):
    """The old stage end held the journal's rows, then the kept table as records and as rows again for the store:
    several copies of the whole table at once (with 600 environments, a peak of 8 MB; 1.6 MB now, and no more with
    1,000: a slice of rows at a time)."""
    config = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'store'))}"])
    await run_stages(STAGES, config, tmp_path / "run", until="seeds")
    tracemalloc.start()
    try:
        stats = await run_stages(STAGES, config, tmp_path / "run", only="code")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert stats["code"].kept == ENVIRONMENTS
    table_chars = ENVIRONMENTS * CODE_CHARS
    assert peak < table_chars, f"peak {peak / 1e6:.1f} MB for {table_chars / 1e6:.1f} MB of code"
    stored = Store(config.store.path).read_frame("environments")
    assert sorted(stored["code"].to_list()) == sorted(_code(index) for index in range(ENVIRONMENTS))


async def test_an_item_stage_makes_a_record_of_an_input_only_when_it_starts(tmp_path, monkeypatch):
    async def seeds(_, ctx):
        return [
            SeedTask(provenance=ctx.provenance(), source="s", source_ref=str(i), request=f"r{i}") for i in range(30)
        ]

    async def topic(seed: SeedTask, ctx):
        made_when_started.append(len(made))
        return [Topic(provenance=ctx.provenance([seed]), name=seed.request, description="d", domain="x")]

    stages = (BatchStage("seeds", seeds, input=None, output=SeedTask),
              ItemStage("topics", topic, input=SeedTask, output=Topic, concurrency=lambda config: 1))  # fmt: skip
    await run_stages(stages, load_config(None, []), tmp_path / "run", until="seeds")
    made: list[str] = []
    made_when_started: list[int] = []
    build = tables.from_row

    def counting(record_type, row):
        if record_type is SeedTask:
            made.append(row["id"])
        return build(record_type, row)

    monkeypatch.setattr(tables, "from_row", counting)
    stats = await run_stages(stages, load_config(None, []), tmp_path / "run", only="topics")
    assert stats["topics"].kept == 30
    # One input in flight: the first started with one input made, the last with all thirty, not all from the start.
    assert made_when_started == list(range(1, 31))


async def test_the_earlier_records_are_read_once_however_many_threads_look_them_up_at_once(tmp_path, monkeypatch):
    """Rollout looks the environment up from its episodes' threads: each read the whole table, a copy apiece."""
    await run_stages(STAGES[:1], load_config(None, []), tmp_path / "run")
    reads: list[str] = []
    kept = RunFolder.kept

    def slow_kept(self, stage, record_type):
        reads.append(stage)
        time.sleep(0.05)  # wide enough for every thread to arrive while the first reads
        return kept(self, stage, record_type)

    monkeypatch.setattr(RunFolder, "kept", slow_kept)
    ctx = StageContext(load_config(None, []), "h", tmp_path / "run", StageStats("later"), needs={SeedTask: "seeds"})
    wanted = from_frame(SeedTask, pl.read_parquet(tmp_path / "run" / "seeds.parquet").drop("input_id"))[:8]
    start = threading.Barrier(8)

    def look_up(seed: SeedTask) -> SeedTask | None:
        start.wait()
        return ctx.earlier_record(SeedTask, seed.id)

    with ThreadPoolExecutor(8) as threads:
        found = list(threads.map(look_up, wanted))
    assert found == wanted and reads == ["seeds"]


def test_records_by_id_builds_a_record_only_when_it_is_looked_up(provenance, monkeypatch):
    seeds = [SeedTask(provenance=provenance, source="s", source_ref=str(i), request=f"r{i}") for i in range(5)]
    by_id = RecordsById(SeedTask, to_frame(SeedTask, seeds))
    built: list[str] = []
    build = tables.from_row
    monkeypatch.setattr(tables, "from_row", lambda record_type, row: built.append(row["id"]) or build(record_type, row))
    assert len(by_id) == 5 and set(by_id) == {seed.id for seed in seeds}
    assert seeds[2].id in by_id and "seed-missing" not in by_id and built == []
    assert by_id[seeds[2].id] == seeds[2] and by_id.get("seed-missing") is None and built == [seeds[2].id]
    with pytest.raises(KeyError):
        by_id["seed-missing"]
    assert dict(by_id.items()) == {seed.id: seed for seed in seeds}


def test_a_journal_line_with_a_unicode_line_separator_is_one_entry(tmp_path, provenance, caplog):
    """`str.splitlines` also splits at U+2028 and U+2029, which `json.dumps(ensure_ascii=False)` writes as they are:
    such a line was read as two torn halves, and its input lost and redone."""
    folder = RunFolder(tmp_path)
    seed = SeedTask(provenance=provenance, source="s", source_ref="0", request="first line\u2028second\u2029third")
    with folder.appending("seeds") as journal:
        folder.append(journal, "in-0", [seed])
    folder.compact("seeds", SeedTask)
    assert folder.read("seeds", SeedTask) == [seed] and folder.done_inputs("seeds", SeedTask) == {"in-0"}
    assert "torn" not in caplog.text


@pytest.mark.parametrize("torn_bytes", [10, 200_000])
def test_a_torn_last_line_longer_than_a_block_is_cut_back_to_the_last_whole_one(tmp_path, provenance, torn_bytes):
    folder = RunFolder(tmp_path)
    seeds = [SeedTask(provenance=provenance, source="s", source_ref=str(i), request="r" * 100_000) for i in range(2)]
    with folder.appending("seeds") as journal:
        for index, seed in enumerate(seeds):
            folder.append(journal, f"in-{index}", [seed])
    whole = folder.journal("seeds").read_bytes()
    with folder.journal("seeds").open("ab") as journal:
        journal.write(b'{"input": "in-2", "kept": [{"request": "' + b"x" * torn_bytes)
    with folder.appending("seeds") as journal:
        folder.append(journal, "in-3", [seeds[0]])
    assert folder.journal("seeds").read_bytes().startswith(whole)
    assert folder.done_inputs("seeds", SeedTask) == {"in-0", "in-1", "in-3"}


def test_a_journal_torn_within_its_first_line_starts_over(tmp_path):
    folder = RunFolder(tmp_path)
    folder.journal("seeds").write_bytes(b'{"input": "in-0", "kept": [' + b"x" * 100_000)
    with folder.appending("seeds"):
        pass
    assert folder.journal("seeds").read_bytes() == b""


def test_the_store_takes_a_frame_in_its_tables_schema_as_it_takes_the_records(tmp_path, provenance):
    environments = [Environment(provenance=provenance, plan_id=f"p{i}", name=f"e{i}", class_name="E", description="d",
                                domain="x", code=_code(i), tools=[], state_schema={}) for i in range(3)]  # fmt: skip
    as_records, as_frame = Store(tmp_path / "a"), Store(tmp_path / "b")
    assert as_records.upsert("environments", environments) == as_frame.upsert(
        "environments", to_frame(Environment, environments)
    )
    assert as_records.read_frame("environments").equals(as_frame.read_frame("environments"))
    assert as_frame.environments() == sorted(environments, key=lambda env: env.id)
    with pytest.raises(TypeError, match="columns differ"):
        as_frame.upsert("environments", to_frame(Environment, environments).drop("code"))
    with pytest.raises(TypeError, match="columns differ"):
        as_frame.upsert("scenarios", to_frame(Environment, environments))
    assert schema(Environment) == to_frame(Environment, environments).schema
