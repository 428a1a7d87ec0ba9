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
