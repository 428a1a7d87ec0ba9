"""OpenAI tool schemas derived from an environment's source: signatures, type hints and Google docstrings.

The convention is the one trainers derive from Python methods, `transformers.utils.get_json_schema` (TRL's
`GRPOTrainer(environment_factory=...)` and `apply_chat_template(tools=[method, ...])` call it): `X | None` is
`X`'s schema with `"nullable": true`, a union of plain types is a sorted type list, defaults are not shown,
`required` is left out when empty, parameters carry no `additionalProperties`, and `function.return` holds the
return type with the `Returns:` text. The summary and that text are cut from the docstring by the same rules as
transformers, so the published `tools`, the SFT prompt and the GRPO prompt render the same bytes. Tool
parameters are still a closed set (a method has no **kwargs): `builder.envs.validate` rejects unknown
arguments without an `additionalProperties: false` in the schema.

Everything is read from the AST, so deriving schemas never runs generated code. The output is stable: the
same source gives the same schema bytes (`tools_json`). Supported parameter types: str, int, float, bool,
Any, None, list[X], dict[str, X], tuple[X, ...], tuple[X, Y, ...], Optional[X], X | Y, Union[...],
Literal[...]; a default makes a parameter optional (`tool_defaults` lists the defaults).
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
# transformers' get_json_schema rules (chat_template_utils, 5.x): the description is the text before the first
# Args:/Returns:/Raises:, the return text what follows `Returns:` up to `Raises:`, and an argument text ending in
# `(choices: [...])` becomes an enum.
DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


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
    """The function schema of one (contract-clean) method, as `transformers.utils.get_json_schema` gives it."""
    docstring = (ast.get_docstring(method) or "").strip()
    descriptions = parse_docstring(docstring)[1]
    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in _parameters_with_defaults(method):
        schema = annotation_schema(arg.annotation) if arg.annotation is not None else {}
        if arg.arg in descriptions:
            schema = _described(schema, descriptions[arg.arg])
        if default is None:
            required.append(arg.arg)
        properties[arg.arg] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    summary = DESCRIPTION.match(docstring)
    function = {"name": method.name, "description": summary.group(1).strip() if summary else "",
                "parameters": parameters}  # fmt: skip
    if method.returns is not None:
        function["return"] = _return_schema(method.returns, RETURNS.search(docstring))
    return {"type": "function", "function": function}


def _described(schema: dict[str, Any], description: str) -> dict[str, Any]:
    choices = CHOICES.search(description)
    if choices:
        try:
            values = json.loads(choices.group(1))
        except json.JSONDecodeError:
            values = None
        if isinstance(values, list):
            schema = {**schema, "enum": [value.strip() if isinstance(value, str) else value for value in values]}
            description = description[: choices.start()].strip()
    return {**schema, "description": description}


def _return_schema(annotation: ast.expr, returns: re.Match[str] | None) -> dict[str, Any]:
    try:
        schema = annotation_schema(annotation)
    except ValueError:  # transformers calls a class it does not know an object
        schema = {"type": "object"}
    return {**schema, "description": returns.group(1).strip()} if returns else schema


def tool_defaults(source: str) -> dict[str, dict[str, Any]]:
    """`{tool: {parameter: default}}` of the literal defaults in `source` (the schemas do not show them)."""
    cls = next((node for node in parse(source).body if isinstance(node, ast.ClassDef)), None)
    found: dict[str, dict[str, Any]] = {}
    for method in tool_methods(cls) if cls is not None else []:
        for arg, default in _parameters_with_defaults(method):
            if default is not None:
                try:
                    found.setdefault(method.name, {})[arg.arg] = ast.literal_eval(default)
                except ValueError:
                    pass
    return found


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
