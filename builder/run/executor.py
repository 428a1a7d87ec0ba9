"""The resumable executor: stages in order over a run folder, one Parquet table per stage.

A stage reads the kept records of the stage before it and writes `<stage>.parquet` (kept) and
`<stage>.rejected.parquet` (rejections with reason codes). Item stages process each input on its own,
concurrently; each finished input is appended to `<stage>.journal.jsonl` at once, so after a crash or `kill -9`
a rerun redoes only the inputs that were in flight. Batch stages (de-duplication, splits) see all inputs at once
and rerun whole when their inputs change.

Where an item stage's inputs run is the item runner's business (`local_items`: here, as asyncio tasks;
`ray_executor.RayItems`: on Ray actors); whichever it is, this module journals what it yields, so both executors
share one data path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import polars as pl
from tqdm import tqdm

from builder.config import BuildConfig
from builder.cpu import process_tree_cpu_s
from builder.errors import ItemError, OperatorError, RunError
from builder.limits import DETAIL_CHARS
from builder.llm.accounting import estimate_gpu_hours
from builder.records import Record, Rejection
from builder.run.folder import RunFolder
from builder.run.stage import (
    BatchStage,
    ItemStage,
    Rejected,
    Stage,
    StageContext,
    StageResources,
    earlier_sources,
)
from builder.stats import StageStats, load_stats, prefix_reuse, save_stats
from builder.store import Store
from builder.tables import iter_records
from builder.usage import Usage

logger = logging.getLogger(__name__)


class Interrupted(BaseException):
    """The run was stopped by SIGINT or SIGTERM; finished work is saved and a rerun resumes.

    A BaseException, like KeyboardInterrupt, so no stage's `except Exception` can mistake it for a bad item.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}; rerun the same command to resume")
        self.signum = signum


# Works through a stage's pending inputs and yields each input's id with its results as soon as it is done; the
# executor journals what it yields, whichever runner made it (`local_items`, or `ray_executor.RayItems`).
ItemRunner = Callable[[ItemStage, Iterable[Record], StageContext], AsyncIterator[tuple[str, Sequence[Record]]]]


async def run_stages(
    stages: Sequence[Stage],
    config: BuildConfig,
    run_dir: Path,
    *,
    until: str | None = None,
    only: str | None = None,
    llm: Callable[[StageStats], Any] | None = None,
    rl_agent: Callable[[StageStats], Any] | None = None,
    user_model: Callable[[StageStats], Any] | None = None,
    sandbox: Callable[[], Any] | None = None,
    items: ItemRunner | None = None,
) -> dict[str, StageStats]:
    """Run `stages` in order over `run_dir`, resuming finished work; returns the stats of every stage run.

    Args:
        until: stop after this stage.
        only: run just this stage, from the stored output of the stage before it.
        llm: makes the model client of a stage from its stats (so calls are counted per stage).
        rl_agent: likewise for the RL agent's model (`rollout.rl_agent_model`), if the run has one.
        user_model: likewise for the user simulator's model (`rollout.user_model`), if it has its own.
        sandbox: returns the sandbox runtime shared by all stages (started on first use).
        items: runs the pending inputs of an item stage (default `local_items`: in this process); batch stages
            always run here.

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
    resources = StageResources(llm=llm, rl_agent=rl_agent, user_model=user_model, sandbox=sandbox)
    with _signals_cancel_current_task() as interrupted:
        try:
            for stage in selected:
                index = names.index(stage.name)
                previous = stages[index - 1]
                if stage.input is not None:
                    folder.require(previous.name)  # before anything is counted
                # Model usage and wall time accumulate over attempts; counts are recomputed from the tables.
                stats = all_stats.setdefault(stage.name, StageStats(stage.name))
                stats.report = stage.report.model_validate(stats.report.model_dump(by_alias=True))
                ctx = resources.context(config, digest, folder.root, stats, earlier_sources(stages, index))
                started, started_cpu = time.monotonic(), process_tree_cpu_s()
                try:
                    if isinstance(stage, ItemStage):
                        await _run_item_stage(stage, previous, ctx, folder, items or local_items)
                    else:
                        await _run_batch_stage(stage, previous, ctx, folder, state)
                    await asyncio.to_thread(_persist, stage, folder, config)
                finally:
                    stats.wall_s += time.monotonic() - started
                    stats.cpu_s += process_tree_cpu_s() - started_cpu
                    # The managed server's own prefix-cache counters beside builder's figure (`LazyModel`).
                    for model in (ctx.llm, ctx.rl_agent):
                        if (read := getattr(model, "read_server_counters", None)) is not None:
                            await asyncio.to_thread(read)
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
    """Run-wide figures for stats.json: usage over every stage and, with a known throughput, GPU-hours."""
    usage = sum((stats.usage for stats in all_stats.values()), Usage())
    reuse = prefix_reuse(server for stats in all_stats.values() for server in stats.servers.values())
    totals: dict[str, Any] = {"config_hash": digest, "usage": usage.model_dump(), "prefix_reuse": reuse}
    if config.llm.server_tok_s:
        gpus = config.llm.tensor_parallel_size
        totals["gpu_hours_estimate"] = estimate_gpu_hours(
            usage.completion_tokens, config.llm.server_tok_s, num_gpus=gpus
        )
    return totals


async def local_items(
    stage: ItemStage, pending: Iterable[Record], ctx: StageContext
) -> AsyncIterator[tuple[str, Sequence[Record]]]:
    """The `ItemRunner` of this process: the inputs concurrently (at most the stage's concurrency at once, started
    in order), each yielded with its results as it finishes. Only the inputs in flight have a task (and a record:
    `pending` is drawn as inputs start), and a finished task is let go once its results are handed on."""
    waiting = iter(pending)
    running: set[asyncio.Task[tuple[str, Sequence[Record]]]] = set()

    async def one(item: Record) -> tuple[str, Sequence[Record]]:
        return item.id, await call_item(stage, item, ctx)

    def start_next() -> None:
        item = next(waiting, None)
        if item is not None:
            running.add(asyncio.ensure_future(one(item)))

    try:
        for _ in range(max(1, stage.concurrency(ctx.config))):
            start_next()
        while running:
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                running.discard(task)
                start_next()
            # Every failure read (none is logged as never retrieved); the first stops the stage.
            failures = [error for task in finished if (error := task.exception()) is not None]
            if failures:
                raise failures[0]
            for task in finished:
                yield task.result()
    finally:
        for task in running:
            task.cancel()


async def _run_item_stage(
    stage: ItemStage, previous: Stage, ctx: StageContext, folder: RunFolder, items: ItemRunner
) -> None:
    """Run the inputs (`previous`'s kept records) that have not been done. They are held as the table's columns
    and each becomes a record as it starts, so a stage over many thousand inputs does not hold them all as
    records."""
    inputs = folder.kept(previous.name, previous.output)
    pending = inputs.filter(~pl.col("id").is_in(list(folder.done_inputs(stage.name, stage.output))))
    ctx.stats.inputs = inputs.height
    ctx.stats.resumed = inputs.height - pending.height
    del inputs
    if pending.height:
        progress = tqdm(
            total=pending.height,
            desc=stage.name,
            unit="item",
            file=sys.stderr,
            disable=not sys.stderr.isatty(),
            leave=True,
        )
        try:
            with folder.appending(stage.name) as journal, progress:
                async with aclosing(items(stage, iter_records(previous.output, pending), ctx)) as finished:
                    async for input_id, results in finished:
                        folder.append(journal, input_id, results)
                        progress.update(1)
        finally:  # also for an interrupted stage: its stats are saved with what it counted
            if stage.derive is not None:
                stage.derive(ctx.stats)
    folder.compact(stage.name, stage.output)


async def call_item(stage: ItemStage, item: Record, ctx: StageContext) -> Sequence[Record]:
    """Run the stage function on one input. An item error (`builder.errors.ItemError`: a failed model request, a
    broken session) is that input's rejection with the error's reason; an unexpected exception too, as
    `exception:<Type>` (a bug, logged with its traceback); an interrupt or an operator error stops the run."""
    try:
        results = list(await stage.fn(item, ctx))
    except Rejected as verdict:
        return [verdict.rejection]
    except (asyncio.CancelledError, OperatorError):
        raise  # an interrupt or an operator error (bad config, store locked) is not a property of this item
    except ItemError as error:
        logger.warning("%s: %s failed: %s: %s", stage.name, item.id, error.reason, error)
        return [ctx.reject(item, error.reason, str(error)[:DETAIL_CHARS])]
    except Exception as error:  # noqa: BLE001 - a bad item is data, not a crash of the batch
        logger.error("%s: %s failed:\n%s", stage.name, item.id, traceback.format_exc())
        return [ctx.reject(item, f"exception:{type(error).__name__}", str(error)[:DETAIL_CHARS])]
    if not results:
        return [ctx.reject(item, "no_output", "the stage produced nothing for this input")]
    for result in results:
        if not isinstance(result, stage.output | Rejection):
            raise TypeError(f"stage {stage.name} returned {type(result).__name__}, expected {stage.output.__name__}")
    return results


async def _run_batch_stage(
    stage: BatchStage, previous: Stage, ctx: StageContext, folder: RunFolder, state: dict
) -> None:
    """Run the stage over all its inputs (`previous`'s kept records) at once, unless it did over the same ones."""
    inputs = folder.read(previous.name, previous.output) if stage.input is not None else []
    ctx.stats.inputs = len(inputs)
    fingerprint = hashlib.sha256("\n".join(sorted(item.id for item in inputs)).encode()).hexdigest()[:16]
    recorded = state["stages"].get(stage.name, {})
    if recorded.get("inputs") == fingerprint and folder.table(stage.name).exists():
        ctx.stats.resumed = len(inputs)
        return
    results = list(await stage.fn(inputs, ctx))
    with folder.appending(stage.name, fresh=True) as journal:
        for result in results:
            folder.append(journal, _batch_input_of(result), [result])
    folder.compact(stage.name, stage.output)
    state["stages"][stage.name] = {"inputs": fingerprint}
    folder.save_state(state)


def _batch_input_of(record: Record) -> str:
    if isinstance(record, Rejection):
        return record.subject_id
    parents = record.provenance.parent_ids
    return parents[0] if parents else ""


def _persist(stage: Stage, folder: RunFolder, config: BuildConfig) -> None:
    """Upsert the stage's kept records into the store table it declares (the whole table, every time: a run
    stopped between its tables and the store heals on the rerun). Rows of a subject the stage rejected this time
    are retracted (a trajectory select kept in an earlier run and drops now must leave the release)."""
    if stage.persist is None:
        return
    kept = folder.kept(stage.name, stage.output)  # as columns: a record per row would be the whole table again
    rejected = folder.frame(stage.name, stage.output, rejected=True, columns=["subject_id"])["subject_id"].to_list()
    store = Store(config.store.path, config.store.lock_timeout_s)
    retracted = rejected if "subject_id" in stage.output.model_fields else ()
    store.upsert(stage.persist, kept, retract_subjects=retracted)


def _count_outputs(stage: Stage, folder: RunFolder, stats: StageStats) -> None:
    stats.kept = folder.frame(stage.name, stage.output, columns=["id"]).height
    stats.dropped.clear()
    stats.dropped.update(folder.frame(stage.name, stage.output, rejected=True, columns=["reason"])["reason"].to_list())


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
