"""The evidence records carry, as frozen models: why an environment was accepted (`Evaluation`), how its code was
written (`Synthesis`) and why a scenario's checks and gold solution can be trusted (`Verification`).

Each is stored as one JSON string column and dumps (`model_dump(mode="json")`) to the same JSON object, key for
key and in the same order, as the plain dicts the stages stored before these models existed: rows written then
read into these models, and the released `evaluation` and `verification` columns keep their shape. Keys that
were written only when they had something to say stay out of the JSON when empty (`exclude_if`). Names that are
Python keywords (`pass`, `from`) are attributes with a trailing underscore and keys without.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from builder.frozen import Frozen
from builder.sandbox.world import DEFAULT_NOW

_KEYWORD_KEYS = ConfigDict(serialize_by_alias=True, validate_by_name=True, validate_by_alias=True)


def _none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return not value


# -------------------------------------------------------------------------------------- evaluate: dual-agent


class JudgedCall(Frozen):
    """One tool call of the dual-agent check: what the tester asked for, what the environment did, the verdict."""

    state: int = Field(description="Index of the test state the call ran on.")
    round: int = Field(description="The call's round on that state (unusable replies count as rounds too).")
    tool: str
    case: Literal["positive", "negative", "unscheduled"] = Field(
        description="The case the harness scheduled; unscheduled: the tester called another tool."
    )
    arguments: dict[str, Any]
    result: str | None = Field(None, description="The result as JSON, clipped (None: the call failed).")
    error_kind: str | None = None
    error: str | None = Field(None, description="The call's error, clipped.")
    changes: str | None = Field(None, description="The state diff as JSON, clipped (None: the state is unchanged).")
    verdict: Literal["pass", "warning", "fail"]
    reason: str
    judge: Literal["checker", "runtime"] = Field(
        description="checker: the checker agent ruled; runtime: the call raised, hung, crashed or returned "
        "non-JSON, a failure without asking the checker."
    )


class EvaluationCounts(Frozen):
    model_config = _KEYWORD_KEYS

    judged: int
    pass_: int = Field(alias="pass")
    warning: int
    fail: int
    failed_by_runtime: int = Field(description="Failures ruled by the runtime, not the checker.")
    invalid_replies: int = Field(description="Tester or checker replies that could not be used (not judged).")


class EvaluationState(Frozen):
    """One test state of the dual-agent check, as the model wrote it."""

    purpose: str
    now: str = Field(DEFAULT_NOW, description="The sandbox clock of every session on it (older rows: the default).")
    state: dict[str, Any]


class FailedTestState(Frozen):
    """A test-state slot that produced no valid state, with its last error."""

    index: int
    kind: str
    detail: str


class UnusableReply(Frozen):
    """A tester or checker reply that could not be used (the raw reply is left out of the evidence)."""

    state: int
    round: int
    kind: str = Field(description="Stable code, e.g. unknown_tool, bad_arguments, checker_invalid.")
    detail: str


class EvaluationProvenance(Frozen):
    model: str | None
    prompt_versions: tuple[str, ...]
    sampling: dict[str, dict[str, int | float | None]] = Field(
        description="Sampling parameters by role (state, tester, checker)."
    )
    tester_tool_choice: str
    config_hash: str
    builder_version: str


class ProbeOutcome(Frozen):
    """One deterministic probe (`builder.stages.evaluate.probes`) as it ran on the environment's final code."""

    rule: int | None = Field(description="The rule the call must be refused by (None: a valid call).")
    state: int = Field(description="Index of the test state it ran on.")
    state_change: dict[str, Any] | None = Field(
        None, exclude_if=_none, description="What was changed in the test state before the call."
    )
    tool: str
    arguments: dict[str, Any]
    why: str | None = Field(None, exclude_if=_none, description="How the call breaks the rule, by its writer.")
    status: Literal["refused", "confirmed", "broken", "wrong_probe", "unjudged", "invalid", "accepted"] = Field(
        description="refused: the rule held; confirmed: not refused and the checker ruled it breaks the rule; "
        "broken: it raised, hung or crashed; wrong_probe: not refused and the checker found no rule broken; "
        "unjudged: the checker gave no usable verdict; invalid: the call or its state was unusable; accepted: a "
        "valid call the environment accepted."
    )
    result: str | None = Field(None, description="The result as JSON, clipped (None: the call failed).")
    error: str | None = Field(None, exclude_if=_none, description="The call's error, clipped.")
    reason: str | None = Field(None, exclude_if=_none, description="The checker's reason, for an unrefused probe.")


class RuleProbing(Frozen):
    """Every rule of the environment tried with a call that must be refused (and the consistency gates' calls)."""

    rules: tuple[str, ...] = Field(description="The numbered rules, in order (rule n is rules[n - 1]).")
    probed: tuple[int, ...] = Field(description="Rules with at least one usable probe.")
    unprobed: dict[str, str] = Field(description="Rules without a usable probe, by number: why.")
    probes: tuple[ProbeOutcome, ...]
    invalid: tuple[str, ...] = Field((), description="Probes or replies that could not be used, and why.")
    repairs: int = Field(0, description="Repairs through the code stage the probes needed.")


class Evaluation(Frozen):
    """The evidence behind an environment's acceptance: score, counts, coverage, every judged call."""

    score: float = Field(description="(pass + warning) / judged calls.")
    keep_score: float
    calls_required: int
    settled_early: Literal["accept", "reject"] | None = Field(
        None,
        exclude_if=_none,
        description="The verdict the sequential rule settled before `calls_required` calls were judged (absent: "
        "all were judged, or the check gave up).",
    )
    counts: EvaluationCounts
    tool_coverage: float = Field(description="Share of the tools with at least one judged call.")
    tools: dict[str, dict[str, int]] = Field(
        description="Per tool: `calls`, and calls by case and by verdict (tallies that are zero left out)."
    )
    test_states: tuple[EvaluationState, ...]
    failed_test_states: tuple[FailedTestState, ...] = ()
    calls: tuple[JudgedCall, ...]
    invalid_replies: tuple[UnusableReply, ...] = ()
    usage: dict[str, int] = Field(description="Model requests and tokens the evaluation spent.")
    provenance: EvaluationProvenance
    probes: RuleProbing | None = Field(
        None, exclude_if=_none, description="The rule probes (None: probes off, no rules, or an older row)."
    )


# --------------------------------------------------------------------------------------------- code stage


class GateRepair(Frozen):
    """One round of the evaluate gates' repair through the code stage: the tools that failed and what came of it."""

    model_config = _KEYWORD_KEYS

    round: int
    from_: str = Field(alias="from", description="Id of the environment that failed the gates.")
    problems: dict[str, tuple[str, ...]] = Field(description="The failing tools' errors, by tool.")
    requests: int
    failed: dict[str, tuple[str, ...]] | None = Field(
        None, exclude_if=_none, description="The errors left when the regeneration did not finish, by piece."
    )
    to: str | None = Field(None, exclude_if=_none, description="Id of the repaired environment.")


class Synthesis(Frozen):
    """How an environment's code was written: model requests, regenerated pieces, automatic fixes, repairs."""

    requests: int = 0
    regenerated: dict[str, int] = Field(default_factory=dict, description="Regenerations by piece.")
    fixes: dict[str, tuple[str, ...]] = Field(default_factory=dict, description="Automatic fix codes by piece.")
    added_imports: tuple[str, ...] = ()
    repairs: tuple[GateRepair, ...] = Field((), exclude_if=_empty, description="Repairs of the evaluate gates.")


# ------------------------------------------------------------------------------------------------ scenarios


class GoldResult(Frozen):
    """What one gold call did when verification ran the gold sequence."""

    name: str
    ok: bool = Field(description="It succeeded: no error and no domain refusal.")
    state_changed: bool
    result: str = Field(description="Its result text, clipped.")


class Ablation(Frozen):
    """The negative control of one state-changing gold call: the gold sequence without it, graded."""

    removed: int = Field(description="Index of the gold call left out.")
    name: str
    failing_checks: tuple[int, ...] = Field(description="Checks that fail without the call (none: it is unneeded).")
    error: str | None = Field(None, exclude_if=_none, description="The episode broke without the call.")


class Verification(Frozen):
    """The evidence that a scenario's checks and gold solution agree, from its runs in the sandbox."""

    verified: bool = True
    scenario_group: str = Field(description="Shared by the scenarios of one slot (one per mode).")
    gold: tuple[GoldResult, ...]
    state_changing_calls: tuple[int, ...]
    gold_state_changes: tuple[dict[str, Any], ...] = Field(
        description="The state diff of the gold sequence: `path`, and `before` and/or `after` (at most 200)."
    )
    checks_on_initial: tuple[bool, ...]
    checks_on_final: tuple[bool, ...]
    negative_control: tuple[Ablation, ...]
    vacuous_checks: tuple[int, ...] = Field(description="Checks that no ablation made fail.")
    model_difficulty: Literal["easy", "medium", "hard"] = Field(description="The model's own rating of the task.")
    state_repairs: int = Field(description="Regenerations the initial state needed.")
    repairs: tuple[str, ...] = Field(description="The reason codes of the repair rounds, in order.")
    check_errors: dict[int, str] = Field(
        default_factory=dict, exclude_if=_empty, description="Checks that raised on the initial state, by index."
    )
    unverified_solvability: bool = Field(
        False,
        exclude_if=_empty,
        description="No gold solution exists (an imported scenario): nothing proves it can be solved.",
    )


# ------------------------------------------------------------------------------- the tool dependency graph
# Extracted by `builder.envs.graph` (the edges found by execution in the sandbox); stored with an accepted
# environment (`Environment.graph`).


class ToolNode(Frozen):
    """One tool: its parameters and the state attributes it reads and writes (writes are also reads)."""

    name: str
    parameters: tuple[str, ...]
    reads: tuple[str, ...]
    writes: tuple[str, ...]


class Edge(Frozen):
    """`source` feeds `target`: for `data`, result field `output` (dots for keys, `[]` for list items, empty
    for the whole result) carries values parameter `input` takes, e.g. `example`; for `state`, `source` writes
    attribute `output` and `target` reads it (`input` is the same attribute)."""

    kind: Literal["data", "state"]
    source: str
    target: str
    output: str
    input: str
    example: Any = None


class ToolGraph(Frozen):
    """The typed dependency graph of one environment. `truncated`: the probe budget ran out (edges missing)."""

    nodes: tuple[ToolNode, ...]
    edges: tuple[Edge, ...]
    truncated: bool = False

    def node(self, name: str) -> ToolNode:
        return next(node for node in self.nodes if node.name == name)

    def feeding(self, target: str, parameter: str) -> list[Edge]:
        """The data edges into parameter `parameter` of `target`."""
        return [e for e in self.edges if e.kind == "data" and e.target == target and e.input == parameter]

    def writers(self) -> list[str]:
        return [node.name for node in self.nodes if node.writes]

    def to_dot(self) -> str:
        """Graphviz text: writers as boxes, data edges solid (labelled field → parameter), state edges dashed."""
        lines = ["digraph tools {", "  rankdir=LR;"]
        for node in self.nodes:
            shape = "box" if node.writes else "ellipse"
            lines.append(f'  "{node.name}" [shape={shape}];')
        for edge in self.edges:
            label = f"{edge.output or '(result)'} → {edge.input}" if edge.kind == "data" else edge.output
            style = "solid" if edge.kind == "data" else "dashed"
            lines.append(f'  "{edge.source}" -> "{edge.target}" [label="{label}", style={style}];')
        return "\n".join(lines + ["}"])
