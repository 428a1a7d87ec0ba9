"""The pipeline: the fixed list of stages `python -m builder run` executes, in order.

Stages arrive with their issues (mine, plan, code, evaluate, scenarios, rollout, select) and are appended here;
the runner needs no change for them.
"""

from __future__ import annotations

from pathlib import Path

from builder.config import BuildConfig
from builder.records import SeedTask
from builder.runner import BatchStage, Stage, run_stages
from builder.stages.collect import collect
from builder.stats import StageStats

STAGES: tuple[Stage, ...] = (BatchStage("collect", collect, input=None, output=SeedTask),)


async def run_pipeline(
    config: BuildConfig, run_dir: Path, *, until: str | None = None, only: str | None = None
) -> dict[str, StageStats]:
    """Run the pipeline over `run_dir` (resuming whatever is already done there)."""
    return await run_stages(STAGES, config, run_dir, until=until, only=only)
