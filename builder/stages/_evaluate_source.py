"""What the evaluate stage reads out of an environment without running it: method sources (AST on the code
string), the state schema test states must follow, and compact JSON views of states for prompts.

Nothing here executes generated code; states are plain JSON data.
"""

from __future__ import annotations

import ast
import json
import textwrap
from typing import Annotated, Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, model_validator

from builder.pyast import parse


def _env_class(code: str) -> ast.ClassDef:
    return next(node for node in parse(code).body if isinstance(node, ast.ClassDef))


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def class_header(code: str) -> str:
    """The class line, its docstring and `__init__`: the state definition the checker judges against."""
    cls = _env_class(code)
    lines = code.splitlines()
    init = _methods(cls).get("__init__")
    end = init.end_lineno if init is not None else cls.body[0].end_lineno
    start = min([cls.lineno] + [d.lineno for d in cls.decorator_list])
    return "\n".join(lines[start - 1 : end])  # the class is top-level, so no dedent is needed


def method_source(code: str, name: str) -> str:
    """The source of method `name`, followed by the private helpers it calls directly (`self._helper(...)`)."""
    methods = _methods(_env_class(code))
    method = methods[name]
    lines = code.splitlines()
    nodes = [method] + [methods[helper] for helper in _called_helpers(method) if helper in methods]
    return "\n\n".join(textwrap.dedent("\n".join(lines[n.lineno - 1 : n.end_lineno])) for n in nodes)


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
        state: state_type  # type: ignore[valid-type]

        @model_validator(mode="after")
        def _follows_schema(self) -> TestState:
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


def state_view(state: dict[str, Any], attributes: list[str]) -> dict[str, Any]:
    """The part of `state` a method uses (all of it when the method names no attribute the state has)."""
    view = {key: state[key] for key in attributes if key in state}
    return view or state
