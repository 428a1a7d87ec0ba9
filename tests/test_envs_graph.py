"""The tool dependency graph of the fixture environments: state access from the code, data edges by execution."""

import json
from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.graph import argument_sets, extract_graph, state_access, state_values
from builder.envs.lint import ContractError
from builder.sandbox.runtime import Sandbox

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
BANK = (FIXTURES / "bank.py").read_text()
LIBRARY = (FIXTURES / "library.py").read_text()
FAST = SandboxConfig(call_timeout_s=1.0, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def bank_graph(sandbox):
    return extract_graph(sandbox, BANK)


def data_edges(graph):
    return {(e.source, e.output, e.target, e.input) for e in graph.edges if e.kind == "data"}


def test_state_access_reads_and_writes_per_tool_including_aliases_and_helpers():
    code = (
        "class E:\n"
        '    """S."""\n'
        "    def __init__(self):\n        self.items = {}\n        self.log = []\n        self.limit = 3\n"
        "    def _note(self, text):\n        self.log.append(text)\n"
        "    def put(self, key: str) -> dict:\n"
        '        """Put.\n\n        Args:\n            key: k.\n        """\n'
        "        item = self.items.setdefault(key, {})\n        item['n'] = self.limit\n        self._note(key)\n"
        "        return {}\n"
        "    def show(self, key: str) -> dict:\n"
        '        """Show.\n\n        Args:\n            key: k.\n        """\n'
        "        found = self.items.get(key)\n        copy = dict(found or {})\n        copy['seen'] = True\n"
        "        return copy\n"
    )
    access = state_access(code)
    assert access["put"] == (("items", "limit", "log"), ("items", "log"))
    assert access["show"] == (("items",), ())  # writing into a fresh copy is not a write


def test_bank_graph_finds_id_edges_and_state_edges(bank_graph):
    edges = data_edges(bank_graph)
    assert ("list_accounts", "[]", "get_account", "account_id") in edges
    assert ("get_account", "account.account_id", "freeze_account", "account_id") in edges
    assert ("list_accounts", "[]", "transfer", "source") in edges
    assert ("get_account", "account.account_id", "transfer", "target") in edges
    # Not found: a balance is a valid amount by chance, free text links nothing, no tool feeds itself.
    assert not any(e[3] in ("amount", "memo") for e in edges)
    assert not any(e[0] == e[2] for e in edges)
    state = {(e.source, e.target, e.output) for e in bank_graph.edges if e.kind == "state"}
    assert ("transfer", "get_account", "accounts") in state and ("freeze_account", "transfer", "accounts") in state
    assert not any(source in ("get_account", "list_accounts") for source, _, _ in state)  # readers write nothing
    assert bank_graph.writers() == ["transfer", "freeze_account"] and not bank_graph.truncated


def test_library_graph_edge_found_from_a_search_and_not_where_the_state_refuses(sandbox):
    graph = extract_graph(sandbox, LIBRARY)
    edges = data_edges(graph)
    assert ("search_books", "[].book_id", "borrow", "book_id") in edges
    # return_book refuses every book while nothing is lent, so the search's ids cannot be shown to feed it.
    assert not any(e[2] == "return_book" for e in edges)
    assert not any(e[3] == "days" for e in edges)  # `copies` is a number that happens to be a valid loan length
    assert graph.node("borrow").writes == ("books", "loans")


def test_a_tool_without_producers_has_no_data_edges_and_the_dot_output_names_every_tool(sandbox):
    graph = extract_graph(sandbox, (FIXTURES / "counter.py").read_text())
    dot = graph.to_dot()
    assert dot.startswith("digraph tools {") and dot.endswith("}")
    assert all(f'"{node.name}"' in dot for node in graph.nodes)


def test_the_probe_budget_marks_the_graph_truncated(sandbox):
    graph = extract_graph(sandbox, BANK, max_probes=3)
    assert graph.truncated and len(data_edges(graph)) < 4


def test_a_contract_violation_is_refused(sandbox):
    with pytest.raises(ContractError):
        extract_graph(sandbox, "x = 1\n")


def test_state_values_prefer_the_named_collection_and_never_invent():
    state = {"accounts": {"acc-1": {"owner": "c1"}}, "customers": {"c1": {"name": "Ada"}}, "log": [{"id": "t1"}]}
    assert state_values("account_id", {"type": "string"}, state) == ["acc-1"]
    assert state_values("source", {"type": "string", "description": "Account to debit."}, state) == ["acc-1"]
    assert state_values("owner", {"type": "string"}, state) == ["c1"]
    assert state_values("kind", {"enum": ["a", "b"]}, state) == ["a", "b"]
    assert set(state_values("memo", {"type": "string"}, state)) == {"acc-1", "c1", "t1", "Ada"}
    assert state_values("amount", {"type": "integer"}, state) == []
    sets = argument_sets({"properties": {"account_id": {"type": "string"}}, "required": ["account_id"]}, state)
    assert sets == [{"account_id": "acc-1"}]


def test_env_graph_command_prints_text_json_and_dot(tmp_path, capsys):
    from builder.cli import main

    state = tmp_path / "state.json"
    state.write_text(json.dumps({"books": {"b9": {"title": "Ulysses", "author": "Joyce", "copies": 1}},
                                 "members": {"m1": {"name": "Sam", "max_loans": 2, "fines_cents": 0}},
                                 "loans": [], "today": "2024-05-01"}))  # fmt: skip
    assert main(["env", "graph", str(FIXTURES / "library.py"), "--state", str(state), "--profile", "none"]) == 0
    text = capsys.readouterr().out
    assert "borrow: reads books, loans, members, today; writes books, loans" in text
    assert "data: search_books.[].book_id -> borrow(book_id) e.g. 'b9'" in text
    assert main(["env", "graph", str(FIXTURES / "bank.py"), "--json", "--profile", "none"]) == 0
    graph = json.loads(capsys.readouterr().out)
    assert {"kind", "source", "target", "output", "input", "example"} == set(graph["edges"][0])
    assert main(["env", "graph", str(FIXTURES / "bank.py"), "--dot", "--profile", "none"]) == 0
    assert capsys.readouterr().out.startswith("digraph tools {")


def test_env_graph_command_fails_on_a_broken_environment(tmp_path, capsys):
    from builder.cli import main

    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\n")
    assert main(["env", "graph", str(broken), "--profile", "none"]) == 1
    assert "violates the contract" in capsys.readouterr().err
    assert main(["env", "graph", str(tmp_path / "missing.py"), "--profile", "none"]) == 1
    with pytest.raises(SystemExit) as usage:
        main(["env", "graph", str(FIXTURES / "bank.py"), "--json", "--dot"])
    assert usage.value.code == 2
