"""Item stages on a Ray cluster: `RayItems`, the `ItemRunner` of `--executor ray`.

The driver keeps the run folder, the journal and the store (one writer, as with the local executor: it journals
what `RayItems` yields, by the same code). Ray actors do the work: each opens its own model clients and sandbox
(the pipeline's `open_resources`, in the actor's process) and works through batches of inputs the driver hands
it, at most `executor.items_in_flight` at once. A batch's results come back when it is done and are journaled at
once, so an actor (or node) that dies loses only its batches in flight: they are handed to a new actor, and a
driver that dies leaves a journal the rerun resumes from. Actors read the tables of earlier stages and share the
response cache through the run folder, so on a cluster it must be on storage every node mounts.

Where time went, per actor and stage (`stats.json`, `stages.<stage>.executor`): items, items/s over its active
time, `model_wait_s` (requests to the model servers, summed over concurrent ones), `sandbox_s` (time in the
actor's blocking-work threads: sandbox sessions, and any other blocking call a stage makes), and the driver's
seconds outside waiting for actors (handing out batches, taking results, journaling), in all and per item.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import math
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from builder.config import BuildConfig
from builder.errors import RunError
from builder.llm import CallRecord
from builder.llm.base import ServerCall
from builder.records import Record
from builder.reports import merge_reports
from builder.run.executor import call_item
from builder.run.stage import ItemStage, OpenResources, StageContext
from builder.stats import StageStats

logger = logging.getLogger(__name__)


class RayItems:
    """Runs the inputs of item stages on Ray actors. A context manager: joins (or starts) the cluster on entry;
    on exit stops its actors and leaves it. Actors are made on first use and kept for the stages after."""

    def __init__(self, config: BuildConfig, run_dir: Path, open_resources: OpenResources) -> None:
        self.config = config
        self.settings = config.executor
        self.run_dir = Path(run_dir)
        self.open_resources = open_resources
        self.actors: dict[str, Any] = {}  # name -> live actor handle
        self._made = 0
        self._node_of: dict[str, str | None] = {}  # actor name -> the node it was placed on (None: anywhere)

    def __enter__(self) -> RayItems:
        import ray

        runtime_env = {}
        if self.settings.worker_setup:
            runtime_env["worker_process_setup_hook"] = self.settings.worker_setup
        ray.init(address=self.settings.ray_address, runtime_env=runtime_env or None, logging_level=logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        actors = list(self.actors.values())
        try:  # let them close their clients and sandboxes; one that does not answer is killed all the same
            ray.wait([actor.close.remote() for actor in actors], num_returns=len(actors), timeout=10)
        finally:
            for actor in actors:
                ray.kill(actor)
        self.actors.clear()
        ray.shutdown()

    # ------------------------------------------------------------------------------------------------- actors

    def _placements(self) -> list[str | None]:
        """Where the actors go: a node id per actor (executor.actors_per_node), or None for Ray's choice."""
        import ray

        if self.settings.actors_per_node:
            nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
            return [node for node in nodes for _ in range(self.settings.actors_per_node)]
        count = self.settings.actors or max(1, int(ray.cluster_resources().get("CPU", 1) // self.settings.actor_cpus))
        return [None] * count

    def _start_actor(self, node: str | None) -> str:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._made += 1
        name = f"actor-{self._made}"
        options: dict[str, Any] = {"num_cpus": self.settings.actor_cpus, "max_restarts": 0}
        if node is not None:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        remote = ray.remote(StageActor).options(**options)
        self.actors[name] = remote.remote(
            name, self.config, str(self.run_dir), self.open_resources, self.settings.sandbox_workers
        )
        self._node_of[name] = node
        return name

    def _replace(self, name: str) -> None:
        if name in self.actors:
            del self.actors[name]
            logger.warning("ray: %s died; starting a replacement", name)
            self._start_actor(self._node_of[name])

    # -------------------------------------------------------------------------------------------- the runner

    async def __call__(
        self, stage: ItemStage, pending: Iterable[Record], ctx: StageContext
    ) -> AsyncIterator[tuple[str, Sequence[Record]]]:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        if not self.actors:
            for node in self._placements():
                self._start_actor(node)
        in_flight = self.settings.items_in_flight or max(1, stage.concurrency(self.config))
        batch_size = min(self.settings.batch_size, in_flight)
        depth = math.ceil(in_flight / batch_size) + 1  # one batch more than it works on, so it never waits on us
        stage_ref = ray.put(stage)
        inputs = _Inputs(deque(pending))
        running: dict[asyncio.Future, _Batch] = {}
        figures: dict[str, dict] = {}  # actor name -> its latest figures for this stage
        base_report = copy.deepcopy(ctx.stats.report)
        started, waited, done_items = time.monotonic(), 0.0, 0
        try:
            while inputs or running:
                handed = True
                while handed:  # a batch to each actor in turn, so a short stage is spread over all of them
                    handed = False
                    for name, actor in list(self.actors.items()):
                        owned = [batch for batch in running.values() if batch.actor == name]
                        if (batch := inputs.next_batch(name, owned, batch_size, depth)) is not None:
                            ref = actor.run.remote(stage_ref, ctx.config_hash, ctx.needs, batch.items, in_flight)
                            running[asyncio.wrap_future(ref.future())] = batch
                            handed = True
                before = time.monotonic()
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                waited += time.monotonic() - before
                for future in finished:
                    batch = running.pop(future)
                    try:
                        answer: BatchAnswer = future.result()
                    except RayActorError:  # died, or its node did (ActorDiedError, ActorUnavailableError)
                        self._replace(batch.actor)
                        inputs.lost(batch, self.settings.max_item_losses)
                        continue
                    except RayTaskError as error:
                        # An operator error in the actor (bad config, a stage returning the wrong type): the
                        # same exception the local executor would raise.
                        raise (error.cause if isinstance(error.cause, BaseException) else error) from None
                    for record in answer.calls:
                        ctx.stats.add_call(record)
                    for server_call in answer.server_calls:
                        ctx.stats.add_server_call(server_call)
                    figures[batch.actor] = answer.figures
                    reports = [base_report, *(f["report"] for f in figures.values())]
                    ctx.stats.report = merge_reports(stage.report, reports)
                    for input_id, results in answer.results:
                        done_items += 1
                        yield input_id, results
        finally:
            for future in running:  # what is still out is not waited for (and its actors are stopped at exit)
                future.cancel()
            driver_s = time.monotonic() - started - waited
            ctx.stats.executor = {
                "kind": "ray",
                "actors": {name: {**actor, "report": actor["report"].to_json()} for name, actor in figures.items()},
                "driver_s": round(driver_s, 3),
                "driver_s_per_item": round(driver_s / done_items, 6) if done_items else None,
                "items": done_items,
                "items_per_s": round(done_items / (time.monotonic() - started), 3),
            }


@dataclass(frozen=True)
class _Batch:
    actor: str
    items: list[Record]
    alone: bool  # handed to an actor with nothing else in flight


@dataclass
class _Inputs:
    """The inputs of a stage still to hand out. One that was in flight on an actor that died is a suspect: it is
    handed out again alone, to an actor with nothing else in flight, so that a death then is its own doing; after
    `executor.max_item_losses` of those the run stops (the input may be what kills the actors)."""

    queue: deque[Record]
    suspects: deque[Record] = field(default_factory=deque)
    losses: Counter[str] = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return bool(self.queue or self.suspects)

    def next_batch(self, actor: str, owned: list[_Batch], size: int, depth: int) -> _Batch | None:
        """The next batch for `actor`, which has `owned` in flight: a suspect alone if it is idle, else up to `size`
        inputs while it has fewer than `depth` batches; None: nothing for it now."""
        if any(batch.alone for batch in owned):
            return None
        if not owned and self.suspects:
            return _Batch(actor, [self.suspects.popleft()], alone=True)
        if not self.queue or len(owned) >= depth:
            return None
        return _Batch(actor, [self.queue.popleft() for _ in range(min(size, len(self.queue)))], alone=False)

    def lost(self, batch: _Batch, limit: int) -> None:
        for item in batch.items:
            if batch.alone:
                self.losses[item.id] += 1
                if self.losses[item.id] >= limit:
                    raise RunError(
                        f"input {item.id} killed {self.losses[item.id]} Ray actors it ran on alone "
                        "(executor.max_item_losses); see the actors' logs (ray logs) for why"
                    )
        self.suspects.extend(batch.items)


@dataclass(frozen=True)
class BatchAnswer:
    """What an actor sends back for a batch: each input's results, the model calls and server attempts made since
    its last answer (the driver counts them in the stage's stats), and its figures for the stage so far."""

    results: list[tuple[str, Sequence[Record]]]
    calls: list[CallRecord]
    server_calls: list[ServerCall]
    figures: dict


@dataclass
class _ActorStats(StageStats):
    """A stage's stats inside an actor: also keeps the model calls and server attempts the driver has not been
    sent yet."""

    unsent: list[CallRecord] = field(default_factory=list)
    unsent_server_calls: list[ServerCall] = field(default_factory=list)

    def add_call(self, record: CallRecord) -> None:
        super().add_call(record)
        self.unsent.append(record)

    def add_server_call(self, call: ServerCall) -> None:
        super().add_server_call(call)
        self.unsent_server_calls.append(call)


class _TimedThreads(ThreadPoolExecutor):
    """The actor loop's default executor (where `asyncio.to_thread` runs sandbox work); adds up the busy time."""

    def __init__(self, workers: int) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="sandbox")
        self.busy_s = 0.0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        def timed() -> Any:
            start = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy_s += time.monotonic() - start  # a float add under the GIL: good enough for a figure

        return super().submit(timed)


class StageActor:
    """One Ray actor (made with `ray.remote`): its own model clients and sandbox, any number of stages."""

    def __init__(self, name: str, config: BuildConfig, run_dir: str, open_resources: OpenResources, threads: int):
        import ray

        self.name = name
        self.config = config
        self.run_dir = Path(run_dir)
        self.stack = ExitStack()
        self.threads = _TimedThreads(threads)
        # The stages' blocking work runs in these threads, timed, whatever pool the resources would bring.
        self.resources = dataclasses.replace(open_resources(config, self.run_dir, self.stack), threads=self.threads)
        self.node = ray.get_runtime_context().get_node_id()[:12]
        self.stages: dict[str, _ActorStage] = {}

    async def run(self, stage: ItemStage, digest: str, needs: dict, batch: list[Record], in_flight: int) -> BatchAnswer:
        asyncio.get_running_loop().set_default_executor(self.threads)
        work = self.stages.get(stage.name)
        if work is None:
            work = self.stages[stage.name] = self._open_stage(stage, digest, needs, in_flight)
        start = time.monotonic()
        work.first = work.first or start

        async def one(item: Record) -> tuple[str, Sequence[Record]]:
            async with work.slots:
                return item.id, await call_item(stage, item, work.ctx)

        results = list(await asyncio.gather(*(one(item) for item in batch)))
        work.last, work.items = time.monotonic(), work.items + len(batch)
        calls, work.stats.unsent = work.stats.unsent, []
        server_calls, work.stats.unsent_server_calls = work.stats.unsent_server_calls, []
        active = work.last - work.first
        figures = {
            "node": self.node,
            "items": work.items,
            "items_per_s": round(work.items / active, 3) if active > 0 else None,
            "active_s": round(active, 3),
            "model_wait_s": round(work.stats.llm_latency_s, 3),
            "sandbox_s": round(self.threads.busy_s - work.sandbox_before, 3),
            "report": copy.deepcopy(work.stats.report),
        }
        return BatchAnswer(results, calls, server_calls, figures)

    def _open_stage(self, stage: ItemStage, digest: str, needs: dict, in_flight: int) -> _ActorStage:
        stats = _ActorStats(stage.name)
        stats.report = stage.report()
        ctx = self.resources.context(self.config, digest, self.run_dir, stats, needs)
        return _ActorStage(ctx, stats, asyncio.Semaphore(in_flight), self.threads.busy_s)

    async def close(self) -> None:
        if self.resources.aclose is not None:
            await self.resources.aclose()
        self.stack.close()


@dataclass
class _ActorStage:
    ctx: StageContext
    stats: _ActorStats
    slots: asyncio.Semaphore
    sandbox_before: float
    first: float = 0.0
    last: float = 0.0
    items: int = 0
