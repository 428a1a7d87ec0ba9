"""Rewards from a scenario's checks, and the collateral-damage guard.

The reward is the share of the scenario's checks that pass on (initial state, final state); solved means all of
them pass. The guard compares the agent's writes with the writes of the gold solution: a change at a state path
the gold solution leaves alone is collateral damage (e.g. a transfer from the wrong account that the checks
happen not to look at). Everything here blocks on the sandbox; call it in a thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from builder.envs.checks import checks_from_scenario, run_checks
from builder.envs.lint import Contract
from builder.envs.session import Session, diff_states
from builder.records import Action
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED


@dataclass(frozen=True)
class Grade:
    """The verdict on one final state."""

    reward: float
    check_fraction: float
    solved: bool
    checks_passed: tuple[bool, ...]
    check_errors: tuple[str, ...]
    collateral: tuple[str, ...]


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
        after = session.snapshot()
    return tuple(sorted({change["path"] for change in diff_states(before, after)}))


def collateral_paths(changed: Iterable[str], allowed: Iterable[str]) -> tuple[str, ...]:
    """The changed paths not covered by an allowed path.

    A change is covered when it lies under an allowed path (the gold appended to `transfers`, the agent edited
    `transfers[0].memo`) or above one (the agent replaced the whole record whose field the gold changed).
    """
    allowed = tuple(allowed)
    return tuple(sorted(path for path in set(changed) if not any(_related(path, gold) for gold in allowed)))


def _related(path: str, other: str) -> bool:
    return _under(path, other) or _under(other, path)


def _under(path: str, parent: str) -> bool:
    return path == parent or (path.startswith(parent) and path[len(parent)] in ".[")


def grade(
    sandbox: Any,
    checks: Sequence[str],
    initial_state: dict[str, Any],
    final_state: dict[str, Any],
    allowed_paths: Sequence[str] | None,
    *,
    collateral_zeroes_reward: bool,
    now: str = DEFAULT_NOW,
    seed: int = DEFAULT_SEED,
) -> Grade:
    """Run the checks on the two snapshots (at the scenario's `now`) and apply the collateral-damage guard
    (`allowed_paths` None: the scenario has no gold solution to guard with)."""
    specs = checks_from_scenario(tuple(checks))
    verdict = run_checks(sandbox, specs, initial_state, final_state, now=now, seed=seed)
    changed = [change["path"] for change in diff_states(initial_state, final_state)]
    collateral = collateral_paths(changed, allowed_paths) if allowed_paths is not None else ()
    reward = 0.0 if collateral and collateral_zeroes_reward else verdict.reward
    return Grade(
        reward=reward,
        check_fraction=verdict.reward,
        solved=verdict.solved and reward == verdict.reward,
        checks_passed=tuple(result.passed for result in verdict.checks),
        check_errors=tuple(result.error for result in verdict.checks if result.error),
        collateral=collateral,
    )
