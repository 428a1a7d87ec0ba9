"""The import contract: lint problems as counted information, schemas from BFCL-style classes (names, parameters,
required sets, types and descriptions from Google, NumPy and reST docstrings), BFCL's `_load_scenario`, and the
env commands and evaluate gates under `contract="import"` against a real sandbox."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.commands import env_check, env_graph, env_replay, env_schema
from builder.envs.docstrings import docstring_type_schema, parse_docstring
from builder.envs.lint import ContractError, lint, problem_counts, refused
from builder.envs.probe import probe_environment
from builder.envs.schema import inspect_source
from builder.envs.session import Session
from builder.records import Environment
from builder.sandbox.runtime import Sandbox
from builder.stages.evaluate.gates import run_gates

BFCL = Path(__file__).parent / "fixtures" / "bfcl"
FILE_SYSTEM = (BFCL / "file_system.py").read_text()
TWITTER = (BFCL / "twitter_api.py").read_text()
TRADING = (BFCL / "trading_bot.py").read_text()
TICKETS = (BFCL / "ticket_api.py").read_text()
FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=0.5, memory_mb=512)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def tools_of(source: str) -> dict[str, dict]:
    return {t["function"]["name"]: t["function"] for t in inspect_source(source, "import").tools}


# ------------------------------------------------------------------------------------------- two trust levels


@pytest.mark.parametrize("source", [FILE_SYSTEM, TWITTER, TRADING, TICKETS])
def test_strict_refuses_bfcl_style_classes_and_import_reads_them(source):
    with pytest.raises(ContractError):
        inspect_source(source)
    interface = inspect_source(source, "import")
    assert interface.contract == "import" and interface.tools
    assert interface.warnings == problem_counts(lint(source)) and sum(interface.warnings.values()) == len(lint(source))


def test_import_warnings_are_counted_by_code():
    assert inspect_source(FILE_SYSTEM, "import").warnings == {"forbidden_name": 2, "missing_type_hint": 4}
    assert inspect_source(TRADING, "import").warnings == {"missing_type_hint": 6}


@pytest.mark.parametrize(
    ("source", "code"),
    [
        ("class A(\n", "syntax"),
        ("X = 1\n", "no_env_class"),
        ("class A:\n    def _f(self):\n        pass\n", "no_env_class"),
    ],
)
def test_import_still_refuses_a_module_with_no_class_to_load(source, code):
    with pytest.raises(ContractError) as raised:
        inspect_source(source, "import")
    assert [p.code for p in raised.value.problems] == [code]


def test_import_takes_the_last_class_with_public_methods_and_lints_it():
    source = (
        "class File:\n    def __init__(self):\n        self.name = ''\n    def size(self) -> int:\n        return 0\n"
        "class Api:\n    def get(self, key):\n        return key\n"
        "class Empty:\n    pass\n"
    )
    interface = inspect_source(source, "import")
    assert interface.class_name == "Api" and interface.tool_names == ("get",)
    assert interface.warnings == {"missing_docstring": 1, "missing_type_hint": 2, "multiple_env_classes": 2}
    with pytest.raises(ContractError):
        inspect_source(source)


def test_refused_knows_both_contracts_and_no_third():
    problems = lint("import os\nclass A:\n    def f(self, x):\n        return getattr(self, x)\n")
    assert refused(problems, "strict") == problems
    assert refused(problems, "import") == []
    with pytest.raises(ValueError, match="unknown contract 'lax'"):
        refused(problems, "lax")  # type: ignore[arg-type]


def test_strict_interface_carries_no_warnings():
    source = (Path(__file__).parent / "fixtures" / "envs" / "counter.py").read_text()
    interface = inspect_source(source)
    assert interface.contract == "strict" and interface.problems == () and interface.warnings == {}


def test_import_leaves_out_async_and_reserved_methods_and_unconstrains_unknown_types():
    source = (
        "from decimal import Decimal\nclass A:\n"
        "    async def fetch(self) -> int:\n        return 1\n"
        "    def reset(self) -> None:\n        pass\n"
        "    def pay(self, amount: Decimal, memo, *rest, **extra):\n        return 1\n"
    )
    interface = inspect_source(source, "import")
    assert interface.tool_names == ("pay",)
    assert interface.tools[0]["function"]["parameters"] == {
        "type": "object", "properties": {"amount": {}, "memo": {}}, "required": ["amount", "memo"],
    }  # fmt: skip
    assert {"async_tool", "reserved_tool_name", "unsupported_type", "variadic_parameters", "missing_type_hint",
            "missing_docstring"} <= set(interface.warnings)  # fmt: skip


# ------------------------------------------------------------------------------------------ BFCL-style schemas


def test_file_system_schema_google_with_types_and_optional_markers():
    tools = tools_of(FILE_SYSTEM)
    assert list(tools) == ["pwd", "ls", "cd", "touch", "cat", "run", "state_size"]
    assert tools["ls"]["description"] == "List the contents of the current directory."
    assert tools["ls"]["parameters"] == {
        "type": "object",
        "properties": {
            "a": {"type": "boolean", "description": "Show hidden files and directories. Defaults to False."}
        },
    }
    touch = tools["touch"]["parameters"]
    assert touch["required"] == ["file_name"]
    assert touch["properties"]["file_name"]["description"] == (
        "The name of the new file in the current directory. file_name is local to the current directory and does "
        "not allow path."
    )
    assert touch["properties"]["content"] == {
        "type": "string", "nullable": True, "description": "The text the file starts with. Defaults to an empty file.",
    }  # fmt: skip
    run = tools["run"]["parameters"]  # no hints at all: the types come from `name (type):`
    assert run["properties"]["command"]["type"] == "string" and run["required"] == ["command"]
    assert "return" not in tools["pwd"] and tools["cd"]["return"]["type"] == "object"


def test_twitter_schema_types_from_docstrings_where_hints_are_missing():
    tools = tools_of(TWITTER)
    post = tools["post_tweet"]["parameters"]
    assert post["required"] == ["content"]
    assert post["properties"]["tags"]["type"] == "array" and post["properties"]["tags"]["items"] == {"type": "string"}
    assert post["properties"]["tags"]["description"].startswith("List of tags for the tweet. Tag name should start")
    assert tools["authenticate_twitter"]["parameters"]["required"] == ["username", "password"]
    notify = tools["follow_user"]["parameters"]["properties"]["notify"]
    assert notify == {"type": "boolean", "description": "Tell the followed user. Defaults to True."}
    assert tools["get_tweet"]["parameters"]["properties"]["tweet_id"]["type"] == "integer"


def test_trading_bot_schema_from_numpy_docstrings():
    tools = tools_of(TRADING)
    order = tools["place_order"]["parameters"]
    assert order["required"] == ["order_type", "symbol", "price", "amount"]
    kinds = {name: schema.get("type") for name, schema in order["properties"].items()}
    assert kinds == {"order_type": "string", "symbol": "string", "price": "number", "amount": "integer",
                     "note": "string"}  # fmt: skip
    assert order["properties"]["price"]["description"] == "Price at which to place the order."
    assert tools["get_stock_info"]["description"] == "Get the details of a stock."
    assert tools["get_stock_info"]["return"]["description"] == "The price, percent change and volume of the stock."
    assert tools["add_to_watchlist"]["parameters"]["properties"]["stocks"]["items"] == {"type": "string"}
    assert "required" not in tools["get_order_history"]["parameters"]


def test_ticket_schema_from_rest_docstrings():
    tools = tools_of(TICKETS)
    create = tools["create_ticket"]
    assert create["description"] == "Create a ticket in the system and queue it."
    assert create["parameters"]["required"] == ["title"]
    assert create["parameters"]["properties"]["priority"] == {
        "type": "integer", "description": "Priority of the ticket, from 1 to 5. Defaults to 1.",
    }  # fmt: skip
    assert create["return"]["description"] == "The id, title, description, status and priority of the new ticket."
    assert tools["get_ticket"]["parameters"]["properties"]["ticket_id"]["type"] == "integer"  # `:type ticket_id:`
    resolution = tools["close_ticket"]["parameters"]["properties"]["resolution"]  # `:param str resolution:`
    assert resolution == {"type": "string", "description": "How the ticket was resolved."}


# ------------------------------------------------------------------------------------------ docstring parser


def test_google_parameters_with_types_optional_marks_and_continuations():
    doc = parse_docstring(
        "Do it.\n\nArgs:\n    a (int): [Optional] First.\n        More of it.\n    b (str, optional): Second.\n"
        "    c: Third.\n\nReturns:\n    The thing.\n"
    )
    assert doc.description == "Do it." and doc.returns == "The thing."
    assert doc.parameters["a"] == ("First. More of it.", "int", True)
    assert doc.parameters["b"] == ("Second.", "str, optional", True)
    assert doc.parameters["c"] == ("Third.", None, False)


def test_numpy_parameters_and_grouped_names():
    doc = parse_docstring("Sum.\n\nParameters\n----------\nx, y : float\n    The numbers.\nz : int, optional\n")
    assert doc.description == "Sum."
    assert doc.parameters["x"] == doc.parameters["y"] == ("The numbers.", "float", False)
    assert doc.parameters["z"] == ("", "int, optional", True)


def test_rest_fields():
    doc = parse_docstring("Get.\n\n:param key: The key.\n    Continued.\n:type key: str\n:return: The value.\n")
    assert doc.description == "Get." and doc.returns == "The value."
    assert doc.parameters["key"] == ("The key. Continued.", "str", False)


def test_plain_docstring_has_no_parameters():
    assert parse_docstring("Just text.\nOver two lines.") == ("Just text.\nOver two lines.", {}, None)
    assert parse_docstring("") == ("", {}, None)


@pytest.mark.parametrize(
    ("text", "schema"),
    [
        ("str", {"type": "string"}),
        ("integer", {"type": "integer"}),
        ("bool, optional", {"type": "boolean"}),
        ("List[str]", {"type": "array", "items": {"type": "string"}}),
        ("list of int", {"type": "array", "items": {"type": "integer"}}),
        ("str or None", {"type": "string", "nullable": True}),
        ("Dict[str, float]", {"type": "object", "additionalProperties": {"type": "number"}}),
        ("a frobnicator", None),
        ("Decimal", None),
        ("{'a', 'b'}", None),
        ("", None),
        (None, None),
    ],
)
def test_docstring_types(text, schema):
    assert docstring_type_schema(text) == schema


# ------------------------------------------------------------------------------------------ in the sandbox


def test_load_scenario_fills_defaults_and_the_state_still_wins(sandbox):
    with Session(sandbox, TWITTER, contract="import") as session:
        default = session.snapshot()
        assert default["username"] == "john" and default["following_list"] == ["alice", "bob"]
        assert session.call("authenticate_twitter", {"username": "john", "password": "john123"}).result == {
            "authentication_status": True
        }
    state = {"username": "ann", "password": "pw", "tweets": {}, "extra": [1]}
    with Session(sandbox, TWITTER, state, contract="import") as session:
        loaded = session.snapshot()
    assert loaded["username"] == "ann" and loaded["extra"] == [1] and loaded["tweet_counter"] == 0
    with Session(sandbox, TWITTER, loaded, contract="import") as session:
        assert session.snapshot() == loaded  # a snapshot loads back to itself


def test_strict_session_refuses_and_does_not_call_load_scenario(sandbox):
    with pytest.raises(ContractError):
        Session(sandbox, TWITTER)
    source = (
        "class A:\n    def __init__(self):\n        self.n = 0\n"
        "    def _load_scenario(self, scenario: dict) -> None:\n        self.n = 99\n"
        '    def get(self) -> int:\n        """Get."""\n        return self.n\n'
    )
    with Session(sandbox, source) as session:
        assert session.snapshot() == {"n": 0}
    with Session(sandbox, source, contract="import") as session:
        assert session.snapshot() == {"n": 99}


@pytest.mark.parametrize("source", [FILE_SYSTEM, TWITTER, TRADING, TICKETS])
def test_bfcl_style_classes_pass_the_probe_under_import(sandbox, source):
    probe = probe_environment(sandbox, source, contract="import")
    assert probe.problems == () and len(probe.results) == len(inspect_source(source, "import").tools)
    assert list(probe_environment(sandbox, source).problems) == list(lint(source))  # strict: the lint refuses


def test_the_probe_reports_a_private_attribute_left_out_as_a_warning_not_a_problem(sandbox):
    source = "class Dice:\n    def __init__(self):\n        import random\n        self._random = random.Random(1)\n"
    source += '\n    def roll(self) -> dict:\n        """Roll."""\n        return {"n": self._random.randint(1, 6)}\n'
    probe = probe_environment(sandbox, source, contract="import")
    assert probe.problems == () and probe.results[0].ok
    assert [(w.code, w.attribute) for w in probe.warnings] == [("private_state_omitted", "_random")]


def test_getattr_and_vars_work_in_the_sandbox(sandbox):
    with Session(sandbox, FILE_SYSTEM, contract="import") as session:
        cat = session.call("run", {"command": "cat", "argument": "notes.txt"})
        assert cat.result == {"file_content": "hello world"}
        assert session.call("run", {"command": "_here"}).result == {"error": "_here: command not found"}
        assert session.call("state_size", {}).result == {"attributes": 4}


def test_gates_pass_an_imported_environment_and_refuse_it_strict(sandbox):
    interface = inspect_source(TRADING, "import")
    env = Environment(
        provenance={"config_hash": "h", "parent_ids": ["src"]}, plan_id="src", name="trading_bot",
        class_name=interface.class_name, description="d", domain="finance", code=TRADING, tools=list(interface.tools),
        state_schema={},
    )  # fmt: skip
    problems, found, default_state = run_gates(sandbox, env, "import")
    assert problems == [] and found is not None and found.contract == "import"
    assert default_state["order_counter"] == 12446 and "AAPL" in default_state["stocks"]
    problems, found, _ = run_gates(sandbox, env)
    assert found is None and {p.code for p in problems} == {"missing_type_hint"}


# ------------------------------------------------------------------------------------------ the env commands


def test_env_schema_command(tmp_path, capsys):
    path = tmp_path / "twitter.py"
    path.write_text(TWITTER)
    assert env_schema(path) == 1
    assert "missing_type_hint" in capsys.readouterr().err
    out = io.StringIO()
    assert env_schema(path, out, contract="import") == 0
    assert [t["function"]["name"] for t in json.loads(out.getvalue())][0] == "authenticate_twitter"
    err = capsys.readouterr().err
    assert "9 warning(s) under the import contract: forbidden_name 1, missing_type_hint 8" in err


def test_env_check_command_reports_warnings(tmp_path):
    path = tmp_path / "trading.py"
    path.write_text(TRADING)
    out = io.StringIO()
    assert env_check(path, as_json=True, config=FAST, out=out, contract="import") == 0
    report = json.loads(out.getvalue())
    assert report["ok"] and report["contract"] == "import" and report["warning_counts"] == {"missing_type_hint": 6}
    assert len(report["warnings"]) == 6 and report["problems"] == []
    text = io.StringIO()
    assert env_check(path, config=FAST, out=text, contract="import") == 0
    assert text.getvalue().rstrip().endswith("ok, 6 warning(s)")
    strict = io.StringIO()
    assert env_check(path, as_json=True, config=FAST, out=strict) == 1
    assert json.loads(strict.getvalue())["warnings"] == []


def test_env_replay_and_graph_commands(tmp_path):
    env, state, calls = tmp_path / "tickets.py", tmp_path / "state.json", tmp_path / "calls.json"
    env.write_text(TICKETS)
    state.write_text(json.dumps({"ticket_queue": [], "ticket_counter": 5}))
    calls.write_text(json.dumps([{"name": "create_ticket", "arguments": {"title": "t"}},
                                 {"name": "close_ticket", "arguments": {"ticket_id": 5}}]))  # fmt: skip
    assert env_replay(env, state, calls, config=FAST, out=io.StringIO()) == 1
    out = io.StringIO()
    assert env_replay(env, state, calls, as_json=True, config=FAST, out=out, contract="import") == 0
    report = json.loads(out.getvalue())
    assert report["final_state"]["ticket_queue"][0]["status"] == "Closed"
    assert env_graph(env, form="json", config=FAST, out=io.StringIO()) == 1
    graph = io.StringIO()
    assert env_graph(env, form="json", config=FAST, out=graph, contract="import") == 0
    assert {node["name"] for node in json.loads(graph.getvalue())["nodes"]} == {"create_ticket", "get_ticket",
                                                                                 "close_ticket"}  # fmt: skip


def test_cli_contract_option(tmp_path, capsys):
    from builder.cli import main

    path = tmp_path / "tickets.py"
    path.write_text(TICKETS)
    assert main(["env", "schema", str(path)]) == 1
    assert main(["env", "schema", "--contract", "import", str(path)]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
    with pytest.raises(SystemExit):
        main(["env", "schema", "--contract", "lax", str(path)])


def test_a_published_imported_environment_runs_in_the_trainer_api(sandbox):
    # A release row of an imported environment names its origin; the trainer API inspects its code under the
    # import contract (a row without one is strict, and this class breaks the strict lint).
    from builder.envs.trainer import LiveEnvironment, environment_contract

    origin = {"source": "classes", "location": "trading_bot.py", "revision": "sha256:0", "ref": "TradingBot"}
    row = {"code": TRADING, "provenance": json.dumps({"config_hash": "h", "origin": origin})}
    scenario = {"initial_state": {"watch_list": ["AAPL"]}, "task": "Buy 3 NVDA at 220.", "checks": []}
    assert environment_contract(row) == "import" and environment_contract({"code": TRADING}) == "strict"
    live = LiveEnvironment(row, scenario, sandbox)
    try:
        live.reset()
        placed = live.call("place_order", {"order_type": "Buy", "symbol": "NVDA", "price": 220.0, "amount": 3})
        assert '"status": "Pending"' in placed, placed
    finally:
        live.close()
    with pytest.raises(ContractError):
        LiveEnvironment({"code": TRADING}, scenario, sandbox)


def test_evaluates_prompts_show_the_environment_class_of_a_module_with_helper_classes_first():
    # EnvScaler's TypedDicts and BFCL's File/Directory come before the API class; the dual-agent check's prompts
    # (the class header, a method's source) must show the environment's class, the last one with public methods.
    from builder.views.code import class_header, method_source

    code = (
        "class File:\n    def __init__(self, name: str) -> None:\n        self.name = name\n\n"
        "    def read(self) -> str:\n        return self.name\n\n\n"
        "class Drive:\n    def __init__(self) -> None:\n        self.files: dict = {}\n\n"
        "    def list_files(self) -> dict:\n        return {'files': sorted(self.files)}\n"
    )
    assert class_header(code).startswith("class Drive:")
    assert "sorted(self.files)" in method_source(code, "list_files")
