"""The stage contract: what a stage function is given (`StageContext`), how it rejects an input (`Rejected`), and
the two kinds of stage (`ItemStage`, `BatchStage`) the executor runs."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from builder import __version__
from builder.config import BuildConfig
from builder.errors import RunError
from builder.llm.base import StageModel
from builder.records import Provenance, Record, Rejection, Sampling
from builder.reports import StageReport
from builder.run.folder import RunFolder
from builder.stats import StageStats
from builder.tables import RecordsById, to_frame

R = TypeVar("R", bound=Record)
T = TypeVar("T")


@dataclass
class StageContext:
    """Everything a stage function may use. Stages get their dependencies here and nowhere else."""

    config: BuildConfig
    config_hash: str
    run_dir: Path
    stats: StageStats
    llm: StageModel | None = None  # the model, when the pipeline has one
    rl_agent: StageModel | None = None  # the RL agent's model (rollout.rl_agent_model), when the pipeline has one
    open_sandbox: Callable[[], Any] | None = None  # returns the shared `Sandbox`, starting it on first use
    # The earlier records the stage declared it needs (`ItemStage.needs`): record type -> the stage of this run
    # whose kept records they are (the nearest earlier stage with that output), resolved by the executor.
    needs: Mapping[type[Record], str | None] = field(default_factory=dict)
    user_model: StageModel | None = None  # the user simulator's model, when the pipeline has one
    threads: Executor | None = None  # where `blocking` runs blocking work (None: the event loop's default pool)
    _earlier: dict[type[Record], Mapping[str, Record]] = field(default_factory=dict, repr=False)
    # Stages look records up from threads (`blocking`): one reads a table while the others wait for it, not each
    # its own copy (rollout's episodes in flight each read the environments table at once, a copy apiece).
    _earlier_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def sandbox(self) -> Any:
        """The shared sandbox runtime (`builder.sandbox.Sandbox`); its blocking calls belong in a thread."""
        if self.open_sandbox is None:
            raise RunError(f"stage {self.stage!r} needs the sandbox, but this pipeline has none")
        return self.open_sandbox()

    async def blocking(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the threads of the process running the stage (`StageResources.threads`: as
        many as episodes in flight locally, `executor.sandbox_workers` on a Ray actor)."""
        call = functools.partial(fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.threads, call)

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

    def earlier(self, record_type: type[R]) -> Mapping[str, R]:
        """The `record_type` records this run kept before the running stage, by id (empty: the stage that makes
        them has not run). For a stage that needs more than its input, e.g. rollout needs the environment of a
        scenario, evaluate repairing code the plan it came from; the stage declares them (`ItemStage.needs`).

        Read once per stage run (the tables before the running stage do not change meanwhile) and held as the
        table's columns: each record is built when it is looked up (`RecordsById`).

        Raises:
            RunError: the stage did not declare that it needs `record_type` records.
        """
        if record_type not in self.needs:
            raise RunError(
                f"stage {self.stage!r} reads {record_type.__name__} records it did not declare (ItemStage.needs)"
            )
        with self._earlier_lock:
            if record_type not in self._earlier:
                folder, stage = RunFolder(self.run_dir), self.needs[record_type]
                ran = stage is not None and folder.table(stage).exists()
                frame = folder.kept(stage, record_type) if ran else to_frame(record_type, ())
                self._earlier[record_type] = RecordsById(record_type, frame)
        return self._earlier[record_type]  # type: ignore[return-value]

    def earlier_record(self, record_type: type[R], record_id: str) -> R | None:
        """The `record_type` record `record_id` this run kept before the running stage (None: none such)."""
        return self.earlier(record_type).get(record_id)

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
    persist: str | None = None  # the store table the executor upserts the kept records into
    # Fills the report's derived figures (rates, costs per kept item) from its counters and the stage's usage. The
    # executor calls it once the inputs are done, so under `--executor ray` the figures are those of the counters
    # summed over the actors, not one actor's: stage functions only count.
    derive: Callable[[StageStats], None] | None = None
    # Earlier records the stage looks up by id (`StageContext.earlier`): the executor hands it those of the
    # nearest earlier stage whose output is of each type. No stage names another stage's table.
    needs: tuple[type[Record], ...] = ()
    report: type[StageReport] = StageReport  # the type of `StageStats.report` while the stage runs


@dataclass(frozen=True)
class BatchStage:
    """A stage that needs all inputs at once. `input` is None for a source stage, which gets no inputs."""

    name: str
    fn: BatchFn
    input: type[Record] | None
    output: type[Record]
    persist: str | None = None  # the store table the executor upserts the kept records into
    needs: tuple[type[Record], ...] = ()  # as `ItemStage.needs`
    report: type[StageReport] = StageReport


Stage = ItemStage | BatchStage


def earlier_sources(stages: Sequence[Stage], index: int) -> dict[type[Record], str | None]:
    """What `stages[index]` needs, resolved: each record type it declares -> the nearest stage before it whose
    output is of that type (None when no stage before it makes them: the stage then finds none)."""
    stage, found = stages[index], {}
    for record_type in stage.needs:
        makers = [earlier.name for earlier in stages[:index] if earlier.output is record_type]
        found[record_type] = makers[-1] if makers else None
    return found


@dataclass(frozen=True)
class StageResources:
    """What a process that runs stages gives them: makers of the model clients from a stage's stats (so calls
    are counted per stage), the sandbox opener, and `aclose`, which closes the clients within their event loop."""

    llm: Callable[[StageStats], Any] | None = None
    rl_agent: Callable[[StageStats], Any] | None = None
    user_model: Callable[[StageStats], Any] | None = None  # the user simulator's, when it is not `llm`'s model
    sandbox: Callable[[], Any] | None = None
    aclose: Callable[[], Awaitable[None]] | None = None
    threads: Executor | None = None  # for the stages' blocking work that runs many at once (`StageContext.blocking`)

    def context(
        self, config: BuildConfig, config_hash: str, run_dir: Path, stats: StageStats,
        needs: Mapping[type[Record], str | None] | None = None,
    ) -> StageContext:  # fmt: skip
        """The context of one stage run: the model clients counted in `stats`, the sandbox, its earlier records."""
        return StageContext(
            config, config_hash, run_dir, stats, llm=self.llm(stats) if self.llm else None,
            rl_agent=self.rl_agent(stats) if self.rl_agent else None, open_sandbox=self.sandbox,
            needs=dict(needs or {}), user_model=self.user_model(stats) if self.user_model else None,
            threads=self.threads,
        )  # fmt: skip


# Opens the resources of a process for `config` and `run_dir`, entering what must be closed into the stack. The Ray
# executor calls it in each actor, so it must be importable there (a module-level function).
OpenResources = Callable[[BuildConfig, Path, ExitStack], StageResources]
