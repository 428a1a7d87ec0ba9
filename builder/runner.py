"""The resumable stage runner: stages in order over a run folder, one Parquet table per stage.

A stage reads the kept records of the stage before it and writes `<stage>.parquet` (kept) and
`<stage>.rejected.parquet` (rejections with reason codes). Item stages process each input on its own,
concurrently; each finished input is appended to `<stage>.journal.jsonl` at once, so after a crash or `kill -9`
a rerun redoes only the inputs that were in flight. Batch stages (de-duplication, splits) see all inputs at once
and rerun whole when their inputs change.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import polars as pl
from tqdm import tqdm

from builder import __version__
from builder.config import BuildConfig, config_hash
from builder.errors import BuilderError, RunError
from builder.llm.accounting import estimate_gpu_hours
from builder.records import Provenance, Record, Rejection, Sampling
from builder.stats import StageStats, load_stats, save_stats
from builder.tables import from_frame, from_row, schema, to_row, write_parquet_atomic

logger = logging.getLogger(__name__)

INPUT_ID = "input_id"  # bookkeeping column of run-folder tables: which input a row came from
R = TypeVar("R", bound=Record)


@dataclass
class StageContext:
    """Everything a stage function may use. Stages get their dependencies here and nowhere else."""

    config: BuildConfig
    config_hash: str
    run_dir: Path
    stats: StageStats
    llm: Any = None  # the model (`chat`, `structured`, `model_id`), when the pipeline has one
    rl_agent: Any = None  # the RL agent's model (rollout.rl_agent_model), when the pipeline has one
    open_sandbox: Callable[[], Any] | None = None  # returns the shared `Sandbox`, starting it on first use

    @property
    def sandbox(self) -> Any:
        """The shared sandbox runtime (`builder.sandbox.Sandbox`); its blocking calls belong in a thread."""
        if self.open_sandbox is None:
            raise RunError(f"stage {self.stage!r} needs the sandbox, but this pipeline has none")
        return self.open_sandbox()

    @property
    def stage(self) -> str:
        return self.stats.stage

    def provenance(
        self,
        parents: Sequence[Record | str] = (),
        *,
        model: str | None = None,
        sampling: Sampling | None = None,
        prompt_version: str | None = None,
    ) -> Provenance:
        """Provenance for a record this stage makes, stamped with the builder version and config hash."""
        return Provenance(
            builder_version=__version__,
            config_hash=self.config_hash,
            model=model,
            sampling=sampling,
            prompt_version=prompt_version,
            parent_ids=tuple(p if isinstance(p, str) else p.id for p in parents),
        )

    def earlier_record(self, stage: str, record_type: type[R], record_id: str) -> R | None:
        """The record `record_id` an earlier `stage` of this run kept (None: that stage kept no such record).

        For a stage that needs an ancestor of its input, e.g. evaluate repairing code needs the plan it came from.
        """
        path = RunFolder(self.run_dir).table(stage)
        if not path.exists():
            return None
        frame = pl.read_parquet(path).filter(pl.col("id") == record_id)
        found = from_frame(record_type, frame.drop(INPUT_ID, strict=False))
        return found[0] if found else None

    def reject(self, subject: Record | str, reason: str, detail: str = "", raw_output: str | None = None) -> Rejection:
        """A rejection of `subject` by this stage, with a stable reason code."""
        subject_id = subject if isinstance(subject, str) else subject.id
        return Rejection(
            provenance=self.provenance([subject_id]),
            stage=self.stage,
            subject_id=subject_id,
            reason=reason,
            detail=detail,
            raw_output=raw_output,
        )


class Rejected(Exception):  # noqa: N818 - it is a verdict, not an error
    """Raised by a stage function to reject its input; the runner records `rejection` and goes on."""

    def __init__(self, rejection: Rejection) -> None:
        super().__init__(f"{rejection.reason}: {rejection.detail}")
        self.rejection = rejection


ItemFn = Callable[[Any, StageContext], Awaitable[Sequence[Record]]]
BatchFn = Callable[[Sequence[Any], StageContext], Awaitable[Sequence[Record]]]


@dataclass(frozen=True)
class ItemStage:
    """A stage that turns each input record into zero or more outputs and rejections, independently."""

    name: str
    fn: ItemFn
    input: type[Record]
    output: type[Record]
    concurrency: Callable[[BuildConfig], int] = field(default=lambda config: config.llm.max_concurrency)


@dataclass(frozen=True)
class BatchStage:
    """A stage that needs all inputs at once. `input` is None for a source stage, which gets no inputs."""

    name: str
    fn: BatchFn
    input: type[Record] | None
    output: type[Record]


Stage = ItemStage | BatchStage


class Interrupted(BaseException):
    """The run was stopped by SIGINT or SIGTERM; finished work is saved and a rerun resumes.

    A BaseException, like KeyboardInterrupt, so no stage's `except Exception` can mistake it for a bad item.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; rerun the same command to resume")
        self.signum = signum


# --------------------------------------------------------------------------------------------- run folder


@dataclass
class RunFolder:
    """Paths and state of `runs/<run-id>/`."""

    root: Path

    def table(self, stage: str) -> Path:
        return self.root / f"{stage}.parquet"

    def rejected(self, stage: str) -> Path:
        return self.root / f"{stage}.rejected.parquet"

    def journal(self, stage: str) -> Path:
        return self.root / f"{stage}.journal.jsonl"

    @property
    def state_path(self) -> Path:
        return self.root / "run.json"

    @property
    def stats_path(self) -> Path:
        return self.root / "stats.json"

    def state(self) -> dict:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def save_state(self, state: dict) -> None:
        tmp = self.root / ".run.json.tmp"
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.state_path)

    def open(self, config: BuildConfig) -> dict:
        """Create the folder, or check that an existing one was made with an equivalent config."""
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.state()
        digest = config_hash(config)
        if state and state.get("config_hash") != digest:
            raise RunError(
                f"{self.root} was made with config {state.get('config_hash')}, this config is {digest}; "
                "resume with the same config (operational keys such as llm.url may change) or use a new --run-dir"
            )
        if not state:
            state = {
                "run_id": self.root.name,
                "config_hash": digest,
                "builder_version": __version__,
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "stages": {},
            }
            (self.root / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
            self.save_state(state)
        return state

    def kept(self, stage: Stage) -> list[Record]:
        path = self.table(stage.name)
        if not path.exists():
            raise RunError(f"stage {stage.name!r} has no output in {self.root}; run it first")
        return from_frame(stage.output, pl.read_parquet(path).drop(INPUT_ID))


# ------------------------------------------------------------------------------------------------ running


async def run_stages(
    stages: Sequence[Stage],
    config: BuildConfig,
    run_dir: Path,
    *,
    until: str | None = None,
    only: str | None = None,
    llm: Callable[[StageStats], Any] | None = None,
    rl_agent: Callable[[StageStats], Any] | None = None,
    sandbox: Callable[[], Any] | None = None,
) -> dict[str, StageStats]:
    """Run `stages` in order over `run_dir`, resuming finished work; returns the stats of every stage run.

    Args:
        until: stop after this stage.
        only: run just this stage, from the stored output of the stage before it.
        llm: makes the model client of a stage from its stats (so calls are counted per stage).
        rl_agent: likewise for the RL agent's model (`rollout.rl_agent_model`), if the run has one.
        sandbox: returns the sandbox runtime shared by all stages (started on first use).

    Raises:
        RunError: unknown stage name, config mismatch with the run folder, or missing upstream output.
        Interrupted: SIGINT or SIGTERM arrived; everything finished so far is saved.
    """
    names = [stage.name for stage in stages]
    for wanted in (until, only):
        if wanted is not None and wanted not in names:
            raise RunError(f"unknown stage {wanted!r}; stages are: {', '.join(names)}")
    if only is not None and until is not None:
        raise RunError("--only and --until cannot be combined")
    folder = RunFolder(Path(run_dir))
    state = folder.open(config)
    all_stats = load_stats(folder.stats_path)
    selected = list(stages[: names.index(until) + 1] if until is not None else stages)
    if only is not None:
        selected = [stages[names.index(only)]]
    digest = state["config_hash"]
    with _signals_cancel_current_task() as interrupted:
        try:
            for stage in selected:
                index = names.index(stage.name)
                inputs = folder.kept(stages[index - 1]) if stage.input is not None else []
                # Model usage and wall time accumulate over attempts; counts are recomputed from the tables.
                stats = all_stats.setdefault(stage.name, StageStats(stage.name))
                ctx = StageContext(
                    config, digest, folder.root, stats, llm=llm(stats) if llm is not None else None,
                    rl_agent=rl_agent(stats) if rl_agent is not None else None, open_sandbox=sandbox,
                )  # fmt: skip
                started = time.monotonic()
                try:
                    if isinstance(stage, ItemStage):
                        await _run_item_stage(stage, inputs, ctx, folder)
                    else:
                        await _run_batch_stage(stage, inputs, ctx, folder, state)
                finally:
                    stats.wall_s += time.monotonic() - started
                    _count_outputs(stage, folder, stats)
                    save_stats(folder.stats_path, all_stats, _run_totals(all_stats, config, digest))
                logger.info(
                    "%s: %d in, %d kept, %d dropped %s",
                    stage.name,
                    stats.inputs,
                    stats.kept,
                    stats.dropped_total,
                    dict(stats.dropped),
                )
        except asyncio.CancelledError:
            if interrupted:
                raise Interrupted(interrupted[0]) from None
            raise
    return {name: all_stats[name] for name in names if name in all_stats}


def _run_totals(all_stats: dict[str, StageStats], config: BuildConfig, digest: str) -> dict[str, Any]:
    """Run-wide figures for stats.json: tokens over every stage and, with a known throughput, GPU-hours."""
    completion = sum(stats.completion_tokens for stats in all_stats.values())
    totals: dict[str, Any] = {
        "config_hash": digest,
        "prompt_tokens": sum(stats.prompt_tokens for stats in all_stats.values()),
        "completion_tokens": completion,
        "llm_calls": sum(stats.llm_calls for stats in all_stats.values()),
    }
    if config.llm.server_tok_s:
        gpus = config.llm.tensor_parallel_size
        totals["gpu_hours_estimate"] = estimate_gpu_hours(completion, config.llm.server_tok_s, num_gpus=gpus)
    return totals


async def _run_item_stage(stage: ItemStage, inputs: list[Record], ctx: StageContext, folder: RunFolder) -> None:
    done = _done_inputs(stage, folder)
    pending = [item for item in inputs if item.id not in done]
    ctx.stats.inputs = len(inputs)
    ctx.stats.resumed = len(inputs) - len(pending)
    if pending:
        semaphore = asyncio.Semaphore(max(1, stage.concurrency(ctx.config)))
        progress = tqdm(
            total=len(pending),
            desc=stage.name,
            unit="item",
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
            leave=True,
        )

        async def one(item: Record) -> tuple[Record, Sequence[Record]]:
            async with semaphore:
                return item, await _call_item(stage, item, ctx)

        _drop_torn_tail(folder.journal(stage.name))
        with folder.journal(stage.name).open("a", encoding="utf-8") as journal, progress:
            tasks = [asyncio.ensure_future(one(item)) for item in pending]
            try:
                for finished in asyncio.as_completed(tasks):
                    item, results = await finished
                    _append_journal(journal, item.id, results)
                    progress.update(1)
            finally:
                for task in tasks:
                    task.cancel()
    _compact(stage, folder)


async def _call_item(stage: ItemStage, item: Record, ctx: StageContext) -> Sequence[Record]:
    """Run the stage function on one input; an unexpected exception becomes a rejection, not a crashed run."""
    try:
        results = list(await stage.fn(item, ctx))
    except Rejected as verdict:
        return [verdict.rejection]
    except (asyncio.CancelledError, BuilderError):
        raise  # an interrupt or an operator error (bad config, store locked) is not a property of this item
    except Exception as error:  # noqa: BLE001 - a bad item is data, not a crash of the batch
        logger.error("%s: %s failed:\n%s", stage.name, item.id, traceback.format_exc())
        return [ctx.reject(item, f"exception:{type(error).__name__}", str(error)[:2000])]
    if not results:
        return [ctx.reject(item, "no_output", "the stage produced nothing for this input")]
    for result in results:
        if not isinstance(result, stage.output | Rejection):
            raise TypeError(f"stage {stage.name} returned {type(result).__name__}, expected {stage.output.__name__}")
    return results


def _append_journal(journal: Any, input_id: str, results: Sequence[Record]) -> None:
    line = {
        "input": input_id,
        "kept": [to_row(r) for r in results if not isinstance(r, Rejection)],
        "rejected": [to_row(r) for r in results if isinstance(r, Rejection)],
    }
    # One line per finished input, flushed at once: after kill -9 only a torn last line can be lost.
    journal.write(json.dumps(line, ensure_ascii=False) + "\n")
    journal.flush()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left unfinished by a killed process, so new lines do not get glued onto it."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def _read_journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    entries = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s:%d is torn (the process died mid-write); that input will be redone", path, number)
    return entries


def _done_inputs(stage: Stage, folder: RunFolder) -> set[str]:
    done: set[str] = set()
    for path in (folder.table(stage.name), folder.rejected(stage.name)):
        if path.exists():
            done.update(pl.read_parquet(path, columns=[INPUT_ID])[INPUT_ID].to_list())
    done.update(entry["input"] for entry in _read_journal(folder.journal(stage.name)))
    return done


def _compact(stage: Stage, folder: RunFolder) -> None:
    """Fold the journal into the stage's two tables (sorted by id, so reruns give identical files)."""
    entries = _read_journal(folder.journal(stage.name))
    for path, record_type, key in (
        (folder.table(stage.name), stage.output, "kept"),
        (folder.rejected(stage.name), Rejection, "rejected"),
    ):
        rows = [{**_checked(record_type, row), INPUT_ID: entry["input"]} for entry in entries for row in entry[key]]
        table_schema = pl.Schema({**schema(record_type), INPUT_ID: pl.String()})
        frames = [pl.read_parquet(path)] if path.exists() else []
        frames.append(pl.DataFrame(rows, schema=table_schema, orient="row"))
        merged = pl.concat(frames).unique("id", keep="first", maintain_order=True).sort("id")
        write_parquet_atomic(merged, path)
    folder.journal(stage.name).unlink(missing_ok=True)


def _checked(record_type: type[Record], row: dict) -> dict:
    """Validate a journal row by rebuilding its record, and return it as a row again."""
    return to_row(from_row(record_type, row))


async def _run_batch_stage(
    stage: BatchStage, inputs: list[Record], ctx: StageContext, folder: RunFolder, state: dict
) -> None:
    ctx.stats.inputs = len(inputs)
    fingerprint = hashlib.sha256("\n".join(sorted(item.id for item in inputs)).encode()).hexdigest()[:16]
    recorded = state["stages"].get(stage.name, {})
    if recorded.get("inputs") == fingerprint and folder.table(stage.name).exists():
        ctx.stats.resumed = len(inputs)
        return
    results = list(await stage.fn(inputs, ctx))
    for path in (folder.table(stage.name), folder.rejected(stage.name), folder.journal(stage.name)):
        path.unlink(missing_ok=True)
    with folder.journal(stage.name).open("w", encoding="utf-8") as journal:
        for result in results:
            _append_journal(journal, _batch_input_of(result), [result])
    _compact(stage, folder)
    state["stages"][stage.name] = {"inputs": fingerprint}
    folder.save_state(state)


def _batch_input_of(record: Record) -> str:
    if isinstance(record, Rejection):
        return record.subject_id
    parents = record.provenance.parent_ids
    return parents[0] if parents else ""


def _count_outputs(stage: Stage, folder: RunFolder, stats: StageStats) -> None:
    stats.kept = pl.read_parquet(folder.table(stage.name)).height if folder.table(stage.name).exists() else 0
    stats.dropped.clear()
    if folder.rejected(stage.name).exists():
        reasons = pl.read_parquet(folder.rejected(stage.name), columns=["reason"])["reason"].to_list()
        stats.dropped.update(reasons)


class _signals_cancel_current_task:
    """Within the block, SIGINT and SIGTERM cancel the running task; the signal number is recorded."""

    def __enter__(self) -> list[int]:
        self.received: list[int] = []
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()

        def handler(signum: int) -> None:
            if not self.received:
                self.received.append(signum)
                logger.warning("received %s: saving finished work and stopping", signal.Signals(signum).name)
                if task is not None:
                    task.cancel()

        for signum in (signal.SIGINT, signal.SIGTERM):
            self.loop.add_signal_handler(signum, handler, signum)
        return self.received

    def __exit__(self, *exc: object) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self.loop.remove_signal_handler(signum)
