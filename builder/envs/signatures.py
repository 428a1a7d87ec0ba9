"""How an environment class declares its tools, read from the AST: which methods are tools, their parameters
and the JSON schema of a type hint (what the docstring says is read by envs/docstrings.py).

The contract lint checks these declarations (envs/lint.py) and the schema derivation turns them into OpenAI tool
schemas (envs/schema.py); both read them here, so neither needs the other.
"""

from __future__ import annotations

import ast
from typing import Any

from builder.pyast import parse

JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}


def environment_class(tree: ast.Module) -> ast.ClassDef | None:
    """The environment class of a module: the last top-level class with public methods (None: there is none).

    Generated code has exactly one class (the strict lint refuses more); imported modules put their helpers first
    (EnvScaler's TypedDicts, BFCL's File and Directory before the API class), so the last one is the environment.
    """
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and tool_methods(node)]
    return classes[-1] if classes else None


def tool_methods(cls: ast.ClassDef) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """The public methods of `cls` in definition order (properties, static and class methods are not tools)."""
    methods = []
    for node in cls.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
        if decorators & {"property", "staticmethod", "classmethod", "setter"}:
            continue
        methods.append(node)
    return methods


def tool_parameters(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.arg, ast.expr | None]]:
    """The tool parameters of `method` (everything after `self`) in order, each with its default (None: required)."""
    args = method.args
    positional = args.posonlyargs + args.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults, strict=True))[1:]
    return pairs + list(zip(args.kwonlyargs, args.kw_defaults, strict=True))


def annotation_schema(node: ast.expr) -> dict[str, Any]:
    """JSON schema of a type annotation; raises ValueError (with advice) for unsupported types."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return annotation_schema(parse(node.value, mode="eval").body)
    if isinstance(node, ast.Constant) and node.value is None:
        return {"type": "null"}
    name = _type_name(node)
    if name in JSON_TYPES:
        return {"type": JSON_TYPES[name]}
    if name == "Any":
        return {}
    if name in ("list", "List", "Sequence", "tuple", "Tuple"):
        return {"type": "array"}
    if name in ("dict", "Dict", "Mapping"):
        return {"type": "object"}
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union(_members(node))
    if isinstance(node, ast.Subscript):
        return _subscript_schema(_type_name(node.value), node.slice)
    raise ValueError(f"type {ast.unparse(node)!r} has no JSON schema; use str, int, float, bool, list, dict")


def _subscript_schema(outer: str, inner: ast.expr) -> dict[str, Any]:
    items = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
    if outer in ("Optional", "Union"):
        return _union(_members(ast.Subscript(value=ast.Name(id=outer), slice=inner)))
    if outer == "Literal":
        values = [ast.literal_eval(item) for item in items]
        kinds = list(dict.fromkeys(JSON_TYPES.get(type(v).__name__, "null") for v in values))  # first-seen order
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}
    if outer in ("list", "List", "Sequence", "set", "Set", "frozenset"):
        return {"type": "array", "items": annotation_schema(items[0])}
    if outer in ("tuple", "Tuple"):
        if len(items) == 2 and isinstance(items[1], ast.Constant) and items[1].value is Ellipsis:
            return {"type": "array", "items": annotation_schema(items[0])}
        if len(items) == 1:
            raise ValueError(f"type tuple[{ast.unparse(items[0])}] holds one value; use list[...] or the value's type")
        return {"type": "array", "prefixItems": [annotation_schema(i) for i in items]}
    if outer in ("dict", "Dict", "Mapping"):
        return {"type": "object", "additionalProperties": annotation_schema(items[-1])}
    raise ValueError(f"type {outer}[...] has no JSON schema; use list[...], dict[str, ...], Optional or Literal")


def _union(members: list[ast.expr]) -> dict[str, Any]:
    """As transformers: the members but None; one is itself, plain types a sorted list, others `anyOf`; a None
    member adds `nullable`."""
    schemas = [annotation_schema(member) for member in members if not _is_none(member)]
    if not schemas:
        return {"type": "null"}
    if len(schemas) == 1:
        schema = dict(schemas[0])
    elif all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
        kinds = sorted({s["type"] for s in schemas})
        schema = {"type": kinds[0] if len(kinds) == 1 else kinds}
    else:
        schema = {"anyOf": schemas}
    if len(schemas) < len(members):
        schema["nullable"] = True
    return schema


def _members(node: ast.expr) -> list[ast.expr]:
    """The flat, de-duplicated members of a union, as `typing` makes them (`Optional[int | str]`: int, str, None)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        found = _members(node.left) + _members(node.right)
    elif isinstance(node, ast.Subscript) and _type_name(node.value) in ("Optional", "Union"):
        items = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        extra = [ast.Constant(None)] if _type_name(node.value) == "Optional" else []
        found = [member for item in items + extra for member in _members(item)]
    else:
        found = [node]
    unique: dict[str, ast.expr] = {}
    for member in found:
        unique.setdefault(ast.dump(member), member)
    return list(unique.values())


def _is_none(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _is_none(parse(node.value, mode="eval").body)
    return isinstance(node, ast.Constant) and node.value is None


def _type_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.Optional, t.List, ...
        return node.attr
    return ""


def tool_defaults(source: str) -> dict[str, dict[str, Any]]:
    """`{tool: {parameter: default}}` of the literal defaults in `source` (the schemas do not show them)."""
    cls = environment_class(parse(source))
    found: dict[str, dict[str, Any]] = {}
    for method in tool_methods(cls) if cls is not None else []:
        for arg, default in tool_parameters(method):
            if default is not None:
                try:
                    found.setdefault(method.name, {})[arg.arg] = ast.literal_eval(default)
                except ValueError:
                    pass
    return found
