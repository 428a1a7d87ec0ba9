"""`python -m builder bench scale`: items per second of a sandbox-heavy stage under the local executor and on 1
and 2 Ray actors, in the same run, and the driver's overhead per item.

The stage is scenario verification (`stages.scenarios.verify.verify`: gold replay, determinism replay, checks on
the final and initial states, negative control) of the counter environment of `bench sandbox`, after one model
call per item to a scripted model that answers after a fixed latency. A warm-up stage first starts each
process's sandbox (and each actor), so the figures are the steady rate, not start-up.

Two comparisons, because one machine cannot show both at once:

- `per_core` (the target): the local executor's process and each actor's process are pinned to one core of their
  own (with their sandbox processes), as nodes of a cluster each bring their own cores. 2 actors against the
  local executor is then what a second node's worth of CPU gives through Ray, less what the executor costs
  (the driver, unpinned, and Ray's own processes share the same cores).
- `machine`: nothing pinned. The local executor already spreads the sandbox work over every core of the machine
  (its sandbox workers are processes), so on one machine actors add no CPU and this ratio stays near 1; the gain
  from actors is across nodes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from builder.config import BuildConfig
from builder.errors import RunError
from builder.llm import ChatRequest, Reply, ScriptedModel
from builder.llm.connect import client_for
from builder.records import Action, ChatMessage, SeedTask, Topic
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, ItemStage, StageResources
from builder.sandbox.bench import BENCH_ENV
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.verify import verify

GOLD = (Action(name="increment", arguments={"by": 2}), Action(name="increment", arguments={"by": 1}))
CHECK = "def check(initial_state, final_state):\n    return final_state['value'] == initial_state['value'] + 3\n"
TARGET_RATIO = 1.7  # per core: 2 actors (a core each) against the local executor (one core)


class _Latency:
    """A scripted model that answers "ok" after `latency_s`, like a model server under steady load."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.model = ScriptedModel(lambda request: "ok")

    async def chat(self, request: ChatRequest) -> Reply:
        await asyncio.sleep(self.latency_s)
        return await self.model.chat(request)


def bench_resources(
    config: BuildConfig, run_dir: Path, stack: ExitStack, *, latency_s: float, cores: Path | None = None
) -> StageResources:
    """The bench's model (fixed latency, through the real client and its accounting) and sandbox; with `cores`
    (a folder shared by the processes of one measurement), this process is first pinned to a core of its own."""
    if cores is not None:
        pin_threads(stack, {_claim_core(cores)})

    def llm(stats: Any) -> Any:
        return client_for(config.llm, _Latency(latency_s), model_id="bench", on_call=stats.add_call)

    sandbox = functools.cache(lambda: stack.enter_context(Sandbox(config.sandbox)))
    return StageResources(llm=llm, sandbox=sandbox)


def _claim_core(cores: Path) -> int:
    """The lowest core of this machine that no other process of the measurement has claimed (a file made with
    O_EXCL in `cores`: the actors are separate processes, perhaps started at once)."""
    for core in sorted(os.sched_getaffinity(0)):
        try:
            os.close(os.open(cores / f"core-{core}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        return core
    raise RunError(f"bench scale: more processes to pin than cores ({len(os.sched_getaffinity(0))})")


def pin_threads(stack: ExitStack, cores: set[int]) -> None:
    """Pin every thread of this process to `cores` until `stack` closes. Threads and processes started later
    inherit it from the thread that starts them (a sandbox's zygote and its workers too)."""
    tasks = [int(tid) for tid in os.listdir("/proc/self/task")]
    before = {tid: os.sched_getaffinity(tid) for tid in tasks}
    for tid in tasks:
        os.sched_setaffinity(tid, cores)

    def restore() -> None:
        for tid, mask in before.items():
            try:
                os.sched_setaffinity(tid, mask)
            except ProcessLookupError:  # a thread that has ended since
                pass

    stack.callback(restore)


async def warm_up(seed: SeedTask, ctx: Any) -> list[SeedTask]:
    await asyncio.to_thread(ctx.sandbox.open_worker().kill)
    return [seed]


async def verify_counter(seed: SeedTask, ctx: Any) -> list[Topic]:
    """One model call, then the scenario gates over the counter environment (blocking: in a thread)."""
    await ctx.llm.chat(ChatRequest(messages=(ChatMessage(role="user", content=seed.request),)))
    evidence = await asyncio.to_thread(verify, ctx.sandbox, BENCH_ENV, {"value": 0}, GOLD, [CHECK])
    if evidence.reason is not None:
        raise RuntimeError(f"the bench scenario does not verify: {evidence.reason}: {evidence.detail}")
    return [Topic(provenance=ctx.provenance([seed]), name=f"verified {seed.source_ref}", description="", domain="")]


def _stages(items: int) -> tuple:
    async def seeds(_: Any, ctx: Any) -> list[SeedTask]:
        return [
            SeedTask(provenance=ctx.provenance(), source="bench", source_ref=str(i), request=f"scenario {i}")
            for i in range(items)
        ]

    return (
        BatchStage("seeds", seeds, input=None, output=SeedTask),
        ItemStage("warm_up", warm_up, input=SeedTask, output=SeedTask),
        ItemStage("verify", verify_counter, input=SeedTask, output=Topic),
    )


async def _measure(
    config: BuildConfig, run_dir: Path, items: int, latency_s: float, actors: int, *, pinned: bool
) -> dict[str, Any]:
    shutil.rmtree(run_dir, ignore_errors=True)
    cores = run_dir / "cores" if pinned else None
    if cores is not None:
        cores.mkdir(parents=True)
    with ExitStack() as stack:
        runner = None
        if actors:
            from builder.run.ray_executor import RayItems

            settings = config.executor.model_copy(update={"kind": "ray", "actors": actors, "actors_per_node": 0})
            config = config.model_copy(update={"executor": settings})
            in_actor = functools.partial(bench_resources, latency_s=latency_s, cores=cores)
            runner = stack.enter_context(RayItems(config, run_dir, in_actor))
            resources = bench_resources(config, run_dir, stack, latency_s=latency_s)  # the driver: never pinned
        else:
            resources = bench_resources(config, run_dir, stack, latency_s=latency_s, cores=cores)
        stats = await run_stages(
            _stages(items), config, run_dir, llm=resources.llm, sandbox=resources.sandbox, items=runner
        )
    verified = stats["verify"]
    if verified.kept != items:
        raise RunError(f"bench scale: the stage dropped items ({dict(verified.dropped)}); see the log above")
    figures: dict[str, Any] = {"items_per_s": round(verified.kept / verified.wall_s, 2)}
    if actors:
        executor = verified.executor
        figures["driver_s_per_item"] = executor["driver_s_per_item"]
        figures["actors"] = {
            name: {key: actor[key] for key in ("items", "items_per_s", "model_wait_s", "sandbox_s")}
            for name, actor in executor["actors"].items()
        }
    return figures


def _compare(config: BuildConfig, run_dir: Path, items: int, latency_s: float, *, pinned: bool) -> dict[str, Any]:
    runs = (("local", 0), ("ray_1_actor", 1), ("ray_2_actors", 2))
    figures = {
        name: asyncio.run(_measure(config, run_dir / name, items, latency_s, actors, pinned=pinned))
        for name, actors in runs
    }
    two, one, local = (figures[name]["items_per_s"] for name in ("ray_2_actors", "ray_1_actor", "local"))
    return {**figures, "ratio_2_actors_vs_local": round(two / local, 2), "ratio_2_vs_1_actor": round(two / one, 2)}


def bench_scale(
    config: BuildConfig, run_dir: Path, *, items: int = 200, latency_ms: float = 20.0, as_json: bool = False
) -> str:
    """Run the bench (local, then 1 and 2 Ray actors; pinned a core each, then not) and return its figures, as
    JSON or as lines of text."""
    latency_s = latency_ms / 1000
    started = time.monotonic()
    cores = len(os.sched_getaffinity(0))
    figures: dict[str, Any] = {"items": items, "latency_ms": latency_ms, "cpus": cores}
    if cores >= 2:
        figures["per_core"] = _compare(config, run_dir / "per-core", items, latency_s, pinned=True)
    figures["machine"] = _compare(config, run_dir / "machine", items, latency_s, pinned=False)
    figures["target_ratio"] = TARGET_RATIO
    figures["bench_s"] = round(time.monotonic() - started, 1)
    if as_json:
        return json.dumps(figures)
    lines = [f"scenario verification of the counter environment, {items} items, model latency {latency_ms:g} ms"]
    for mode, title in (("per_core", "a core per process"), ("machine", f"nothing pinned ({cores} cores)")):
        if mode not in figures:
            lines.append(f"{title}: needs 2 cores, this machine gives {cores}")
            continue
        lines.append(f"{title}:")
        entry = figures[mode]
        for name in ("local", "ray_1_actor", "ray_2_actors"):
            overhead = entry[name].get("driver_s_per_item")
            extra = f", driver {overhead * 1000:.2f} ms/item" if overhead is not None else ""
            lines.append(f"  {name:<13} {entry[name]['items_per_s']:8.2f} items/s{extra}")
        target = f" (target >= {TARGET_RATIO}x)" if mode == "per_core" else ""
        lines.append(
            f"  2 actors / local: {entry['ratio_2_actors_vs_local']:.2f}x{target}, "
            f"2 / 1 actor: {entry['ratio_2_vs_1_actor']:.2f}x"
        )
    return "\n".join(lines)
