"""The tool dependency graph of the fixture environments: state access from the code, data edges by execution."""

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
