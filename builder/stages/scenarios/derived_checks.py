"""Checks derived from a state diff: what a chain changed, as typed items compiled to check functions.

The diff between an initial and a final state becomes check items: a record created with these fields, a field
changed to a value, a record deleted, a number moved by n, and nothing else touched. Each compiles to a
`def check(initial_state, final_state) -> bool` module of the format every scenario uses, so verification,
rollouts and exports treat them like any other check. Together they hold on the final state and nowhere else the
chain could have stopped: leaving out a change fails the item that names it, doing more fails `untouched`.

A record created under a generated key (a uuid) is pinned to that key: the sandbox's seeded world gives the same
key to the same calls in the same order.
"""

from __future__ import annotations

from typing import Any, Literal

from builder.envs.lint import Contract
from builder.frozen import JSON, Frozen
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED
from builder.stages.scenarios.chain import Chain
from builder.stages.scenarios.verify import Evidence, verify

Path = tuple[str | int, ...]


class CheckItem(Frozen):
    """One fact of the final state relative to the initial one.

    `path` is the collection (created, deleted), the field (changed, moved) or () (untouched); `key` the record's
    key in a map (None for a list item); `value` the record (created, or deleted from a list), the new value
    (changed), the amount (moved) or every path the other items touch (untouched).
    """

    kind: Literal["created", "changed", "deleted", "moved", "untouched"]
    path: tuple[str | int, ...]
    key: str | None = None
    value: JSON = None

    def describe(self) -> str:
        where = _dotted(self.path + ((self.key,) if self.key is not None else ()))
        if self.kind == "created":
            return f"a record {where} is created with {self.value!r}"
        if self.kind == "changed":
            return f"{where} is {self.value!r}"
        if self.kind == "deleted":
            return f"the record {where} is deleted" if self.key is not None else f"{self.value!r} leaves {where}"
        if self.kind == "moved":
            return f"{where} moves by {self.value:+}"
        return "nothing else in the state changes"

    def source(self) -> str:
        """The check module of this item: `def check(initial_state, final_state) -> bool`."""
        form = (
            f"{self.kind}_{'key' if self.key is not None else 'item'}"
            if self.kind in ("created", "deleted")
            else self.kind
        )
        body = _BODIES[form].format(path=list(self.path), key=self.key, value=self.value)
        return f"def check(initial_state, final_state):\n    # {self.describe()[:200]}\n{_AT}{body}"


def derive_items(initial: dict[str, Any], final: dict[str, Any]) -> list[CheckItem]:
    """The check items of the change from `initial` to `final`: one per change, then `untouched` (none if equal)."""
    items = _changes(initial, final, ())
    if not items:
        return []
    touched = [list(_touched(item)) for item in items]
    return items + [CheckItem(kind="untouched", path=(), value=touched)]


def derive_checks(initial: dict[str, Any], final: dict[str, Any]) -> list[str]:
    """The check sources of `derive_items(initial, final)`."""
    return [item.source() for item in derive_items(initial, final)]


def _changes(before: Any, after: Any, path: Path) -> list[CheckItem]:
    if isinstance(before, dict) and isinstance(after, dict):
        items = []
        for key in list(before) + [k for k in after if k not in before]:
            if key not in after:
                items.append(CheckItem(kind="deleted", path=path, key=key))
            elif key not in before:
                items.append(
                    CheckItem(kind="created", path=path, key=key, value=after[key])
                    if isinstance(after[key], dict)
                    else CheckItem(kind="changed", path=path + (key,), value=after[key])
                )
            else:
                items += _changes(before[key], after[key], path + (key,))
        return items
    if isinstance(before, list) and isinstance(after, list):
        if len(before) == len(after):
            return [
                item for i, (b, a) in enumerate(zip(before, after, strict=True)) for item in _changes(b, a, path + (i,))
            ]
        if len(after) > len(before) and after[: len(before)] == before:
            return [CheckItem(kind="created", path=path, value=item) for item in after[len(before) :]]
        if len(after) < len(before) and all(after.count(x) <= before.count(x) for x in after):
            gone = list(before)
            for item in after:
                gone.remove(item)
            return [CheckItem(kind="deleted", path=path, value=item) for item in gone]
    if _number(before) and _number(after):
        return [CheckItem(kind="moved", path=path, value=after - before)] if after != before else []
    if type(before) is not type(after) or before != after:
        return [CheckItem(kind="changed", path=path, value=after)]
    return []


def _touched(item: CheckItem) -> Path:
    """The path an item accounts for: the record's key in a map, else the whole collection or field."""
    return item.path + (item.key,) if item.key is not None else item.path


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _dotted(path: Path) -> str:
    return (
        "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(path)) or "state"
    )


# The accessor every check module starts with: (found, value) at a path of keys and list indexes.
_AT = """    def at(state, path):
        for step in path:
            if isinstance(state, dict) and step in state:
                state = state[step]
            elif isinstance(state, list) and isinstance(step, int) and 0 <= step < len(state):
                state = state[step]
            else:
                return False, None
        return True, state

"""
_BODIES = {
    "created_key": """    found, record = at(final_state, {path!r} + [{key!r}])
    existed = at(initial_state, {path!r} + [{key!r}])[0]
    fields = {value!r}
    return found and not existed and isinstance(record, dict) and all(
        name in record and record[name] == fields[name] and type(record[name]) is type(fields[name]) for name in fields
    )
""",
    "created_item": """    old, new = at(initial_state, {path!r})[1], at(final_state, {path!r})[1]
    if not isinstance(old, list) or not isinstance(new, list):
        return False
    return new.count({value!r}) > old.count({value!r})
""",
    "changed": """    found, value = at(final_state, {path!r})
    return found and value == {value!r} and type(value) is type({value!r})
""",
    "deleted_key": """    path = {path!r} + [{key!r}]
    return at(initial_state, path)[0] and not at(final_state, path)[0]
""",
    "deleted_item": """    old, new = at(initial_state, {path!r})[1], at(final_state, {path!r})[1]
    if not isinstance(old, list) or not isinstance(new, list):
        return False
    return new.count({value!r}) < old.count({value!r})
""",
    "moved": """    had, before = at(initial_state, {path!r})
    has, after = at(final_state, {path!r})
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (before, after))
    return had and has and numbers and abs((after - before) - {value!r}) < 1e-9
""",
    "untouched": """    touched = {{tuple(path) for path in {value!r}}}

    def same(a, b, path):
        if path in touched:
            return True
        if isinstance(a, dict) and isinstance(b, dict):
            for key in set(a) | set(b):
                if path + (key,) in touched:
                    continue
                if key not in a or key not in b or not same(a[key], b[key], path + (key,)):
                    return False
            return True
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y, path + (i,)) for i, (x, y) in enumerate(zip(a, b)))
        return type(a) is type(b) and a == b

    return same(initial_state, final_state, ())
""",
}


def verify_chain(
    sandbox: Sandbox, code: str, chain: Chain, *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED,
    contract: Contract = "strict",
) -> tuple[list[str], Evidence]:  # fmt: skip
    """The derived checks of `chain` and the verifier's evidence on them with the chain as gold (every gate,
    the negative control included: a change a later call undid fails it, and the chain is not a scenario; its
    answer facts must be what the gold's reads return: answer_not_read)."""
    checks = derive_checks(chain.initial_state, chain.final_state)
    actions = list(chain.actions)
    return checks, verify(sandbox, code, chain.initial_state, actions, checks, min_gold_calls=1, now=now, seed=seed,
                          contract=contract, facts=chain.facts)  # fmt: skip
