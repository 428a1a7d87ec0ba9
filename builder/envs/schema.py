"""OpenAI tool schemas derived from an environment's source: signatures, type hints and Google docstrings.

Everything is read from the AST, so deriving schemas never runs generated code. The output is stable: the
same source gives the same schema bytes (`tools_json`). Supported parameter types: str, int, float, bool,
Any, None, list[X], dict[str, X], tuple[X, ...], Optional[X], X | Y, Union[...], Literal[...]; a default
makes a parameter optional.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.lint import RESERVED_TOOLS, ContractError, Problem, lint
from builder.pyast import parse

JSON_TYPES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}
SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):\s*$")
ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


class EnvInterface(BaseModel):
    """What the runtime needs to know about an environment module without running it."""

    model_config = ConfigDict(frozen=True)

    class_name: str
    tools: tuple[dict[str, Any], ...]

    @property
    def tool_names(self) -> tuple[str, ...]:
        """Tool names in definition order."""
        return tuple(tool["function"]["name"] for tool in self.tools)


def inspect_source(source: str) -> EnvInterface:
    """Lint `source` and derive its interface; raises ContractError listing every problem."""
    problems = lint(source)
    if problems:
        raise ContractError(problems)
    cls = next(node for node in parse(source).body if isinstance(node, ast.ClassDef))
    return EnvInterface(class_name=cls.name, tools=tuple(tool_schema(method) for method in tool_methods(cls)))


def tools_json(interface: EnvInterface) -> str:
    """The tools as an OpenAI `tools` JSON list: stable bytes for the same source."""
    return json.dumps(list(interface.tools), indent=2, ensure_ascii=False)


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


def class_problems(cls: ast.ClassDef) -> list[Problem]:
    """Contract problems of the environment class: constructor, tool names, hints, types, docstrings."""
    problems: list[Problem] = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            if len(args.args) - len(args.defaults) > 1 or args.kwonlyargs and None in args.kw_defaults:
                problems.append(_problem("init_arguments", node, "__init__ must work with no arguments"))
    methods = tool_methods(cls)
    if not methods:
        problems.append(_problem("no_tools", cls, f"class {cls.name} has no public methods to serve as tools"))
    for method in methods:
        problems += _method_problems(method)
    return problems


def _method_problems(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Problem]:
    name = method.name
    if isinstance(method, ast.AsyncFunctionDef):
        return [_problem("async_tool", method, f"{name}: make it a plain `def`")]
    if name in RESERVED_TOOLS:
        return [_problem("reserved_tool_name", method, f"{name} is reserved for the runtime; rename the tool")]
    problems = []
    if method.args.vararg or method.args.kwarg:
        problems.append(_problem("variadic_parameters", method, f"{name}: replace *args/**kwargs by named ones"))
    if method.returns is None:
        problems.append(_problem("missing_type_hint", method, f"{name}: add a return type hint"))
    docstring = ast.get_docstring(method)
    documented = parse_docstring(docstring or "")[1]
    if not docstring:
        problems.append(_problem("missing_docstring", method, f"{name}: add a docstring with Args and Returns"))
    for arg in _parameters(method):
        where = f"{name}({arg.arg})"
        if arg.annotation is None:
            problems.append(_problem("missing_type_hint", arg, f"{where}: add a type hint"))
            continue
        try:
            annotation_schema(arg.annotation)
        except ValueError as error:
            problems.append(_problem("unsupported_type", arg, f"{where}: {error}"))
        if docstring and arg.arg not in documented:
            problems.append(_problem("undocumented_parameter", arg, f"{where}: describe it under Args:"))
    return problems


def _problem(code: str, node: ast.AST, message: str) -> Problem:
    return Problem(code=code, line=getattr(node, "lineno", 0), message=message)


def _parameters(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    args = method.args
    return (args.posonlyargs + args.args)[1:] + args.kwonlyargs


def tool_schema(method: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """The OpenAI function schema of one (contract-clean) method."""
    summary, descriptions = parse_docstring(ast.get_docstring(method) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in _parameters_with_defaults(method):
        schema = annotation_schema(arg.annotation) if arg.annotation is not None else {}
        if arg.arg in descriptions:
            schema = {**schema, "description": descriptions[arg.arg]}
        if default is None:
            required.append(arg.arg)
        else:
            try:
                schema["default"] = ast.literal_eval(default)
            except ValueError:
                pass
        properties[arg.arg] = schema
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return {"type": "function", "function": {"name": method.name, "description": summary, "parameters": parameters}}


def _parameters_with_defaults(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.arg, Any]]:
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
        return _union([node.left, node.right])
    if isinstance(node, ast.Subscript):
        return _subscript_schema(_type_name(node.value), node.slice)
    raise ValueError(f"type {ast.unparse(node)!r} has no JSON schema; use str, int, float, bool, list, dict")


def _subscript_schema(outer: str, inner: ast.expr) -> dict[str, Any]:
    items = list(inner.elts) if isinstance(inner, ast.Tuple) else [inner]
    if outer == "Optional":
        return _union([items[0], ast.Constant(None)])
    if outer == "Union":
        return _union(items)
    if outer == "Literal":
        values = [ast.literal_eval(item) for item in items]
        kinds = sorted({JSON_TYPES.get(type(v).__name__, "null") for v in values})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}
    if outer in ("list", "List", "Sequence", "set", "Set", "frozenset"):
        return {"type": "array", "items": annotation_schema(items[0])}
    if outer in ("tuple", "Tuple"):
        if len(items) == 2 and isinstance(items[1], ast.Constant) and items[1].value is Ellipsis:
            return {"type": "array", "items": annotation_schema(items[0])}
        return {"type": "array", "prefixItems": [annotation_schema(i) for i in items], "minItems": len(items)}
    if outer in ("dict", "Dict", "Mapping"):
        return {"type": "object", "additionalProperties": annotation_schema(items[-1])}
    raise ValueError(f"type {outer}[...] has no JSON schema; use list[...], dict[str, ...], Optional or Literal")


def _union(members: list[ast.expr]) -> dict[str, Any]:
    schemas = [annotation_schema(member) for member in members]
    if all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
        return {"type": [s["type"] for s in schemas]}
    return {"anyOf": schemas}


def _type_name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # typing.Optional, t.List, ...
        return node.attr
    return ""


def parse_docstring(docstring: str) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (description, {parameter: description})."""
    lines = docstring.expandtabs().splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section, current, indent = None, None, 0
    for line in lines:
        header = SECTION.match(line)
        if header:
            section, current = header.group(1), None
            continue
        if section is None:
            summary.append(line.strip())
        elif section in ("Args", "Arguments", "Parameters") and line.strip():
            width = len(line) - len(line.lstrip())
            match = ARG_LINE.match(line)
            if match and (current is None or width <= indent):
                current, indent = match.group(1).lstrip("*"), width
                params[current] = match.group(3).strip()
            elif current is not None:
                params[current] = f"{params[current]} {line.strip()}".strip()
    return " ".join(" ".join(summary).split()), params
