"""OpenAI tool schemas derived from an environment's source: signatures, type hints and docstrings.

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

Imported code (`contract="import"`) may lack hints or use types with no schema: a parameter then takes the type
its docstring names (Google `name (type):`, NumPy `name : type`, reST `:type name:`; envs/docstrings.py), else
it is unconstrained (`{}`), and the lint problems behind it travel with the interface as counted warnings.
Async methods and methods named like runtime hooks are never tools (strict refuses them; import leaves them out).
A module may hold several classes under import: the environment is the last with public methods.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.docstrings import docstring_type_schema, parse_docstring
from builder.envs.lint import RESERVED_TOOLS, Contract, ContractError, Problem, lint, problem_counts, refused
from builder.envs.signatures import annotation_schema, environment_class, tool_methods, tool_parameters
from builder.pyast import parse

# transformers' get_json_schema rule: an argument text ending in `(choices: [...])` becomes an enum.
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


class EnvInterface(BaseModel):
    """What the runtime needs to know about an environment module without running it."""

    model_config = ConfigDict(frozen=True)

    class_name: str
    tools: tuple[dict[str, Any], ...]
    contract: Contract = "strict"
    problems: tuple[Problem, ...] = ()  # under import: the lint problems, as information

    @property
    def warnings(self) -> dict[str, int]:
        """The lint problems under import, counted by code (empty under strict, which refuses them)."""
        return problem_counts(self.problems)

    @property
    def tool_names(self) -> tuple[str, ...]:
        """Tool names in definition order."""
        return tuple(tool["function"]["name"] for tool in self.tools)


def inspect_source(source: str, contract: Contract = "strict") -> EnvInterface:
    """Lint `source` and derive its interface. Raises ContractError listing the problems `contract` refuses: every
    one under strict; under import only a module that does not parse or has no class with public methods (the
    others are the interface's `problems`; the environment is the last such class, `environment_class`)."""
    problems = lint(source)
    refusing = refused(problems, contract)
    if refusing:
        raise ContractError(refusing)
    cls = environment_class(parse(source))
    if cls is None:  # import only (strict refuses `no_tools` first): classes, none of them with public methods
        raise ContractError([Problem(code="no_env_class", line=0, message="no class with public methods")])
    methods = [m for m in tool_methods(cls) if isinstance(m, ast.FunctionDef) and m.name not in RESERVED_TOOLS]
    tools = tuple(tool_schema(method) for method in methods)
    return EnvInterface(class_name=cls.name, tools=tools, contract=contract, problems=tuple(problems))


def tools_json(interface: EnvInterface) -> str:
    """The tools as an OpenAI `tools` JSON list: stable bytes for the same source."""
    return json.dumps(list(interface.tools), indent=2, ensure_ascii=False)


def tool_schema(method: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """The function schema of one method, as `transformers.utils.get_json_schema` gives it for contract-clean code."""
    docstring = (ast.get_docstring(method) or "").strip()
    doc = parse_docstring(docstring)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in tool_parameters(method):
        documented = doc.parameters.get(arg.arg)
        schema = _parameter_schema(arg.annotation, documented.type if documented else None)
        if documented is not None:
            schema = _described(schema, documented.description)
        if default is None:
            required.append(arg.arg)
        properties[arg.arg] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function = {"name": method.name, "description": doc.description, "parameters": parameters}
    if method.returns is not None:
        function["return"] = _return_schema(method.returns, doc.returns)
    return {"type": "function", "function": function}


def _parameter_schema(annotation: ast.expr | None, documented_type: str | None) -> dict[str, Any]:
    """The hint's schema; without a usable hint (only imported code gets here) the docstring's type, else `{}`."""
    if annotation is not None:
        try:
            return annotation_schema(annotation)
        except (ValueError, SyntaxError):
            pass
    return docstring_type_schema(documented_type) or {}


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


def _return_schema(annotation: ast.expr, returns: str | None) -> dict[str, Any]:
    try:
        schema = annotation_schema(annotation)
    except (ValueError, SyntaxError):  # transformers calls a class it does not know an object
        schema = {"type": "object"}
    return {**schema, "description": returns} if returns is not None else schema
