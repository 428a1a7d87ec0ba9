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

from builder.envs.lint import Contract, ContractError, Problem, lint
from builder.envs.signatures import annotation_schema, parse_docstring, tool_methods, tool_parameters
from builder.pyast import parse

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


def inspect_source(source: str, contract: Contract = "strict") -> EnvInterface:
    """Lint `source` and derive its interface; raises ContractError listing every problem.

    Under the `import` contract lint problems are not refused; only a module that does not parse or has no class
    with tools is. The environment is then the last top-level class with public methods (EnvScaler's modules put
    TypedDicts first, BFCL's helper classes come before the API class), and a hint without a JSON schema is an
    unconstrained parameter.
    """
    if contract == "strict":
        problems = lint(source)
        if problems:
            raise ContractError(problems)
        cls = next(node for node in parse(source).body if isinstance(node, ast.ClassDef))
    else:
        try:
            tree = parse(source)
        except SyntaxError as error:
            problem = Problem(code="syntax", line=error.lineno or 0, message=f"syntax error: {error.msg}")
            raise ContractError([problem]) from None
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and tool_methods(node)]
        if not classes:
            raise ContractError([Problem(code="no_env_class", line=0, message="no class with public methods")])
        cls = classes[-1]
    return EnvInterface(class_name=cls.name, tools=tuple(tool_schema(method) for method in tool_methods(cls)))


def tools_json(interface: EnvInterface) -> str:
    """The tools as an OpenAI `tools` JSON list: stable bytes for the same source."""
    return json.dumps(list(interface.tools), indent=2, ensure_ascii=False)


def tool_schema(method: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """The function schema of one (contract-clean) method, as `transformers.utils.get_json_schema` gives it."""
    docstring = (ast.get_docstring(method) or "").strip()
    descriptions = parse_docstring(docstring)[1]
    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in tool_parameters(method):
        try:
            schema = annotation_schema(arg.annotation) if arg.annotation is not None else {}
        except ValueError:  # only imported code gets here (the strict lint refuses such hints first)
            schema = {}
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
