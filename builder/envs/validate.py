"""Check tool arguments against a tool's JSON schema, answering the way a real API would.

Covers the subset `schema.py` emits: type (one or a list), nullable, enum, items, prefixItems, properties,
required, additionalProperties and anyOf, and the older stored form (`["string", "null"]`, `default`,
`additionalProperties: false`). A tool's parameters are a closed set whatever the schema says (a method has no
**kwargs). Runs in the parent on decoded JSON, before anything reaches the sandbox.

`standard_schema` turns the tool convention into JSON Schema proper (`nullable` becomes a null type, tool
parameters are closed) for validators and constrained decoding that know only JSON Schema.
"""

from __future__ import annotations

from typing import Any

_PYTHON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def argument_error(parameters: dict[str, Any], arguments: Any) -> str | None:
    """A one-line message naming the first problem with `arguments`, or None when they fit `parameters`."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {_kind(arguments)}"
    properties = parameters.get("properties", {})
    # This runs on every tool call: plain loops and a keys-view comparison, and the lists for the messages are
    # built only once something is wrong.
    for name in parameters.get("required", ()):
        if name not in arguments:
            missing = [name for name in parameters["required"] if name not in arguments]
            return f"missing required argument(s): {', '.join(missing)}"
    if parameters.get("additionalProperties") in (None, False) and not properties.keys() >= arguments.keys():
        extra = [name for name in arguments if name not in properties]
        return f"unexpected argument(s): {', '.join(extra)}; expected: {', '.join(properties) or 'none'}"
    for name, value in arguments.items():
        schema = properties.get(name)
        if schema is not None:
            error = value_error(schema, value, name)
            if error:
                return error
    return None


def value_error(schema: dict[str, Any], value: Any, path: str) -> str | None:
    """The first mismatch between `value` and `schema` at `path`, or None."""
    if value is None and schema.get("nullable") is True:
        return None
    if "anyOf" in schema:
        if all(value_error(option, value, path) for option in schema["anyOf"]):
            return f"{path}: {_kind(value)} matches none of the allowed types"
        return None
    kinds = schema.get("type")
    if kinds is not None:
        # One type is the common case; it skips building a list and a generator on every call.
        if not (_is(value, kinds) if isinstance(kinds, str) else any(_is(value, kind) for kind in kinds)):
            kinds = [kinds] if isinstance(kinds, str) else kinds
            return f"{path}: expected {' or '.join(kinds)}, got {_kind(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} is not one of {schema['enum']}"
    if isinstance(value, list):
        return _array_error(schema, value, path)
    if isinstance(value, dict):
        if "properties" in schema:
            return argument_error(schema, value)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                error = value_error(extra, item, f"{path}.{key}")
                if error:
                    return error
    return None


def _array_error(schema: dict[str, Any], value: list[Any], path: str) -> str | None:
    prefix = schema.get("prefixItems")
    if prefix is not None:
        if len(value) != len(prefix):
            return f"{path}: expected {len(prefix)} items, got {len(value)}"
        pairs = list(zip(prefix, value, strict=True))
    else:
        pairs = [(schema["items"], item) for item in value] if "items" in schema else []
    for index, (item_schema, item) in enumerate(pairs):
        error = value_error(item_schema, item, f"{path}[{index}]")
        if error:
            return error
    return None


def _is(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, _PYTHON_TYPES.get(kind, (object,)))


def _kind(value: Any) -> str:
    names = {str: "string", bool: "boolean", int: "integer", float: "number", list: "array", dict: "object"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def standard_schema(schema: Any, *, tool_parameters: bool = False) -> Any:
    """`schema` as JSON Schema proper: `"nullable": true` allows null; `tool_parameters` closes the object."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("items", "additionalProperties"):
            value = standard_schema(value)
        elif key in ("anyOf", "prefixItems") and isinstance(value, list):
            value = [standard_schema(option) for option in value]
        elif key == "properties" and isinstance(value, dict):
            value = {name: standard_schema(option) for name, option in value.items()}
        if key != "nullable":
            out[key] = value
    if schema.get("nullable") is True:
        out = _allow_null(out)
    if tool_parameters:
        out.setdefault("additionalProperties", False)
    return out


def _allow_null(schema: dict[str, Any]) -> dict[str, Any]:
    kind = schema.get("type")
    if "anyOf" in schema:
        schema = {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    elif isinstance(kind, str) and kind != "null":
        schema = {**schema, "type": [kind, "null"]}
    elif isinstance(kind, list) and "null" not in kind:
        schema = {**schema, "type": [*kind, "null"]}
    if "enum" in schema and None not in schema["enum"]:
        schema = {**schema, "enum": [*schema["enum"], None]}
    return schema
