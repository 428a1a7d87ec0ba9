"""What the evaluate stage reads out of an environment without running it: method sources and the module's
docstring (AST on the code string), which tools admit a wrong value, the state schema test states must follow,
and compact JSON views of states for prompts, cut at record boundaries.

Nothing here executes generated code; states are plain JSON data.
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, model_validator

from builder.envs.signatures import environment_class
from builder.pyast import parse
from builder.sandbox.world import DEFAULT_NOW, describe_now, normalized_now


def _env_class(code: str) -> ast.ClassDef:
    # An imported module may put helper classes first (BFCL's File and Directory): take the environment's.
    tree = parse(code)
    cls = environment_class(tree)
    return cls if cls is not None else next(node for node in tree.body if isinstance(node, ast.ClassDef))


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def environment_text(env_description: str, code: str) -> str:
    """What the environment is and the rules it enforces: the module docstring (the code stage writes the plan's
    description and numbered rules there), or the record's description when the module has no docstring."""
    return ast.get_docstring(parse(code)) or env_description


def now_text(now: str) -> str:
    """The environment's date-time as prompts state it (with its weekday, so "tomorrow" comes out right)."""
    return f"{describe_now(now)} (the environment's clock reads this date-time)"


def class_header(code: str) -> str:
    """The class line, its docstring and `__init__`: the state definition the checker judges against."""
    cls = _env_class(code)
    lines = code.splitlines()
    init = _methods(cls).get("__init__")
    end = init.end_lineno if init is not None else cls.body[0].end_lineno
    start = min([cls.lineno] + [d.lineno for d in cls.decorator_list])
    return "\n".join(lines[start - 1 : end])  # the class is top-level, so no dedent is needed


def method_nodes(code: str, name: str) -> list[ast.FunctionDef]:
    """Method `name` followed by the private helpers it calls directly (`self._helper(...)`).

    Raises KeyError when the class has no such method (StopIteration when the module has no class)."""
    methods = _methods(_env_class(code))
    method = methods[name]
    return [method] + [methods[helper] for helper in _called_helpers(method) if helper in methods]


def method_source(code: str, name: str) -> str:
    """The source of method `name`, followed by the private helpers it calls directly (`self._helper(...)`)."""
    lines = code.splitlines()
    return "\n\n".join(textwrap.dedent("\n".join(lines[n.lineno - 1 : n.end_lineno])) for n in method_nodes(code, name))


def _called_helpers(method: ast.FunctionDef) -> list[str]:
    names = []
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func
            if isinstance(target.value, ast.Name) and target.value.id == "self" and target.attr.startswith("_"):
                names.append(target.attr)
    return list(dict.fromkeys(names))


def attributes_used(code: str, name: str) -> list[str]:
    """Instance attributes (`self.x`) that method `name` and the helpers it calls read or write."""
    methods = _methods(_env_class(code))
    nodes = [methods[name]] + [methods[h] for h in _called_helpers(methods[name]) if h in methods]
    used = [
        node.attr
        for method in nodes
        for node in ast.walk(method)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
    ]
    return list(dict.fromkeys(attr for attr in used if attr not in methods))


# -------------------------------------------------------------------------------------------------- tools


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
        if kind == "array" and (required or "minItems" in schema or _can_be_wrong(schema.get("items", {}), False)):
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


# ------------------------------------------------------------------------------------------------- states


class StateShapeError(ValueError):
    pass


def state_output_type(schema: dict[str, Any]) -> type[BaseModel]:
    """The structured-output type of one test state: a `purpose` and a `state` that must satisfy `schema`.

    The state's fields carry the attribute schemas as their JSON schema (so a constrained decoder follows them);
    validation re-checks the whole state with `jsonschema`, and its message goes back to the model on a retry.
    """
    fields: dict[str, Any] = {
        name: (Annotated[Any, WithJsonSchema(sub)], ...) for name, sub in schema["properties"].items()
    }
    state_type = create_model("TestStateValues", __config__=ConfigDict(extra="forbid"), **fields)  # type: ignore[call-overload]

    class TestState(BaseModel):
        model_config = ConfigDict(extra="forbid")

        purpose: str = Field(description="One sentence: what situation this state sets up for testing.", max_length=400)
        # Before the state, so "today" is chosen before the dates around it; the sandbox clock reads it.
        now: str = Field(
            DEFAULT_NOW,
            description="The current local date-time of this state, ISO 8601 without a time zone "
            "(YYYY-MM-DDTHH:MM:SS), consistent with the dates in the state.",
            max_length=40,
        )
        state: state_type  # type: ignore[valid-type]

        @model_validator(mode="after")
        def _follows_schema(self) -> TestState:
            self.now = normalized_now(self.now)
            values = self.state.model_dump()
            errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(values), key=lambda e: e.path)
            if errors:
                described = "; ".join(
                    f"state.{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"[:300] for e in errors[:5]
                )
                raise StateShapeError(described)
            return self

    return TestState


def clip_json(value: Any, limit: int) -> str:
    """`value` as compact JSON, cut to `limit` characters with a note saying how much was left out."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=False, separators=(",", ":"))
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters cut)"


def state_text(state: dict[str, Any], limit: int) -> str:
    """`state` as compact JSON of whole records, within `limit` characters where dropping records gets it there.

    Never cut mid-JSON (a cut hides the ids a positive case needs and leaves text that does not parse): the
    largest collections lose their last records first, and a note after the JSON names what was left out.
    Attributes that are not collections are always shown whole.
    """
    shown = {key: _copy_collection(value) for key, value in state.items()}
    sizes = {key: _record_sizes(value) for key, value in shown.items() if value is not state[key]}
    hidden: dict[str, list[str | None]] = {}
    total = len(_dumps(shown))
    while total + len(_omission_note(hidden)) > limit:
        candidates = [key for key in sizes if sizes[key]]
        if not candidates:
            break
        key = max(candidates, key=lambda k: sum(sizes[k]))
        collection = shown[key]
        if isinstance(collection, dict):
            label, record = next(reversed(collection.items()))
            del collection[label]
            hidden.setdefault(key, []).insert(0, str(label))
        else:
            record = collection.pop()
            hidden.setdefault(key, []).insert(0, _record_label(record))
        total -= sizes[key].pop() + (1 if sizes[key] else 0)  # the record and the comma before it
    return _dumps(shown) + _omission_note(hidden)


def _copy_collection(value: Any) -> Any:
    """A shallow copy of a collection of records (a map or a list) that records can be dropped from; else itself."""
    if isinstance(value, dict) and value and all(isinstance(v, dict | list) for v in value.values()):
        return dict(value)
    if isinstance(value, list) and value:
        return list(value)
    return value


def _record_sizes(collection: dict[str, Any] | list[Any]) -> list[int]:
    """Characters each record takes in the compact JSON of its collection (its key included), in order."""
    if isinstance(collection, dict):
        return [len(_dumps({key: value})) - 2 for key, value in collection.items()]
    return [len(_dumps(value)) for value in collection]


def _record_label(record: Any) -> str | None:
    """The id a record of a list carries (`id` or a field ending in `_id`), if any."""
    if isinstance(record, dict):
        for key in ["id", *(k for k in record if isinstance(k, str) and k.endswith("_id"))]:
            if isinstance(record.get(key), str | int):
                return str(record[key])
    return None


def _omission_note(hidden: dict[str, list[str | None]], shown_ids: int = 8) -> str:
    lines = []
    for key, labels in hidden.items():
        ids = [label for label in labels if label is not None]
        listed = f": ids {', '.join(ids[:shown_ids])}{', …' if len(ids) > shown_ids else ''}" if ids else ""
        lines.append(f"\n… {len(labels)} more {key} not shown{listed}")
    return "".join(lines)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def state_view(state: dict[str, Any], attributes: list[str]) -> dict[str, Any]:
    """The part of `state` a method uses (all of it when the method names no attribute the state has)."""
    view = {key: state[key] for key in attributes if key in state}
    return view or state
