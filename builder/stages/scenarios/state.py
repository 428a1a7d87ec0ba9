"""The static gates a generated initial state must pass before it is loaded: records per entity and attributes
the class has (references between entities: `builder.envs.state_schema.reference_problems`), and the size each
slot's state is asked for.

Pure functions over JSON data; nothing here runs generated code.
"""

from __future__ import annotations

from typing import Any

from builder.envs.state_schema import record_collections

SIZE_SPREAD = 4  # the last slot of an environment asks for this many times `min_records` records per collection


def slot_records(slot: int, slots: int, min_records: int) -> int:
    """The records per collection slot `slot` of `slots` asks its initial state for: from `min_records` for the
    first slot up to `SIZE_SPREAD` times that for the last, evenly spread (3, 4, 6, 7, 8, 9, 11, 12 for 8 slots
    and 3), so an environment's tasks are played on states from small to large."""
    if slots <= 1:
        return min_records
    return round(min_records * (1 + (SIZE_SPREAD - 1) * min(slot, slots - 1) / (slots - 1)))


def size_problems(state: dict[str, Any], schema: dict[str, Any], min_records: int) -> list[str]:
    """One message per record collection with fewer than `min_records` records."""
    return [
        f"{name} holds {len(state.get(name) or ())} records; give it at least {min_records} realistic records"
        for name in record_collections(schema)
        if isinstance(state.get(name), dict | list) and len(state[name]) < min_records
    ]


def attribute_problems(state: dict[str, Any], example: dict[str, Any]) -> list[str]:
    """Attributes the class does not have (its default state lacks them): a state schema that drifted from the
    code would otherwise set data no tool ever reads. Nothing is checked when the default state is empty."""
    if not example:
        return []
    known = ", ".join(sorted(example))
    return [f"{name} is not an attribute of the environment (it has: {known})" for name in state if name not in example]
