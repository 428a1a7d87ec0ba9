"""OpenAI tool schemas derived from an environment's source: signatures, type hints and Google docstrings.

Everything is read from the AST, so deriving schemas never runs generated code. The output is stable: the
same source gives the same schema bytes (`tools_json`). Supported parameter types: str, int, float, bool,
Any, None, list[X], dict[str, X], tuple[X, ...], Optional[X], X | Y, Union[...], Literal[...]; a default
makes a parameter optional.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.lint import ContractError, lint
from builder.envs.signatures import annotation_schema, parse_docstring, tool_methods, tool_parameters
from builder.pyast import parse


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


def tool_schema(method: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, Any]:
    """The OpenAI function schema of one (contract-clean) method."""
    summary, descriptions = parse_docstring(ast.get_docstring(method) or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for arg, default in tool_parameters(method):
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
