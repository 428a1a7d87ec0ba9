"""The pipeline: the fixed list of stages `python -m builder run` executes, in order, and what they share.

Stages return records; the executor alone writes them: the run folder's tables, then the store table a stage
declares (`persist`), which releases are exported from. The model
server is started lazily, on the first model call of the run, so a run whose work is all done (or cached) never
waits for vLLM; it is always stopped when the run ends. With `rollout.rl_agent_model` set, the RL agent is a
second model, started the same way (its own managed server, `rl_agent_server.log`, unless
`rollout.rl_agent_url` is set) on the first call of an episode in an `rl` environment.
"""

from __future__ import annotations

import functools
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from builder.config import BuildConfig, LLMConfig
from builder.errors import ConfigError
from builder.llm import CallRecord, ChatRequest, LLMClient, Reply, open_llm
from builder.llm.base import ServerCall
from builder.llm.connect import RL_AGENT_SERVER_LOG, SERVER_LOG, served_model_id
from builder.llm.pool import EndpointPool
from builder.llm.roles import rl_agent_config, user_model_config
from builder.llm.server import read_prefix_cache_counters
from builder.records import ChatMessage, Environment, EnvPlan, Scenario, SeedTask, Selection, Topic, Trajectory
from builder.reports import EvaluateReport, RolloutReport, ScenariosReport, SelectReport
from builder.run.executor import Interrupted, run_stages
from builder.run.stage import BatchStage, ItemStage, Stage, StageResources
from builder.sandbox.runtime import Sandbox
from builder.stages.code import code, repair_tools
from builder.stages.collect import collect
from builder.stages.dedupe import dedupe
from builder.stages.evaluate import evaluate
from builder.stages.imports import IMPORT_STAGE, VERIFY_STAGE, VET_STAGE, import_source, imported_scenarios, vet
from builder.stages.imports.sources import Source
from builder.stages.mine import mine
from builder.stages.plan import plan
from builder.stages.rollout import derive_report as rollout_figures
from builder.stages.rollout import rollout, rollout_concurrency
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.method_stats import derive_report as scenario_figures
from builder.stages.select import select
from builder.stats import ServerStats, StageStats

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

# Stages are leaves: what one needs of another comes in here, as records (`needs`) or as a function (evaluate
# repairs a failing tool with the code stage's `repair_tools`; an import vets with evaluate and generates
# scenarios with the scenarios stage).
SCENARIOS = ItemStage(
    "scenarios", scenarios, input=Environment, output=Scenario, persist="scenarios", derive=scenario_figures,
    report=ScenariosReport, needs=(EnvPlan, Topic),  # the topic's seed requests, which a task must not copy
)  # fmt: skip
ROLLOUT = ItemStage(
    "rollout", rollout, input=Scenario, output=Trajectory, concurrency=rollout_concurrency, persist="trajectories",
    derive=rollout_figures, needs=(Environment,), report=RolloutReport,
)  # fmt: skip
SELECT = BatchStage(
    "select", select, input=Trajectory, output=Selection, persist="selections", needs=(Scenario, Environment),
    report=SelectReport,
)  # fmt: skip
STAGES: tuple[Stage, ...] = (
    BatchStage("collect", collect, input=None, output=SeedTask),
    ItemStage("mine", mine, input=SeedTask, output=Topic),
    BatchStage("dedupe", dedupe, input=Topic, output=Topic),
    ItemStage("plan", plan, input=Topic, output=EnvPlan),
    ItemStage("code", code, input=EnvPlan, output=Environment),
    ItemStage(
        "evaluate",
        functools.partial(evaluate, repair=repair_tools),
        input=Environment,
        output=Environment,
        persist="environments",
        needs=(EnvPlan,),
        report=EvaluateReport,
    ),  # fmt: skip
    SCENARIOS,
    ROLLOUT,
    SELECT,
)


def import_stages(source: Source, *, dual_agent: bool = False, more_scenarios: bool = False) -> tuple[Stage, ...]:
    """The stages `python -m builder import` executes: the source's environments read (`import`), vetted by the
    evaluate stage's gates (`vet`) and their scenarios re-verified (`verify`; `builder.stages.imports`), then the
    pipeline's rollout and select, so an import run continues like a synthesis run."""
    vetted = functools.partial(vet, source=source, dual_agent=dual_agent, evaluate=evaluate)
    verified = functools.partial(imported_scenarios, source=source, more_scenarios=more_scenarios, generate=scenarios)
    return (
        BatchStage(IMPORT_STAGE, functools.partial(import_source, source=source), input=None, output=Environment),
        ItemStage(
            VET_STAGE, vetted, input=Environment, output=Environment, persist="environments", report=EvaluateReport
        ),
        ItemStage(
            VERIFY_STAGE,
            verified,
            input=Environment,
            output=Scenario,
            persist="scenarios",
            derive=scenario_figures,
            report=ScenariosReport,
        ),  # fmt: skip
        ROLLOUT,
        SELECT,
    )


class LazyModel:
    """A model of the run (the synthesis model, or the RL agent), started (managed vLLM server or its URL) on
    its first call: a `StageModel`, as the `LLMClient` it starts.

    Stages run one after another, so calls are counted in the stats of the stage that is running: `for_stage`
    points the counting there and returns this same object.
    """

    def __init__(self, llm: LLMConfig, open_client: Callable[[Callable[[CallRecord], None]], LLMClient]) -> None:
        """`llm` is the model's config; `open_client(on_call)` starts the model and returns its client; it is
        called at most once."""
        self.model_id = served_model_id(llm)  # the model name recorded in provenance
        self._open_client = open_client
        self._client: LLMClient | None = None
        self._failure: BaseException | None = None
        self._stats: StageStats | None = None
        self._counters: dict[str, tuple[int, int]] = {}  # per server URL: its prefix-cache counters last read
        self._managed = not (llm.url or llm.urls)  # a vLLM server of the run's own, whose /metrics it reads

    def for_stage(self, stats: StageStats) -> LazyModel:
        self._stats = stats
        return self

    def _started(self) -> LLMClient:
        if self._failure is not None:
            # Items already scheduled in the stage call in after a failed or interrupted start: they must not
            # start the server again (each try costs minutes, and a Ctrl-C would only stop one of them).
            raise self._failure
        if self._client is None:
            # Blocking on purpose: PR_SET_PDEATHSIG ties the server to the thread that starts it, so it must be
            # the main thread, and no stage can progress before the server is up anyway (the RL agent's start
            # pauses the synthesis model's episodes for that minute; their replies wait in the sockets). The
            # event loop cannot see signals meanwhile, so Ctrl-C and SIGTERM interrupt the start-up directly.
            try:
                with _signals_interrupt():
                    self._client = self._open_client(self._count)
            except BaseException as error:
                self._failure = error
                raise
        return self._client

    def _count(self, record: CallRecord) -> None:
        if self._stats is not None:
            self._stats.add_call(record)

    def count_server_call(self, call: ServerCall) -> None:
        """Count an attempt on one of the model's servers in the running stage (a pool's `on_server_call`)."""
        if self._stats is not None:
            self._stats.add_server_call(call)

    async def chat(self, request: ChatRequest) -> Reply:
        return await self._started().chat(request)

    def read_server_counters(self) -> None:
        """Put each server's own prefix-cache figures since the last reading (vLLM's /metrics) beside builder's
        in the running stage's per-server stats; nothing for a model not started or a server without them."""
        pool = getattr(self._client, "backend", None) if self._client is not None else None
        if self._stats is None or not self._managed or not isinstance(pool, EndpointPool):
            return
        for endpoint in pool.endpoints:
            counters = read_prefix_cache_counters(endpoint.url)
            if counters is None:
                continue
            queries, hits = counters
            before_queries, before_hits = self._counters.get(endpoint.url, (0, 0))
            self._counters[endpoint.url] = counters
            server = self._stats.servers.setdefault(endpoint.url, ServerStats())
            server.cache_queries = (server.cache_queries or 0) + max(0, queries - before_queries)
            server.cache_hits = (server.cache_hits or 0) + max(0, hits - before_hits)

    async def aclose(self) -> None:
        """Close the client's connections within the event loop that opened them (if the model was started)."""
        if self._client is not None:
            await self._client.aclose()

    async def structured(self, messages: Sequence[ChatMessage], output_type: type[T], **options: Any) -> T:
        """`LLMClient.structured` (the same options): validated pydantic output, or `StructuredOutputError`."""
        return await self._started().structured(messages, output_type, **options)


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise `Interrupted` in the main thread at once (a Ray actor runs its
    stages off the main thread, where signals are not delivered anyway: there the block changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def open_resources(config: BuildConfig, run_dir: Path, stack: ExitStack) -> StageResources:
    """The models and the sandbox of a process running the pipeline's stages, each started on first use and
    closed by `stack` (the driver's, or a Ray actor's)."""

    def lazy(llm: LLMConfig, server_log: str = SERVER_LOG) -> LazyModel:
        """A model of the run on `llm`, its client opened into `stack` on the first call, its calls counted."""

        def open_client(on_call: Callable[[CallRecord], None]) -> LLMClient:
            opened = open_llm(
                llm, Path(run_dir), on_call=on_call, on_server_call=made.count_server_call, server_log=server_log
            )
            return stack.enter_context(opened)

        made = LazyModel(llm, open_client)
        return made

    model = lazy(config.llm)
    rl_llm, user_llm = rl_agent_config(config), user_model_config(config)
    rl_agent = lazy(rl_llm, RL_AGENT_SERVER_LOG) if rl_llm is not None else None
    # user_model_config needs llm.url(s): its servers are reached, never started, so its server log stays empty.
    user = lazy(user_llm) if user_llm is not None else None

    @functools.cache
    def open_sandbox() -> Sandbox:
        # Refuses to start (SandboxUnavailable) when this machine lacks a layer of sandbox.required_layers.
        return stack.enter_context(Sandbox(config.sandbox))

    async def aclose() -> None:
        for each in (model, rl_agent, user):
            if each is not None:
                await each.aclose()

    # Rollout's blocking work (sandbox sessions): a thread per episode in flight; a Ray actor gives its own
    # executor.sandbox_workers threads instead.
    threads = ThreadPoolExecutor(max_workers=config.rollout.episodes_in_flight + 4, thread_name_prefix="blocking")
    stack.callback(threads.shutdown, wait=False)
    return StageResources(
        llm=model.for_stage, rl_agent=rl_agent.for_stage if rl_agent is not None else None,
        user_model=user.for_stage if user is not None else None, sandbox=open_sandbox, aclose=aclose,
        threads=threads,
    )  # fmt: skip


async def run_pipeline(
    config: BuildConfig,
    run_dir: Path,
    *,
    until: str | None = None,
    only: str | None = None,
    stages: Sequence[Stage] = STAGES,
) -> dict[str, StageStats]:
    """Run the pipeline (`stages`: the synthesis stages, or `import_stages`) over `run_dir` (resuming whatever is
    already done there), its item stages where `executor.kind` says: in this process, or on Ray actors
    (`run.ray_executor`)."""
    with ExitStack() as stack:
        resources = open_resources(config, Path(run_dir), stack)
        items = None
        if config.executor.kind == "ray":
            from builder.run.ray_executor import RayItems

            _check_servers_for_actors(config)
            items = stack.enter_context(RayItems(config, Path(run_dir), open_resources))
        try:
            return await run_stages(
                stages, config, run_dir, until=until, only=only, llm=resources.llm, rl_agent=resources.rl_agent,
                user_model=resources.user_model, sandbox=resources.sandbox, items=items,
            )  # fmt: skip
        finally:
            await resources.aclose()


def _check_servers_for_actors(config: BuildConfig) -> None:
    """Ray actors reach model servers by URL: each starting a managed vLLM server of its own would not fit."""
    if not (config.llm.url or config.llm.urls):
        raise ConfigError(
            "executor.kind = ray needs the model servers the actors reach: set llm.url or llm.urls "
            "(e.g. start one with `python -m builder serve`)"
        )
    rollout = config.rollout
    if rollout.rl_agent_model is not None and rollout.rl_agent_url is None and not rollout.rl_agent_urls:
        raise ConfigError("executor.kind = ray with rollout.rl_agent_model needs rollout.rl_agent_url or rl_agent_urls")
