"""The stages' own reports (stats.json `stages.<stage>.report`): one pydantic model per stage, in one place.

Mutable on purpose (stage functions add to them while they run, like the other counters of `StageStats`). Under
`--executor ray` each actor counts in its own report and the driver sums them by declared rules
(`merge_reports`): numbers add up, maps add up key by key, nested reports merge field by field; a field marked
`Derived` is left out of the sum (the stage's `derive` fills it from the summed counters), and values that are
not numbers (a list) take the last one set. A report read from stats.json ignores keys it does not know (an older
builder's), so a run resumes across versions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field


class Derived:
    """Marks a field the stage's `derive` computes from the counters: not summed over actors."""


class Report(BaseModel):
    """Base of every report; also a report read back without knowing its stage (`builder stats`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)


class StageReport(Report):
    """What every stage counts: prompts built smaller because they were too long for the model's context, by
    prompt (`builder.stages._llm.shrinking`)."""

    prompt_shrunk: dict[str, int] = {}


class Unknown(Report):
    """A report read from stats.json for a stage whose report type is not known here: its keys as they are."""

    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------------------- evaluate


class FuzzRepairs(Report):
    """Environments whose tools failed the gates' probe and were repaired through the code stage."""

    rounds: int = 0
    repaired: int = 0
    failed: int = 0


class RuleProbeCounts(Report):
    """The rule probes over all environments: rules, probes by outcome, and the repairs they caused."""

    rules: int = 0
    probed: int = 0
    unprobed: int = 0
    no_rules: int = 0  # environments that state no rule: nothing to probe
    probes: int = 0
    refused: int = 0
    wrong_probes: int = 0  # not refused, and the checker found no rule broken
    unjudged: int = 0
    invalid: int = 0
    repair_rounds: int = 0
    repaired: int = 0
    rejected: int = 0


class EvaluateReport(StageReport):
    fuzz_repairs: FuzzRepairs = FuzzRepairs()
    rule_probes: RuleProbeCounts = RuleProbeCounts()
    # Problems sent to repair or rejection by the probes (rule_not_enforced) and the consistency gates
    # (empty_value_mixed, id_format), by code.
    probe_problems: dict[str, int] = {}
    # Under the import contract (information, not problems): lint problems by code, and per imported environment
    # the private attributes left out of its state because they are not JSON.
    lint_problems: dict[str, int] = {}
    private_state_omitted: dict[str, list[str]] = {}


# ------------------------------------------------------------------------------------------------ scenarios


class MethodFigures(Report):
    """One scenario method's counters and, derived from them, its rates and costs per verified slot."""

    slots: int = 0
    verified: int = 0
    template_worded: int = 0
    fell_back_to_llm: int = 0  # graph slots with no chain the llm method made instead (`scenarios.method = both`)
    fell_back_verified: int = 0  # of those, verified by the llm method
    gold_calls: int = 0
    tools_covered: int = 0
    tools_offered: int = 0
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    chains_dropped: dict[str, int] = {}
    yield_: Annotated[float | None, Derived()] = Field(None, alias="yield")
    per_verified: Annotated[dict[str, float] | None, Derived()] = None
    mean_chain_length: Annotated[float | None, Derived()] = None
    tool_coverage: Annotated[float | None, Derived()] = None


class FamilyFigures(Report):
    """One task family's slots: tried, verified, why the others were rejected, and what their model requests
    cost (each slot's own requests, `builder.usage.tally`), with the yield and cost per verified slot derived."""

    slots: int = 0
    verified: int = 0
    rejected: dict[str, int] = {}
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    yield_: Annotated[float | None, Derived()] = Field(None, alias="yield")
    per_verified: Annotated[dict[str, float] | None, Derived()] = None


class ScenariosReport(StageReport):
    verified_slots: int = 0
    # Per task family (`builder.stages.scenarios.families`): slots, verified, rejections and cost.
    families: dict[str, FamilyFigures] = {}
    # The reward audit of every verified slot (`builder.envs.audit`): case -> outcome (pass, fail, n/a) -> slots.
    audit: dict[str, dict[str, int]] = {}

    def count_audit(self, outcomes: dict[str, str]) -> None:
        """Count one scenario's audit outcomes (case -> pass, fail or n/a)."""
        for case, outcome in outcomes.items():
            counts = self.audit.setdefault(case, {})
            counts[outcome] = counts.get(outcome, 0) + 1

    methods: dict[str, MethodFigures] = {}
    per_verified_slot: Annotated[dict[str, float] | None, Derived()] = None


# -------------------------------------------------------------------------------------------------- rollout


class SplitFigures(Report):
    """One model's episodes in one split: scenarios, rollouts, graded rollouts, solved, and the pass rate."""

    scenarios: int = 0
    rollouts: int = 0
    graded: int = 0
    solved: int = 0
    pass_rate: Annotated[float | None, Derived()] = None


class RolloutReport(StageReport):
    # How many scenarios were solved by 0, 1, ..., k of their k samples ("2/4": 3): what select's band cuts from.
    pass_counts: dict[str, int] = {}
    by_model: dict[str, dict[str, SplitFigures]] = {}


# --------------------------------------------------------------------------------------------------- select


class SelectReport(StageReport):
    """A batch stage's report, made whole at once (never summed)."""

    trajectories: int = 0
    end_reasons: dict[str, int] = {}
    solve_rate: dict[str, float] = {}
    turns: dict[str, Any] = {}
    tool_calls: dict[str, Any] = {}
    sft_kept: int = 0
    rl_kept: int = 0
    sft_yield: float = 0.0
    tokens_per_sft_trajectory: float | None = None
    decontamination: dict[str, Any] = {}
    splits: dict[str, Any] = {}
    # Whether select.rl_pass_band cut the rl split: `applied`, `band`, `measured_with` (whose pass rates), `reason`.
    rl_band: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------------- merging

R = TypeVar("R", bound=Report)


def merge_reports(report_type: type[R], reports: Sequence[Report]) -> R:
    """`reports` (one per actor, and the stage's report before they ran) summed by the declared rules."""
    return report_type.model_validate(_merge_model(report_type, [r.model_dump(by_alias=True) for r in reports]))


def _merge_model(model: type[BaseModel], values: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        key = info.alias or name
        present = [value[key] for value in values if key in value]
        if present and not any(isinstance(mark, Derived) for mark in info.metadata):
            merged[key] = _merge(info.annotation, present)
    return merged


def _merge(annotation: Any, present: list[Any]) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _merge_model(annotation, present)
    if get_origin(annotation) is dict:
        _, inner = get_args(annotation)
        keys = list(dict.fromkeys(key for value in present for key in value))
        return {key: _merge(inner, [value[key] for value in present if key in value]) for key in keys}
    if annotation in (int, float):
        return sum(present)
    return _latest(present)


def _latest(present: list[Any]) -> Any:
    set_values = [value for value in present if value not in (None, {}, [], "")]
    return set_values[-1] if set_values else present[-1]
