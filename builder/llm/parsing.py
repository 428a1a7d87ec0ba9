"""Turning model text into checked values: reasoning split, JSON schemas for structured output, tool calls.

All functions here are pure, so stages and tests can use them without a model.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, TypeVar

import jsonschema
from pydantic import BaseModel, ValidationError

from builder.envs.validate import standard_schema
from builder.llm.sanitize import clean_json_text
from builder.records import ToolCall

T = TypeVar("T", bound=BaseModel)

_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_FENCED = re.compile(r"^\s*```(?:json)?\s*\n(.*?)\n\s*```\s*$", re.DOTALL)


def split_reasoning(text: str | None, reasoning_field: str | None = None) -> tuple[str | None, str | None]:
    """Separate reasoning from the answer.

    Handles `<think>…</think>` blocks anywhere, a lone `</think>` (templates such as Qwen3's open the block in
    the prompt), an unclosed `<think>` (the reply was cut off while thinking), and a server's separate
    reasoning field.

    Returns:
        (content, reasoning): content stripped of reasoning (None if nothing is left); reasoning (None if
        none).
    """
    parts = [reasoning_field] if reasoning_field else []
    if text is not None:
        head, closing, rest = text.partition("</think>")
        if closing and "<think>" not in head:
            parts.append(head)
            text = rest
        parts.extend(_THINK_BLOCK.findall(text))
        text = _THINK_BLOCK.sub("", text)
        text, opening, unclosed = text.partition("<think>")
        if opening:
            parts.append(unclosed)
        text = text.strip() or None
    reasoning = "\n".join(part.strip() for part in parts if part.strip()) or None
    return text, reasoning


def strict_json_schema(output_type: type[BaseModel]) -> dict[str, Any]:
    """The pydantic model's JSON schema with `additionalProperties: false` on every object.

    Structured-output engines (xgrammar in vLLM) then cannot add keys the model would reject anyway.
    """
    schema = copy.deepcopy(output_type.model_json_schema())
    _close_objects(schema)
    return schema


def _close_objects(node: Any) -> None:
    if isinstance(node, dict):
        if node.get("type") == "object" and "properties" in node:
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for item in node:
            _close_objects(item)


def response_format(output_type: type[BaseModel]) -> dict[str, Any]:
    """The OpenAI `response_format` asking for JSON that matches `output_type` (strict json_schema)."""
    name = re.sub(r"[^a-zA-Z0-9_-]", "_", output_type.__name__)[:64]
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "strict": True, "schema": strict_json_schema(output_type)},
    }


def parse_structured(text: str | None, output_type: type[T]) -> T:
    """Parse and validate a structured reply; a Markdown code fence around the JSON is tolerated. Strings that
    would decode to a lone surrogate or NUL are cleaned first (`sanitize.clean_json_text`): pydantic refuses
    the first as invalid JSON, and neither can be stored.

    Raises:
        ValueError: with a readable message that can be fed back to the model.
    """
    if not text or not text.strip():
        raise ValueError("the reply was empty; answer with a single JSON object")
    fenced = _FENCED.match(text)
    candidate = clean_json_text(fenced.group(1) if fenced else text)
    try:
        return output_type.model_validate_json(candidate)
    except ValidationError as error:
        raise ValueError(describe_validation_error(error)) from None


def describe_validation_error(error: ValidationError) -> str:
    """One line per problem, `path: message`, short enough to put back into a prompt."""
    lines = []
    for item in error.errors()[:10]:
        path = ".".join(str(part) for part in item["loc"]) or "(root)"
        lines.append(f"{path}: {item['msg']}")
    return "; ".join(lines)


def function_tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI function tool with `strict: true`, so servers constrain the arguments to `parameters`."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters, "strict": True},
    }


def with_strict(tools: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """The tools with `strict: true` added where the caller did not say otherwise.

    Without it vLLM forces the tool-call envelope but leaves the arguments unconstrained (docs/llm.md).
    """
    result = []
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, dict) and "strict" not in function:
            tool = {**tool, "function": {**function, "strict": True}}
        result.append(tool)
    return tuple(result)


def tool_names(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools if isinstance(tool.get("function"), dict)]


class ParsedToolCall(BaseModel):
    """A tool call checked against the tool schemas: either `arguments` or a readable `error` is set."""

    id: str
    name: str
    arguments: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def check_tool_call(call: ToolCall, tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> ParsedToolCall:
    """Decode a tool call's arguments and validate them against the named tool's parameter schema.

    Never raises: an unknown tool, arguments that are not a JSON object, or arguments that break the schema
    give a `ParsedToolCall` whose `error` says what is wrong, ready to send back as the tool's result.
    """
    name = call.function.name
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools if isinstance(tool.get("function"), dict)}
    if name not in by_name:
        known = ", ".join(sorted(by_name)) or "(none)"
        return ParsedToolCall(id=call.id, name=name, error=f"unknown tool {name!r}; available tools: {known}")
    raw = call.function.arguments
    try:
        arguments = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError as error:
        message = f"arguments of {name!r} are not valid JSON ({error.msg} at position {error.pos}): {raw[:200]!r}"
        return ParsedToolCall(id=call.id, name=name, error=message)
    if not isinstance(arguments, dict):
        return ParsedToolCall(id=call.id, name=name, error=f"arguments of {name!r} must be a JSON object")
    schema = standard_schema(by_name[name].get("parameters") or {"type": "object"}, tool_parameters=True)
    problem = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(arguments))
    if problem is not None:
        where = "/".join(str(part) for part in problem.absolute_path) or "(arguments)"
        message = f"arguments of {name!r} do not match its schema at {where}: {problem.message}"
        return ParsedToolCall(id=call.id, name=name, error=message)
    return ParsedToolCall(id=call.id, name=name, arguments=arguments)


def check_tool_calls(
    calls: tuple[ToolCall, ...], tools: tuple[dict[str, Any], ...] | list[dict[str, Any]]
) -> list[ParsedToolCall]:
    """`check_tool_call` for each call of a (possibly parallel) reply, in order."""
    return [check_tool_call(call, tools) for call in calls]
