"""Which tools a NEGATIVE case can test: whether some schema-valid argument of a tool is one a correct
implementation must refuse (read from the tool's JSON schema alone)."""

from __future__ import annotations

import re
from typing import Any


def admits_wrong_value(parameters: dict[str, Any]) -> bool:
    """Whether some schema-valid argument of a tool is one a correct implementation must refuse.

    Enums (a value the state or a rule forbids) always can be wrong; strings when they are required (empty or
    malformed text), name a record (`*_id`: an id that names nothing) or have a format (a date, a pattern, a
    length); numbers, lists and objects when they are required or bounded (an amount out of range). An optional
    flag or free-text filter cannot: every value is valid (`city="Lyon"` finding nothing is a correct answer), so a
    NEGATIVE case of a tool with only such parameters (or none) has nothing to test.
    """
    required = set(parameters.get("required", []))
    properties = parameters.get("properties", {})
    return any(_can_be_wrong(name, schema, name in required) for name, schema in properties.items())


def _can_be_wrong(name: str, schema: dict[str, Any], required: bool) -> bool:
    if "enum" in schema:
        return True
    if "anyOf" in schema:
        return any(_can_be_wrong(name, option, required) for option in schema["anyOf"])
    kinds = schema.get("type", ["string", "number"])  # no type: Any, which accepts wrong values too
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if kind == "string" and (required or _formatted(name, schema)):
            return True
        if kind in ("integer", "number") and (required or _BOUNDS & set(schema)):
            return True
        if kind == "array" and (
            required or "minItems" in schema or _can_be_wrong(name, schema.get("items", {}), False)
        ):
            return True
        if kind == "object" and required:
            return True
    return False


_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_STRING_RULES = {"format", "pattern", "minLength", "maxLength"}
# Words in a parameter's name or description that give its text a format a wrong value can break.
_FORMAT_WORDS = re.compile(r"\b(id|date|time|datetime|email|iso|yyyy|hh:mm|format|phone|url)\b|_id$|date|time")


def _formatted(name: str, schema: dict[str, Any]) -> bool:
    return bool(_STRING_RULES & set(schema)) or bool(
        _FORMAT_WORDS.search(name.casefold()) or _FORMAT_WORDS.search(str(schema.get("description", "")).casefold())
    )
