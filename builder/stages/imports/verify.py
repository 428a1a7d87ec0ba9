"""Re-verifying one imported scenario in the sandbox, like builder's own: the initial state loads, every check
runs, and the task is not already solved (the negative control a scenario without a gold solution still has:
doing nothing must not pass). With no gold, solvability stays unproven and the scenario says so
(`Verification.unverified_solvability`).

Blocking (call it in a thread). The checks run in check workers, never here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from builder.envs.checks import CheckResult, checks_from_scenario, run_checks
from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError
from builder.limits import DETAIL_CHARS
from builder.stages.imports.adapt import adapted_check, check_problem
from builder.stages.imports.sources import SourceScenario

# Why an imported scenario is dropped (stable codes).
REASONS = ("no_checks", "check_invalid", "state_load_failed", "already_solved")


@dataclass
class Checked:
    """What verification found: a `reason` (None: keep it) and the facts the audit reports."""

    reason: str | None = None
    detail: str = ""
    checks: tuple[str, ...] = ()
    initial_state: dict[str, Any] = field(default_factory=dict)
    on_initial: tuple[bool, ...] = ()
    errors: dict[int, str] = field(default_factory=dict)  # checks that raised (or returned no bool) on it
    constant: tuple[int, ...] = ()  # checks that pass on the initial state and on an empty one: they cannot fail

    def facts(self) -> str:
        """The findings as JSON, for a rejection's raw output (the audit reads them back)."""
        return json.dumps(
            {"checks_on_initial": self.on_initial, "check_errors": self.errors, "constant_checks": self.constant},
            sort_keys=True,
        )


def check_scenario(
    sandbox: Any, code: str, interface: EnvInterface, scenario: SourceScenario, *, now: str, seed: int
) -> Checked:
    if not scenario.check_functions:
        return Checked("no_checks", "the scenario has no check functions (EnvScaler's SFT scenarios have none)")
    problems = {i: p for i, source in enumerate(scenario.check_functions) if (p := check_problem(source))}
    if problems:
        detail = "; ".join(f"check {i}: {problem}" for i, problem in sorted(problems.items()))
        return Checked("check_invalid", detail, errors=problems)
    checks = tuple(adapted_check(source) for source in scenario.check_functions)
    try:
        with Session(sandbox, code, scenario.initial_state, interface, now=now, seed=seed) as session:
            initial = session.snapshot()
    except SessionError as error:
        return Checked("state_load_failed", str(error)[:DETAIL_CHARS], checks)
    specs = checks_from_scenario(checks)
    on_initial = run_checks(sandbox, specs, initial, initial, now=now, seed=seed).checks
    on_empty = run_checks(sandbox, specs, initial, {}, now=now, seed=seed).checks
    found = Checked(
        checks=checks,
        initial_state=initial,
        on_initial=tuple(result.passed for result in on_initial),
        errors={i: _error(result) for i, result in enumerate(on_initial) if result.error},
        constant=tuple(i for i, (a, b) in enumerate(zip(on_initial, on_empty, strict=True)) if a.passed and b.passed),
    )
    if all(found.on_initial):
        found.reason, found.detail = (
            "already_solved",
            "every check passes on the initial state: doing nothing solves it",
        )
    return found


def _error(result: CheckResult) -> str:
    return (result.error or "")[:300]


def verification_of(found: Checked, scenario_group: str) -> dict[str, Any]:
    """The `Verification` of a kept imported scenario: what ran, and that no gold proves it solvable."""
    return {
        "verified": False,
        "unverified_solvability": True,
        "scenario_group": scenario_group,
        "gold": (),
        "state_changing_calls": (),
        "gold_state_changes": (),
        "checks_on_initial": found.on_initial,
        "checks_on_final": (),
        "negative_control": (),
        "vacuous_checks": found.constant,
        "check_errors": found.errors,
        "model_difficulty": "medium",
        "state_repairs": 0,
        "repairs": (),
    }


def imported_scenario_fields(found: Checked, scenario: SourceScenario, env_id: str, now: str) -> dict[str, Any]:
    """The fields of the `Scenario` record (all but provenance) of a kept imported scenario."""
    return {
        "env_id": env_id,
        "mode": "non_conversational",  # EnvScaler's RL scenarios are played with the whole task up front
        "initial_state": found.initial_state,
        "now": now,
        "task": scenario.task,
        "checklist": scenario.checklist,
        "checks": found.checks,
        "gold_actions": (),
        "difficulty": "medium",  # the source rates none; select's pass-rate band is what sorts them
        "verification": verification_of(found, f"{env_id}/{scenario.ref}"),
    }
