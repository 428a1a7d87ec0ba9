"""The collateral guard: a scenario check that nothing changed outside what the task allows.

It is stored with the scenario as an ordinary check (`check(initial_state, final_state) -> bool`, the last of
`Scenario.checks`), so every path that grades with the scenario's checks — rollouts, the trainer API, the
verifiers and OpenEnv adapters, `python -m builder reward` — applies it without knowing about it. The allowed
paths are what the gold solution changes when it runs (`allowed_paths`): a change at any other path (ending two
other students' rides, overwriting an unrelated preference) fails the guard, and the published reward of a
trajectory that fails it is 0 (`builder.envs.checks.published_reward`).

A record the gold creates is allowed as a whole, but a field the gold leaves empty in it must stay empty
(`blank_fields`): an agent that fills in a phone number nobody gave, or an end date nobody asked for, invents
data, and the guard fails (teacher-16's review: both earned 1.0 before).

The guard's source embeds the very functions this module uses to compute the allowed paths (`changed_paths`,
`covered`, `invented`), so the paths the gold produced and the paths an agent produces are spelled by the same
code.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

from builder.json_values import added_records

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


def invented(state: Any, blank: list) -> list[str]:
    """The fields `blank` names (`[keys to a record, [fields]]` pairs) that hold a value in `state`: data a
    record was given that its gold counterpart left empty. A record that is not there invents nothing."""
    found = []
    for keys, fields in blank:
        record = state
        for key in keys:
            record = record.get(key) if isinstance(record, dict) else None
        if isinstance(record, dict):
            found += [".".join([*keys, name]) for name in fields if record.get(name) not in (None, "", [], {})]
    return found


def blank_fields(initial_state: dict[str, Any], gold_final_state: dict[str, Any]) -> list:
    """For each record the gold adds to a collection keyed by id, the fields it leaves empty (None, "", [], {}):
    `[[collection, id], [fields]]`, what `invented` looks at."""
    blank = []
    for name, key, record in added_records(initial_state, gold_final_state):
        empty = [field for field, value in record.items() if value in (None, "", [], {})]
        if empty:
            blank.append([[name, key], empty])
    return blank


def allowed_paths(initial_state: dict[str, Any], gold_final_state: dict[str, Any]) -> list[str]:
    """The paths the gold solution changed: what the task allows to change."""
    return sorted(set(changed_paths(initial_state, gold_final_state)))


def guard_source(allowed: list[str], blank: list | None = None) -> str:
    """The guard check's source for these allowed paths and the empty fields of the gold's new records."""
    return (
        f"{GUARD_MARK}: nothing may change outside these paths, which the gold solution changes, and a record it\n"
        "# creates gets no value in a field the gold leaves empty.\n"
        "from __future__ import annotations\n\n"
        f"ALLOWED = {json.dumps(sorted(allowed), ensure_ascii=False)}\n"
        f"BLANK = {json.dumps(blank or [], ensure_ascii=False)}\n\n\n"
        f"{inspect.getsource(changed_paths)}\n\n{inspect.getsource(covered)}\n\n{inspect.getsource(invented)}\n\n"
        "def check(initial_state, final_state):\n"
        "    outside = [path for path in changed_paths(initial_state, final_state) if not covered(path, ALLOWED)]\n"
        "    return not outside and not invented(final_state, BLANK)\n"
    )


def is_guard(source: str) -> bool:
    return source.startswith(GUARD_MARK)


def stored_blank(checks: list[str] | tuple[str, ...]) -> list:
    """The `BLANK` of the guard among a scenario's `checks` ([] without one, or from a guard older than it)."""
    for source in checks:
        if is_guard(source):
            line = next((line for line in source.splitlines() if line.startswith("BLANK = ")), "")
            return json.loads(line.removeprefix("BLANK = ")) if line else []
    return []


def collateral(
    initial_state: dict[str, Any], final_state: dict[str, Any], allowed: list[str], blank: list | None = None
) -> list[str]:
    """The changed paths the allowed ones do not cover, and the fields invented in the gold's new records (what
    the guard refuses), for reports and flags."""
    outside = {path for path in changed_paths(initial_state, final_state) if not covered(path, allowed)}
    return sorted(outside | set(invented(final_state, blank or [])))
