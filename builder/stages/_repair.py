"""The contract between the evaluate stage's gates and the code stage's repair: evaluate is given a function of
this type (the pipeline passes the code stage's `repair_tools`), so it repairs a tool that fails its probe without
importing the code stage."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from builder.records import Environment, EnvPlan
from builder.run.stage import StageContext


@dataclass(frozen=True)
class ToolProblemText:
    """A problem of one tool as the model is told it: a stable code and a message naming the failing call."""

    code: str
    message: str

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


@dataclass(frozen=True)
class ToolRepair:
    """What a repair made: the repaired module's source (None: the methods still fail), the model requests it
    took, and the problems left by method (when it failed)."""

    source: str | None
    requests: int
    left: dict[str, tuple[str, ...]] = field(default_factory=dict)


# (ctx, environment, its plan, problems by tool, repair number from 1) -> the repair, or None when the
# environment's code is not its plan's module (nothing to regenerate).
RepairTools = Callable[
    [StageContext, Environment, EnvPlan, Mapping[str, Sequence[ToolProblemText]], int], Awaitable[ToolRepair | None]
]
