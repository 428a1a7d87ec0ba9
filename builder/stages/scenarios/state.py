"""The static gates a generated initial state must pass before it is loaded: records per entity and attributes
the class has (references between entities: `builder.envs.state_schema.reference_problems`).

Pure functions over JSON data; nothing here runs generated code.
"""

from __future__ import annotations

from typing import Any

from builder.envs.state_schema import record_collections


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
