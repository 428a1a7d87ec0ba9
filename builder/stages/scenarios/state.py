"""Initial states for scenarios: the structured-output model built from an environment's state schema, and the
static gates a generated state must pass before it is loaded (records per entity, references between entities).

Pure functions over JSON data; nothing here runs generated code.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import jsonschema
from pydantic import RootModel, model_validator

from builder.envs.state_schema import record_collections
from builder.sandbox.world import normalized_now

NOW_SCHEMA = {
    "type": "string",
    "description": "The scenario's current local date-time, ISO 8601 without a time zone (YYYY-MM-DDTHH:MM:SS), "
    "consistent with the dates in the state.",
}


def state_model(schema: dict[str, Any]) -> type[RootModel[dict[str, Any]]]:
    """A pydantic type for structured output `{"now": <date-time>, "state": <a state valid against schema>}`.

    `now` comes first, so the model picks "today" before it writes the dates around it; it must be an ISO 8601
    naive date-time and is normalised to whole seconds (`2024-06-01T09:00:00`).
    """
    wrapped = {
        "type": "object",
        "properties": {"now": NOW_SCHEMA, "state": schema},
        "required": ["now", "state"],
        "additionalProperties": False,
    }

    class InitialState(RootModel[dict[str, Any]]):
        SCHEMA: ClassVar[dict[str, Any]] = wrapped

        @classmethod
        def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
            return copy.deepcopy(cls.SCHEMA)

        @model_validator(mode="after")
        def _matches_schema(self) -> InitialState:
            problem = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(wrapped).iter_errors(self.root))
            if problem is not None:
                where = "/".join(str(part) for part in problem.absolute_path) or "(reply)"
                raise ValueError(f"{where}: {problem.message}"[:500])
            self.root["now"] = normalized_now(self.root["now"])
            return self

    return InitialState


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


def reference_problems(state: dict[str, Any], limit: int = 5) -> list[str]:
    """Dangling references: a record field `<entity>_id` whose value is no key (or id) of the `<entity>s` collection.

    A heuristic on naming alone: fields whose stem names no collection are not checked. An empty string or null
    means "no reference" (state schemas say so: "empty if not from a transfer"), never a dangling one.
    """
    problems: list[str] = []
    for collection, records in state.items():
        for label, record in _records(records):
            for field, value in record.items():
                if not (isinstance(field, str) and field.endswith("_id") and isinstance(value, str) and value.strip()):
                    continue
                known = _known_ids(state, field.removesuffix("_id"))
                if known is not None and value not in known:
                    problems.append(
                        f"{collection}[{label}].{field} = {value!r} is not a known {field.removesuffix('_id')}"
                    )
                    if len(problems) >= limit:
                        return problems
    return problems


def _records(collection: Any) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(collection, dict) and collection and all(isinstance(v, dict) for v in collection.values()):
        return [(repr(key), value) for key, value in collection.items()]
    if isinstance(collection, list):
        return [(str(i), value) for i, value in enumerate(collection) if isinstance(value, dict)]
    return []


def _known_ids(state: dict[str, Any], stem: str) -> set[str] | None:
    for name in (f"{stem}s", f"{stem}es", stem, f"{stem[:-1]}ies" if stem.endswith("y") else None):
        target = state.get(name) if name else None
        if isinstance(target, dict) and all(isinstance(v, dict) for v in target.values()):
            return set(target)
        if isinstance(target, list) and target and all(isinstance(v, dict) for v in target):
            return {str(v[key]) for v in target for key in ("id", f"{stem}_id") if key in v}
    return None
