"""Tool schemas: typed fixtures against golden outputs, stability, JSON Schema validity, argument checks."""

import json
import os
from pathlib import Path

import pytest

from builder.envs.schema import inspect_source, tools_json
from builder.envs.validate import argument_error

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
GOLDEN = FIXTURES / "golden"


@pytest.mark.parametrize("name", ["typed", "bank", "library"])
def test_schema_matches_golden(name):
    produced = tools_json(inspect_source((FIXTURES / f"{name}.py").read_text())) + "\n"
    golden = GOLDEN / f"{name}.tools.json"
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(produced)
    assert produced == golden.read_text()


def test_same_code_same_bytes():
    source = (FIXTURES / "typed.py").read_text()
    assert tools_json(inspect_source(source)) == tools_json(inspect_source(source))


@pytest.mark.parametrize("name", ["typed", "bank", "library"])
def test_parameters_are_valid_json_schema(name):
    for tool in inspect_source((FIXTURES / f"{name}.py").read_text()).tools:
        parameters = tool["function"]["parameters"]
        assert parameters["type"] == "object" and set(parameters["required"]) <= set(parameters["properties"])
        try:
            import jsonschema
        except ImportError:  # the structural checks above still ran
            continue
        jsonschema.Draft202012Validator.check_schema(parameters)


def test_types_defaults_and_descriptions():
    tool = inspect_source((FIXTURES / "typed.py").read_text()).tools[0]["function"]
    props = tool["parameters"]["properties"]
    assert tool["description"] == "Record every argument. A second paragraph of description."
    assert props["count"] == {"type": "integer", "description": "How many; continued on a second line."}
    assert props["maybe"]["type"] == ["string", "null"]
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "Speed.", "default": "fast"}
    assert props["matrix"]["items"] == {"type": "array", "items": {"type": "integer"}}
    assert props["scores"]["additionalProperties"] == {"type": "number"}
    assert tool["parameters"]["required"] == ["name", "count", "ratio", "flag", "tags", "scores", "matrix",
                                              "maybe", "either"]  # fmt: skip
    assert [t["function"]["name"] for t in inspect_source((FIXTURES / "typed.py").read_text()).tools] == [
        "everything", "no_arguments"]  # fmt: skip


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({}, "missing required argument(s): account_id"),
        ({"account_id": 3}, "account_id: expected string, got integer"),
        ({"account_id": "a", "x": 1}, "unexpected argument(s): x"),
        ([1], "arguments must be a JSON object"),
    ],
)
def test_argument_errors_read_like_an_api(arguments, message):
    tools = inspect_source((FIXTURES / "bank.py").read_text()).tools
    error = argument_error(tools[0]["function"]["parameters"], arguments)
    assert error is not None and error.startswith(message)


def test_valid_arguments_pass_and_bool_is_not_an_integer():
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in
             inspect_source((FIXTURES / "bank.py").read_text()).tools}  # fmt: skip
    assert argument_error(tools["transfer"], {"source": "a", "target": "b", "amount": 5}) is None
    assert argument_error(tools["list_accounts"], {"owner": "c1", "kind": None}) is None
    assert "expected integer" in argument_error(tools["transfer"], {"source": "a", "target": "b", "amount": True})
    assert argument_error(tools["list_accounts"], {"owner": "c1", "kind": "gold"}) is not None
    assert json.dumps(tools["transfer"])  # plain JSON
