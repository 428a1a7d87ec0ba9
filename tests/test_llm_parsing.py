"""Pure parsing helpers: reasoning split, strict schemas, structured parsing, tool-call checks."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from builder.llm.parsing import (
    check_tool_call,
    check_tool_calls,
    function_tool,
    parse_structured,
    response_format,
    split_reasoning,
    with_strict,
)
from builder.records import FunctionCall, ToolCall


class Inner(BaseModel):
    label: str


class Person(BaseModel):
    name: str
    age: int
    tags: list[Inner] = []


WEATHER = function_tool(
    "get_weather",
    "Weather for a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
)


def call(name: str, arguments: str, call_id: str = "c1") -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


@pytest.mark.parametrize(
    ("text", "field", "content", "reasoning"),
    [
        ("plain answer", None, "plain answer", None),
        ("<think>hmm</think>\n\nanswer", None, "answer", "hmm"),
        ("hidden start</think>answer", None, "answer", "hidden start"),
        ("a <think>one</think> b <think>two</think>", None, "a  b", "one\ntwo"),
        ("answer<think>cut off", None, "answer", "cut off"),
        ("<think>only thinking</think>", None, None, "only thinking"),
        ("answer", "server reasoning", "answer", "server reasoning"),
        (None, "server reasoning", None, "server reasoning"),
        (None, None, None, None),
    ],
)
def test_split_reasoning(text: str | None, field: str | None, content: str | None, reasoning: str | None) -> None:
    assert split_reasoning(text, field) == (content, reasoning)


def test_response_format_is_strict_json_schema_with_closed_objects() -> None:
    fmt = response_format(Person)
    assert fmt["type"] == "json_schema"
    assert fmt["json_schema"]["strict"] is True
    assert fmt["json_schema"]["name"] == "Person"
    schema = fmt["json_schema"]["schema"]
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["Inner"]["additionalProperties"] is False
    assert "guided_json" not in str(fmt)


def test_parse_structured_accepts_valid_and_fenced_json() -> None:
    assert parse_structured('{"name": "a", "age": 3}', Person) == Person(name="a", age=3)
    assert parse_structured('```json\n{"name": "a", "age": 3}\n```', Person).age == 3


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("not json", "Invalid JSON"),
        ('{"name": "a"}', "age: Field required"),
        ('{"age": "x"}', "age"),
    ],
)
def test_parse_structured_errors_are_readable(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_structured(text, Person)


def test_function_tool_and_with_strict() -> None:
    assert WEATHER["function"]["strict"] is True
    loose = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    explicit = {"type": "function", "function": {"name": "g", "parameters": {}, "strict": False}}
    strict, kept = with_strict((loose, explicit))
    assert strict["function"]["strict"] is True
    assert kept["function"]["strict"] is False
    assert "strict" not in loose["function"]  # the caller's dict is not mutated


def test_check_tool_call_valid() -> None:
    parsed = check_tool_call(call("get_weather", '{"city": "Paris", "unit": "celsius"}'), [WEATHER])
    assert parsed.ok and parsed.arguments == {"city": "Paris", "unit": "celsius"}


@pytest.mark.parametrize(
    ("name", "arguments", "fragment"),
    [
        ("get_time", "{}", "unknown tool 'get_time'; available tools: get_weather"),
        ("get_weather", '{"city": "Paris"', "not valid JSON"),
        ("get_weather", "[1, 2]", "must be a JSON object"),
        ("get_weather", '{"unit": "celsius"}', "'city' is a required property"),
        ("get_weather", '{"city": "Paris", "unit": "kelvin"}', "at unit: 'kelvin' is not one of"),
        ("get_weather", '{"city": 3}', "at city: 3 is not of type 'string'"),
        ("get_weather", '{"city": "P", "extra": 1}', "Additional properties are not allowed"),
    ],
)
def test_check_tool_call_errors(name: str, arguments: str, fragment: str) -> None:
    parsed = check_tool_call(call(name, arguments), [WEATHER])
    assert not parsed.ok and parsed.arguments is None
    assert fragment in parsed.error


def test_check_tool_calls_keeps_order_of_parallel_calls() -> None:
    calls = (call("get_weather", '{"city": "A"}', "1"), call("get_weather", "{bad", "2"))
    first, second = check_tool_calls(calls, [WEATHER])
    assert (first.id, first.ok, second.id, second.ok) == ("1", True, "2", False)


def test_empty_arguments_mean_no_arguments() -> None:
    tool = function_tool("ping", "", {"type": "object", "properties": {}})
    assert check_tool_call(call("ping", ""), [tool]).arguments == {}
