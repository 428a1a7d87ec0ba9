"""Snapshots of a session's state as JSON data: decoding a worker's reply, building a snapshot from the previous
one and the records that changed, and the differences between two snapshots.

Consecutive snapshots of a session share every value that did not change (`patched`), and `diff_states` of two
of them looks only at what the worker reported as changed, so both cost what changed, not the size of the state.
"""

from __future__ import annotations

import json
import weakref
from itertools import compress, repeat
from operator import is_not
from typing import Any

from builder.sandbox.frames import quiet_collector

_DECODER = json.JSONDecoder()


def from_json(text: str) -> Any:
    """Decode the JSON text of a reply. `raw_decode` skips the argument checks and the two whitespace regexes of
    `json.loads` (half its cost on a small result; the worker's encoder emits no whitespace around the value) and
    still reports where the value ended, so trailing data is refused as before."""
    with quiet_collector(len(text)):
        value, end = _DECODER.raw_decode(text)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def patched(state: dict[str, Any], patches: Any) -> dict[str, Any]:
    """A new snapshot: `state` with each `[attribute, key or None, JSON text or None]` of a worker's reply
    applied (None text: deleted; an index one past a list's end: appended). Containers on a patched path are
    copied, everything else is shared, so `state` itself is left as it was. Raises ValueError, TypeError,
    KeyError or IndexError for a reply that does not fit the state (only a tampered worker sends one)."""
    if type(patches) is not list:
        raise TypeError("patches must be a list")
    new = dict(state)
    copied: set[str] = set()
    for patch in patches:
        name, key, text = patch
        if type(name) is not str or (text is not None and type(text) is not str):
            raise TypeError("bad patch")
        value = None if text is None else from_json(text)
        if key is None:
            if text is None:
                new.pop(name, None)
            else:
                new[name] = value
                copied.add(name)  # a fresh value: later patches of it may change it in place
            continue
        if name not in copied:
            container = new[name]
            if type(container) not in (dict, list):
                raise TypeError("patch inside a value that is not a container")
            new[name] = container.copy()
            copied.add(name)
        container = new[name]
        if type(container) is dict and type(key) is str:
            if text is None:
                container.pop(key, None)
            else:
                container[key] = value
        elif type(container) is list and type(key) is int and 0 <= key <= len(container) and text is not None:
            if key == len(container):
                container.append(value)
            else:
                container[key] = value
        else:
            raise TypeError("bad patch key")
    return new


class Lineage:
    """What a snapshot was patched from: `new`, the `old` snapshot and attribute -> patched keys (None: the
    whole attribute). A session keeps the last one (so at most one earlier snapshot lives on because of it)."""

    def __init__(self, new: dict[str, Any], old: dict[str, Any], patches: list[Any]) -> None:
        self.new, self.old = new, old
        self.touched: dict[str, set[Any] | None] = {}
        for name, key, _text in patches:
            if key is None:
                self.touched[name] = None
            elif name not in self.touched or self.touched[name] is not None:
                self.touched.setdefault(name, set()).add(key)  # type: ignore[union-attr]


# id(snapshot) -> the owner whose `lineage` may describe it, weakly: `diff_states` finds a session's last
# patch from the snapshot alone. Stale entries are harmless (the lineage is checked by identity) and few.
_OWNERS: dict[int, weakref.ref[Any]] = {}
_OWNERS_SIZE = 1024


def remember(owner: Any, lineage: Lineage) -> None:
    """Let `diff_states(lineage.old, lineage.new)` use `owner.lineage` while it is that lineage."""
    owner.lineage = lineage
    _OWNERS[id(lineage.new)] = weakref.ref(owner)
    while len(_OWNERS) > _OWNERS_SIZE:
        del _OWNERS[next(iter(_OWNERS))]


def _lineage_of(before: Any, after: Any) -> Lineage | None:
    reference = _OWNERS.get(id(after))
    lineage = getattr(reference() if reference is not None else None, "lineage", None)
    if isinstance(lineage, Lineage) and lineage.new is after and lineage.old is before:
        return lineage
    return None


def diff_states(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """Every difference between two JSON snapshots as `{"path", "before", "after"}` (missing side: absent).

    Paths use dots for keys and `[i]` for list items; lists of different length are reported whole. A value of
    another type is a change even when Python calls it equal (`1` -> `True`, `1` -> `1.0`).
    """
    changes: list[dict[str, Any]] = []
    lineage = _lineage_of(before, after)
    if lineage is not None:
        _diff_patched(before, after, lineage.touched, [path] if path else [], changes)
    else:
        _diff(before, after, [path] if path else [], changes)
    return changes


def _diff_patched(
    before: dict[str, Any], after: dict[str, Any], touched: dict[str, set[Any] | None], parts: list[str | int],
    changes: list[dict[str, Any]],
) -> None:  # fmt: skip
    """`_diff` of a snapshot and the one `patched` built from it: the same changes in the same order, looking
    only at the patched attributes (the others are the same objects) and, where one record of a dict or any
    records of a list of the same length were patched, only at those."""
    for name, value in before.items():
        if name not in after:
            changes.append({"path": _path(parts, name), "before": value})
            continue
        other = after[name]
        keys = touched.get(name, ())
        if value is other:
            continue
        parts.append(name)
        if keys and type(value) is dict and type(other) is dict and len(keys) == 1:
            (key,) = keys
            if key in before[name] or key in other:
                _diff({key: value[key]} if key in value else {}, {key: other[key]} if key in other else {},
                      parts, changes)  # fmt: skip
        elif keys and type(value) is list and type(other) is list and len(value) == len(other):
            for index in sorted(keys):
                parts.append(index)
                _diff(value[index], other[index], parts, changes)
                parts.pop()
        else:
            parts.pop()
            _diff({name: value}, {name: other}, parts, changes)
            continue
        parts.pop()
    for name, other in after.items():
        if name not in before:
            changes.append({"path": _path(parts, name), "after": other})


_SCALARS = (str, int, float, bool, type(None))


def _diff(before: Any, after: Any, parts: list[str | int], changes: list[dict[str, Any]]) -> None:
    # A state of tens of MB has millions of values: the walk compares scalars inline and builds a path only for a
    # change (formatting every path it passes cost more than the comparisons). Consecutive snapshots of a session
    # share every value that did not change, and the same object is equal to itself (a snapshot holds no NaN),
    # so a big container first picks, in C, the entries that are not the same object on both sides.
    kind = type(before)
    if kind is dict and type(after) is dict:
        if before is after:
            return
        keys: Any = before
        if len(before) > _SCAN_FROM:
            keys = compress(before, map(is_not, before.values(), map(after.get, before, repeat(_ABSENT))))
        removed = False
        for key in keys:
            value = before[key]
            if key not in after:
                removed = True
                changes.append({"path": _path(parts, key), "before": value})
                continue
            other = after[key]
            if type(value) is type(other) and type(value) in _SCALARS:
                if value != other:
                    changes.append({"path": _path(parts, key), "before": value, "after": other})
                continue
            parts.append(key)
            _diff(value, other, parts, changes)
            parts.pop()
        if len(after) == len(before) and not removed:
            return  # every key of `before` is in `after` and there are as many: no key was added
        for key, other in after.items():
            if key not in before:
                changes.append({"path": _path(parts, key), "after": other})
    elif kind is list and type(after) is list and len(before) == len(after):
        if before is after:
            return
        indexes: Any = range(len(before))
        if len(before) > _SCAN_FROM:
            indexes = compress(indexes, map(is_not, before, after))
        for index in indexes:
            parts.append(index)
            _diff(before[index], after[index], parts, changes)
            parts.pop()
    elif kind is not type(after) or before != after:
        changes.append({"path": _path(parts), "before": before, "after": after})


_SCAN_FROM = 64  # from this many entries, picking the changed ones in C first pays for itself
_ABSENT = object()


def _path(parts: list[str | int], last: str | None = None) -> str:
    text = ""
    for part in parts if last is None else [*parts, last]:
        if isinstance(part, int):
            text = f"{text}[{part}]"
        else:
            text = f"{text}.{part}" if text else str(part)
    return text
