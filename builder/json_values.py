"""Walking JSON-like values (dicts, lists, scalars), as model output, states and seed records are."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def leaves(value: Any) -> Iterator[Any]:
    """Every scalar inside `value` (dict values and list items, recursively), in order."""
    if isinstance(value, dict):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def record_pairs(value: Any) -> list[tuple[Any, dict[str, Any]]] | None:
    """The (key, record) pairs of a collection of records, else None. A collection of records is a non-empty map
    whose values are all objects (keyed by the record's key) or a non-empty list whose items are all objects
    (keyed by position). The one rule every stage uses."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return list(value.items())
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return list(enumerate(value))
    return None


def added_records(before: dict[str, Any], after: dict[str, Any]) -> Iterator[tuple[str, Any, dict[str, Any]]]:
    """The records `after` adds to a collection keyed by id (a map in both states), as (collection, key, record)."""
    for collection, records in after.items():
        old = before.get(collection)
        if not isinstance(records, dict) or not isinstance(old, dict):
            continue
        for key, record in records.items():
            if key not in old and isinstance(record, dict):
                yield collection, key, record
