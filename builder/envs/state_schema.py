"""The JSON schema of an environment state that a model is asked to generate (test states, initial states).

The code stage records a declared schema from the plan; generated classes may drift from it, so the default state
(what `__init__` builds, snapshotted in the sandbox) is the ground truth of which attributes exist, and it fills
in whatever the declared schema does not describe. Every attribute and every field of a record is required: tools
read them all, and a field left out (even an optional one) is a KeyError later.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from builder.json_values import record_pairs


def generated_state_schema(declared: Any, default_state: dict[str, Any]) -> dict[str, Any]:
    """One object schema, every attribute required and no others allowed.

    `declared` is the environment's `state_schema` column: a full object schema (with `properties`) or a map of
    attribute -> schema. Attributes it does not describe, a bare `{"type": "object"}` that says nothing of the
    records inside, or a schema using `$ref` (which cannot be embedded) get a schema inferred from the default
    state instead.
    """
    properties = declared.get("properties", declared) if isinstance(declared, dict) else {}
    if not isinstance(properties, dict) or "$ref" in json.dumps(properties):
        properties = {}
    attributes = list(default_state) or list(properties)
    result = {}
    for attribute in attributes:
        given = properties.get(attribute)
        example = default_state.get(attribute)
        if not isinstance(given, dict) or not given:
            result[attribute] = infer_schema(example)
        elif set(given) <= {"type", "description"} and example:
            described = {"description": given["description"]} if "description" in given else {}
            result[attribute] = {**infer_schema(example), **described}
        else:
            result[attribute] = copy.deepcopy(given)
    for prop in result.values():
        record = record_schema(prop)
        if record is not None and isinstance(record.get("properties"), dict):
            record["required"] = list(record["properties"])
    return {"type": "object", "properties": result, "required": list(result), "additionalProperties": False}


def infer_schema(value: Any) -> dict[str, Any]:
    """A JSON schema that describes `value` and others shaped like it (collections keyed by id stay open)."""
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array", "items": infer_schema(value[0])} if value else {"type": "array"}
    if not isinstance(value, dict):
        return {}  # None in the default state says nothing about the type it will hold
    if not value:
        return {"type": "object"}
    items = list(value.values())
    if all(isinstance(item, dict) for item in items) and len(items) > 1 or _looks_keyed(value):
        # A collection keyed by id (accounts, books): any keys, each value shaped like the first one.
        return {"type": "object", "additionalProperties": infer_schema(items[0])}
    return {
        "type": "object",
        "properties": {key: infer_schema(item) for key, item in value.items()},
        "required": list(value),
    }


def _looks_keyed(value: dict[str, Any]) -> bool:
    """One entry whose value is a record and whose key looks like an id (`acc-1`, `b1`, `c1`)."""
    (key, item), *_ = value.items()
    return isinstance(item, dict) and any(ch.isdigit() for ch in key)


def record_schema(prop: Any) -> dict[str, Any] | None:
    """The schema of one record when `prop` describes a collection of records (map or array of objects)."""
    if not isinstance(prop, dict):
        return None
    items = prop.get("items") if prop.get("type") == "array" else prop.get("additionalProperties")
    return items if isinstance(items, dict) and items.get("type") == "object" else None


def record_collections(schema: dict[str, Any]) -> list[str]:
    """State attributes that hold collections of records (a map of objects or an array of objects)."""
    return [name for name, prop in schema.get("properties", {}).items() if record_schema(prop) is not None]


def reference_problems(state: dict[str, Any], limit: int = 5) -> list[str]:
    """Dangling references: a record field `<entity>_id` whose value is no key (or id) of the `<entity>s` collection.

    A heuristic on naming alone: fields whose stem names no collection are not checked. An empty string or null
    means "no reference" (state schemas say so: "empty if not from a transfer"), never a dangling one.
    """
    problems: list[str] = []
    for collection, records in state.items():
        for key, record in record_pairs(records) or ():
            label = repr(key) if isinstance(records, dict) else str(key)
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


def _known_ids(state: dict[str, Any], stem: str) -> set[str] | None:
    for name in (f"{stem}s", f"{stem}es", stem, f"{stem[:-1]}ies" if stem.endswith("y") else None):
        target = state.get(name) if name else None
        if isinstance(target, dict) and not target:
            return set()  # an empty map of records: nothing can be referenced yet
        pairs = record_pairs(target)
        if pairs is not None and isinstance(target, dict):
            return {key for key, _ in pairs}
        if pairs is not None:
            return {str(v[key]) for _, v in pairs for key in ("id", f"{stem}_id") if key in v}
    return None
