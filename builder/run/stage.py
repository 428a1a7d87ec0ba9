"""The stage contract: what a stage function is given (`StageContext`), how it rejects an input (`Rejected`), and
the two kinds of stage (`ItemStage`, `BatchStage`) the executor runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from builder import __version__
from builder.config import BuildConfig
from builder.errors import RunError
from builder.llm.base import StageModel
from builder.records import Provenance, Record, Rejection, Sampling
from builder.run.folder import RunFolder
from builder.stats import StageStats

R = TypeVar("R", bound=Record)


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
    _earlier: dict[str, dict[str, Record]] = field(default_factory=dict, repr=False)

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

    def earlier(self, stage: str, record_type: type[R]) -> dict[str, R]:
        """The records an earlier `stage` of this run kept, by id (empty: that stage has not run).

        Read once per stage run (the tables before the running stage do not change meanwhile). For a stage that
        needs more than its input, e.g. rollout needs the environment of a scenario, evaluate repairing code the
        plan it came from.
        """
        if stage not in self._earlier:
            folder = RunFolder(self.run_dir)
            found = folder.read(stage, record_type) if folder.table(stage).exists() else []
            self._earlier[stage] = {record.id: record for record in found}
        return self._earlier[stage]  # type: ignore[return-value]

    def earlier_record(self, stage: str, record_type: type[R], record_id: str) -> R | None:
        """The record `record_id` an earlier `stage` of this run kept (None: that stage kept no such record)."""
        return self.earlier(stage, record_type).get(record_id)

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


@dataclass(frozen=True)
class BatchStage:
    """A stage that needs all inputs at once. `input` is None for a source stage, which gets no inputs."""

    name: str
    fn: BatchFn
    input: type[Record] | None
    output: type[Record]
    persist: str | None = None  # the store table the executor upserts the kept records into


Stage = ItemStage | BatchStage


@dataclass(frozen=True)
class StageResources:
    """What a process that runs stages gives them: makers of the model clients from a stage's stats (so calls
    are counted per stage), the sandbox opener, and `aclose`, which closes the clients within their event loop."""

    llm: Callable[[StageStats], Any] | None = None
    rl_agent: Callable[[StageStats], Any] | None = None
    sandbox: Callable[[], Any] | None = None
    aclose: Callable[[], Awaitable[None]] | None = None


# Opens the resources of a process for `config` and `run_dir`, entering what must be closed into the stack. The Ray
# executor calls it in each actor, so it must be importable there (a module-level function).
OpenResources = Callable[[BuildConfig, Path, ExitStack], StageResources]
