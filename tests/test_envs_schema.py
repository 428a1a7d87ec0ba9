"""Tool schemas: typed fixtures against golden outputs, stability, JSON Schema validity, argument checks, and the
same schemas as `transformers.utils.get_json_schema` (what TRL derives) from the real methods and from the TRL
adapter's methods."""

import json
import os
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source, tools_json
from builder.envs.signatures import tool_defaults
from builder.envs.trainer import trl_environment_factory
from builder.envs.validate import argument_error, standard_schema

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
        assert parameters["type"] == "object" and set(parameters.get("required", [])) <= set(parameters["properties"])
        try:
            import jsonschema
        except ImportError:  # the structural checks above still ran
            continue
        jsonschema.Draft202012Validator.check_schema(standard_schema(parameters, tool_parameters=True))


def test_types_defaults_and_descriptions():
    tool = inspect_source((FIXTURES / "typed.py").read_text()).tools[0]["function"]
    props = tool["parameters"]["properties"]
    assert tool["description"] == "Record every argument.\n\nA second paragraph of description."
    assert props["count"] == {"type": "integer", "description": "How many; continued on a second line."}
    assert props["maybe"] == {"type": "string", "nullable": True, "description": "Optional text."}
    assert props["either"]["type"] == ["integer", "string"]
    assert props["mode"] == {"type": "string", "enum": ["fast", "slow"], "description": "Speed."}  # no default
    assert props["pair"] == {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                             "description": "A fixed pair."}  # fmt: skip
    assert "additionalProperties" not in tool["parameters"]
    assert tool["return"] == {"type": "object", "description": "The arguments."}
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


def _clean_fixtures() -> list[str]:
    """Every fixture environment that keeps the contract (some break it on purpose)."""
    names = []
    for path in sorted(FIXTURES.glob("*.py")):
        try:
            inspect_source(path.read_text())
        except ContractError:
            continue
        names.append(path.stem)
    return names


def _real_class(source: str, class_name: str) -> type:
    namespace: dict = {}
    exec(compile(source, "<fixture>", "exec"), namespace)  # trusted test fixtures only
    return namespace[class_name]


# `ratio (float):` is Google style builder reads but transformers does not; everything else is the same text.
TRANSFORMERS_STYLE = {"typed": ("ratio (float):", "ratio:")}


@pytest.mark.parametrize("name", _clean_fixtures())
def test_schemas_are_the_ones_transformers_derives_from_the_methods(name):
    source = (FIXTURES / f"{name}.py").read_text()
    if name in TRANSFORMERS_STYLE:
        source = source.replace(*TRANSFORMERS_STYLE[name])
    interface = inspect_source(source)
    real = _real_class(source, interface.class_name)
    adapter = trl_environment_factory({"code": source}, [])
    assert interface.tools
    for tool in interface.tools:
        method = tool["function"]["name"]
        # Byte-equal, key order included: chat templates render the schemas with `tojson`.
        assert json.dumps(get_json_schema(getattr(real, method))) == json.dumps(tool)
        assert json.dumps(get_json_schema(getattr(adapter, method))) == json.dumps(tool)


def test_choices_in_a_description_become_an_enum_as_in_transformers():
    source = (FIXTURES / "counter.py").read_text()
    source = source.replace("by: How much to add.", "by: How much to add (choices: [1, 2])")
    ours = inspect_source(source).tools[0]
    theirs = get_json_schema(_real_class(source, "CounterEnv").increment)
    assert json.dumps(ours) == json.dumps(theirs)
    assert ours["function"]["parameters"]["properties"]["by"] == {"type": "integer", "enum": [1, 2],
                                                                  "description": "How much to add"}  # fmt: skip


def test_defaults_are_listed_apart_from_the_schemas():
    source = (FIXTURES / "typed.py").read_text()
    assert tool_defaults(source) == {"everything": {"mode": "fast", "nested": None, "pair": (1, "a"), "anything": None,
                                                    "union": None, "legacy": None, "note": ""}}  # fmt: skip


def test_a_one_value_tuple_is_refused_with_advice():
    source = (FIXTURES / "counter.py").read_text().replace("by: int = 1", "by: tuple[int] = (1,)")
    with pytest.raises(ContractError, match="holds one value"):
        inspect_source(source)


def test_nullable_and_closed_parameters_in_validation():
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in
             inspect_source((FIXTURES / "typed.py").read_text()).tools}  # fmt: skip
    everything = tools["everything"]
    base = {"name": "n", "count": 1, "ratio": 0.5, "flag": True, "tags": [], "scores": {}, "matrix": [],
            "maybe": None, "either": 3}  # fmt: skip
    assert argument_error(everything, base) is None  # `maybe` is nullable
    assert argument_error(everything, {**base, "count": None}).startswith("count: expected integer")
    assert argument_error(everything, {**base, "bogus": 1}).startswith("unexpected argument(s): bogus")
    standard = standard_schema(everything, tool_parameters=True)
    assert standard["additionalProperties"] is False
    assert standard["properties"]["maybe"]["type"] == ["string", "null"]
    assert standard["properties"]["legacy"]["type"] == ["array", "null"]


def test_old_stored_schemas_still_validate():
    old = {"type": "object", "additionalProperties": False, "required": ["a"], "properties": {
        "a": {"type": "string"}, "kind": {"anyOf": [{"type": "string", "enum": ["x"]}, {"type": "null"}],
                                          "default": None}}}  # fmt: skip
    assert argument_error(old, {"a": "1", "kind": None}) is None
    assert argument_error(old, {"a": "1", "kind": "y"}) is not None
    assert argument_error(old, {"a": "1", "z": 1}).startswith("unexpected argument(s): z")
