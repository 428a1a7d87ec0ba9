"""Grading a rollout with the published reward (`builder.envs.checks.published_reward`).

The scenario's checks include its collateral guard (`builder.envs.guard`); a scenario made before the guard
existed gets one derived from its gold here (`with_guard`), so its trajectories are graded as new ones are. The
changed paths the guard refuses are also reported (`Trajectory.collateral`, the `collateral` flag). Everything
here blocks on the sandbox; call it in a thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from builder.envs.answer import NOTHING_ASKED, AnswerCheck
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.guard import allowed_paths, collateral, guard_source, is_guard, stored_blank
from builder.envs.lint import Contract
from builder.envs.session import Session
from builder.records import Action
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED


@dataclass(frozen=True)
class Grade:
    """The verdict on one final state: the published reward, the plain share of checks passed, each check's
    result, and the changed paths outside what the gold changes."""

    reward: float
    check_fraction: float
    solved: bool
    checks_passed: tuple[bool, ...]
    check_errors: tuple[str, ...]
    collateral: tuple[str, ...]
    answer_stated: bool | None = None


def gold_paths(
    sandbox: Any, code: str, initial_state: dict[str, Any], gold: Sequence[Action],
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED, contract: Contract = "strict",
) -> tuple[str, ...]:  # fmt: skip
    """The state paths the gold solution changes, from a replay in a fresh session at the scenario's `now` and
    `seed` (the episodes' own, so an id the gold generates is the one the agent's same call generates).

    Raises:
        SessionError, ContractError: the environment does not load or its state cannot be read.
    """
    with Session(sandbox, code, initial_state, now=now, seed=seed, contract=contract) as session:
        before = session.snapshot()
        for action in gold:
            session.call(action.name, action.arguments)
        return tuple(allowed_paths(before, session.snapshot()))


def with_guard(checks: Sequence[str], allowed: Sequence[str] | None) -> list[str]:
    """`checks` with a collateral guard: the scenario's own, else one for the gold's `allowed` paths (None: no
    gold, so no guard)."""
    if any(is_guard(source) for source in checks) or allowed is None:
        return list(checks)
    return [*checks, guard_source(list(allowed))]


def grade(
    sandbox: Any,
    checks: Sequence[str],
    initial_state: dict[str, Any],
    final_state: dict[str, Any],
    allowed_paths: Sequence[str] | None,
    *,
    now: str = DEFAULT_NOW,
    seed: int = DEFAULT_SEED,
    check: AnswerCheck = NOTHING_ASKED,
    answer: str = "",
    seen: str = "",
) -> Grade:
    """The published reward of `final_state` under the scenario's checks with their guard (`with_guard`), at the
    scenario's `now` and seed, and of `answer` (what the agent said) under the scenario's answer `check`, `seen`
    being what the tools returned."""
    specs = checks_from_scenario(with_guard(checks, allowed_paths))
    verdict = published_reward(sandbox, specs, initial_state, final_state, now=now, seed=seed, check=check,
                               answer=answer, seen=seen)  # fmt: skip
    passed = tuple(result.passed for result in verdict.checks)
    blank = stored_blank(list(checks))
    outside = collateral(initial_state, final_state, list(allowed_paths), blank) if allowed_paths is not None else []
    return Grade(
        reward=verdict.reward,
        check_fraction=sum(passed) / len(passed) if passed else 0.0,
        solved=verdict.solved,
        checks_passed=passed,
        check_errors=tuple(result.error for result in verdict.checks if result.error),
        collateral=tuple(outside),
        answer_stated=verdict.answered,
    )
