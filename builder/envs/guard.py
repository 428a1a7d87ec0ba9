"""The collateral guard: a scenario check that nothing changed outside what the task allows.

It is stored with the scenario as an ordinary check (`check(initial_state, final_state) -> bool`, the last of
`Scenario.checks`), so every path that grades with the scenario's checks — rollouts, the trainer API, the
verifiers and OpenEnv adapters, `python -m builder reward` — applies it without knowing about it. The allowed
paths are what the gold solution changes when it runs (`allowed_paths`): a change at any other path (ending two
other students' rides, overwriting an unrelated preference) fails the guard, and the published reward of a
trajectory that fails it is 0 (`builder.envs.checks.published_reward`).

The guard's source embeds the very functions this module uses to compute the allowed paths (`changed_paths`,
`covered`), so the paths the gold produced and the paths an agent produces are spelled by the same code.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

GUARD_MARK = "# builder: collateral guard"
GUARD_ITEM = "Nothing changes outside what the task asks for (collateral guard)."


def changed_paths(before: Any, after: Any, path: str = "") -> list[str]:
    """The paths at which two JSON values differ: dots for keys, `[i]` for list items; a list whose length changed
    is one change at the list's path. A value of another type is a change (`1` -> `True`)."""
    if type(before) is not type(after):
        return [path]
    if isinstance(before, dict):
        found = []
        for key in list(before) + [key for key in after if key not in before]:
            where = f"{path}.{key}" if path else str(key)
            if key not in before or key not in after:
                found.append(where)
            else:
                found += changed_paths(before[key], after[key], where)
        return found
    if isinstance(before, list):
        if len(before) != len(after):
            return [path]
        found = []
        for index, (old, new) in enumerate(zip(before, after, strict=True)):
            found += changed_paths(old, new, f"{path}[{index}]")
        return found
    return [] if before == after else [path]


def covered(path: str, allowed: list[str]) -> bool:
    """Whether a change at `path` lies under an allowed path (the gold appended to `transfers`, the agent edited
    `transfers[0].memo`) or above one (the agent replaced the whole record whose field the gold changed)."""

    def under(child: str, parent: str) -> bool:
        return child == parent or parent == "" or (child.startswith(parent) and child[len(parent)] in ".[")

    return any(under(path, other) or under(other, path) for other in allowed)


def allowed_paths(initial_state: dict[str, Any], gold_final_state: dict[str, Any]) -> list[str]:
    """The paths the gold solution changed: what the task allows to change."""
    return sorted(set(changed_paths(initial_state, gold_final_state)))


def guard_source(allowed: list[str]) -> str:
    """The guard check's source for these allowed paths."""
    return (
        f"{GUARD_MARK}: nothing may change outside these paths, which the gold solution changes.\n"
        "from __future__ import annotations\n\n"
        f"ALLOWED = {json.dumps(sorted(allowed), ensure_ascii=False)}\n\n\n"
        f"{inspect.getsource(changed_paths)}\n\n{inspect.getsource(covered)}\n\n"
        "def check(initial_state, final_state):\n"
        "    return all(covered(path, ALLOWED) for path in changed_paths(initial_state, final_state))\n"
    )


def is_guard(source: str) -> bool:
    return source.startswith(GUARD_MARK)


def collateral(initial_state: dict[str, Any], final_state: dict[str, Any], allowed: list[str]) -> list[str]:
    """The changed paths the allowed ones do not cover (what the guard refuses), for reports and flags."""
    return sorted({path for path in changed_paths(initial_state, final_state) if not covered(path, allowed)})
