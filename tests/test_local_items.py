"""The local executor's item runner: the stage's concurrency at most in flight, every input once, results as
they finish, and a finished input's results let go once handed on (not kept by a task until the stage ends)."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from builder.config import BuildConfig
from builder.records import SeedTask
from builder.run.executor import local_items
from builder.run.stage import ItemStage, StageContext
from builder.stats import StageStats


def _context() -> StageContext:
    return StageContext(BuildConfig(), "cafe", ".", StageStats("copy"))


def _seed(ctx: StageContext, request: str) -> SeedTask:
    return SeedTask(provenance=ctx.provenance(), source="builtin", source_ref="0", request=request)


def _copying_stage(concurrency: int, seen: dict[str, int]) -> ItemStage:
    """Each input comes back as a copy carrying a 1 MB request, after a delay that finishes later inputs first."""

    async def copy(item: SeedTask, ctx: StageContext) -> list[SeedTask]:
        seen["in_flight"] += 1
        seen["most"] = max(seen["most"], seen["in_flight"])
        await asyncio.sleep(0.001 * (int(item.source_ref) % 3))
        seen["in_flight"] -= 1
        return [_seed(ctx, item.request + "x" * 1_000_000)]

    return ItemStage("copy", copy, SeedTask, SeedTask, concurrency=lambda config: concurrency)


def test_every_input_once_at_most_the_concurrency_in_flight_and_results_not_held():
    ctx = _context()
    inputs = [SeedTask(provenance=ctx.provenance(), source="builtin", source_ref=str(i), request=f"r{i}")
              for i in range(40)]  # fmt: skip
    seen = {"in_flight": 0, "most": 0}
    alive: list[weakref.ref] = []
    ids: list[str] = []

    async def consume() -> None:
        async for input_id, results in local_items(_copying_stage(4, seen), inputs, ctx):
            ids.append(input_id)
            alive.append(weakref.ref(results[0]))
            del results
            gc.collect()
            # What was handed on and dropped by the consumer (the journal) is gone while the stage still runs: at
            # most the tasks that finished together are still held, never every result so far.
            assert sum(ref() is not None for ref in alive) <= 4 + 1

    asyncio.run(consume())
    assert sorted(ids) == sorted(item.id for item in inputs) and len(ids) == 40
    assert seen["most"] == 4


def test_closing_the_runner_cancels_what_is_in_flight():
    ctx = _context()
    inputs = [SeedTask(provenance=ctx.provenance(), source="builtin", source_ref=str(i), request=f"r{i}")
              for i in range(10)]  # fmt: skip
    cancelled: list[str] = []
    started: list[str] = []

    async def slow(item: SeedTask, ctx: StageContext) -> list[SeedTask]:
        started.append(item.source_ref)
        try:
            await asyncio.sleep(0 if item.source_ref == "0" else 10)
        except asyncio.CancelledError:
            cancelled.append(item.source_ref)
            raise
        return [item]

    async def first_only() -> str:
        runner = local_items(ItemStage("slow", slow, SeedTask, SeedTask, concurrency=lambda c: 3), inputs, ctx)
        input_id, _ = await anext(runner)
        await runner.aclose()
        await asyncio.sleep(0)
        return input_id

    assert asyncio.run(first_only()) == inputs[0].id
    # In flight with it: 1 and 2, cancelled; 3 took the first one's place and was cancelled before it began.
    assert sorted(cancelled) == ["1", "2"] and sorted(started) == ["0", "1", "2"]


def test_an_operator_error_in_one_input_stops_the_runner():
    from builder.errors import OperatorError

    ctx = _context()
    inputs = [SeedTask(provenance=ctx.provenance(), source="builtin", source_ref=str(i), request=f"r{i}")
              for i in range(5)]  # fmt: skip

    async def broken(item: SeedTask, ctx: StageContext) -> list[SeedTask]:
        raise OperatorError("store locked")

    async def consume() -> None:
        async for _ in local_items(ItemStage("broken", broken, SeedTask, SeedTask), inputs, ctx):
            pass

    with pytest.raises(OperatorError, match="store locked"):
        asyncio.run(consume())
