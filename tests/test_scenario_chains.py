"""Chains sampled along the tool graph of the fixture environments, and the checks derived from their diffs."""

from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.checks import checks_from_scenario, run_checks
from builder.envs.graph import ToolGraph, ToolNode, extract_graph
from builder.json_values import leaves
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.chain import Chain, ChainCall
from builder.stages.scenarios.chain_values import values_at
from builder.stages.scenarios.chains import sample_chains
from builder.stages.scenarios.derived_checks import CheckItem, derive_checks, derive_items, verify_chain
from builder.stages.scenarios.verify import default_state, lint_check

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
BANK = (FIXTURES / "bank.py").read_text()
LIBRARY = (FIXTURES / "library.py").read_text()
FAST = SandboxConfig(call_timeout_s=1.0, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


@pytest.fixture(scope="module")
def bank(sandbox):
    state = default_state(sandbox, BANK)
    return state, extract_graph(sandbox, BANK, state)


def keys_and_leaves(value):
    found = set(map(repr, leaves(value)))
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found |= {repr(k) for k in item}
            stack += list(item.values())
        elif isinstance(item, list):
            stack += item
    return found


def test_sampling_is_reproducible_from_a_seed_and_differs_across_seeds(sandbox, bank):
    state, graph = bank
    first = sample_chains(sandbox, BANK, graph, state, 4, seed=7)
    again = sample_chains(sandbox, BANK, graph, state, 4, seed=7)
    other = sample_chains(sandbox, BANK, graph, state, 4, seed=8)
    assert len(first.chains) == 4 and first == again
    assert [c.actions for c in first.chains] != [c.actions for c in other.chains]


def test_chains_never_invent_a_string_and_each_changes_the_state_within_bounds(sandbox, bank):
    state, graph = bank
    sampled = sample_chains(sandbox, BANK, graph, state, 6, seed=3, min_calls=2, max_calls=5)
    assert sampled.chains
    for chain in sampled.chains:
        assert 2 <= len(chain.calls) <= 5 and chain.final_state != chain.initial_state
        assert any(call.changed for call in chain.calls)
        known = keys_and_leaves(state)
        for call in chain.calls:
            for value in call.arguments.values():
                assert not isinstance(value, str) or repr(value) in known  # from the state or a result
            known |= keys_and_leaves(call.result)
        assert all(source in ("state", "schema", "constant") or source.startswith("result ")
                   for call in chain.calls for source in call.sources.values())  # fmt: skip
    assert any(fed for fed in ([s for c in ch.calls for s in c.sources.values() if s.startswith("result")]
                               for ch in sampled.chains))  # fmt: skip
    assert len({call.name for chain in sampled.chains for call in chain.calls}) == 4  # every tool is used


def test_a_chain_with_a_failing_call_is_dropped(sandbox):
    # `go` refuses unless given the id only `peek` returns; without an edge in the graph it can never be fed.
    code = (
        "class E:\n"
        '    """S."""\n'
        "    def __init__(self):\n        self.n = 0\n        self.secret = 'k-1'\n"
        "    def go(self, key: str) -> dict:\n"
        '        """Go.\n\n        Args:\n            key: k.\n        """\n'
        "        if key != self.secret + 'x':\n            return {'success': False, 'error': 'bad key'}\n"
        "        self.n += 1\n        return {'success': True}\n"
    )
    graph = ToolGraph(nodes=(ToolNode(name="go", parameters=("key",), reads=("n",), writes=("n",)),), edges=())
    sampled = sample_chains(sandbox, code, graph, {"n": 0, "secret": "k-1"}, 2, seed=0, attempts=5)
    assert sampled.chains == () and sampled.dropped == {"call_failed": 5}


def test_a_required_id_nothing_gives_is_not_invented(sandbox):
    code = (FIXTURES / "orders.py").read_text()
    graph = extract_graph(sandbox, code)
    sampled = sample_chains(sandbox, code, graph, {"orders": {}, "audit": []}, 2, seed=0, attempts=4)
    assert sampled.chains == () and sampled.dropped == {"no_value": 4}


def test_a_graph_without_writers_gives_no_chain(sandbox):
    graph = ToolGraph(nodes=(ToolNode(name="get_account", parameters=("account_id",), reads=(), writes=()),), edges=())
    assert sample_chains(sandbox, BANK, graph, {}, 3).dropped == {"no_writer": 1}
    with pytest.raises(ValueError):
        sample_chains(sandbox, BANK, graph, {}, 3, min_calls=3, max_calls=2)


def test_values_at_reads_field_paths_of_results():
    assert values_at([{"book_id": "b1"}, {"book_id": "b2"}], "[].book_id") == ["b1", "b2"]
    assert values_at({"account": {"account_id": "acc-1"}}, "account.account_id") == ["acc-1"]
    assert values_at(["a", "b"], "[]") == ["a", "b"] and values_at({"x": [[1], [2]]}, "x[][]") == [1, 2]
    assert values_at({"x": 1}, "y") == [] and values_at("t1", "") == ["t1"]


# ------------------------------------------------------------------------------------------ derived checks

INITIAL = {
    "accounts": {"a": {"balance": 100, "frozen": False}, "b": {"balance": 5, "frozen": False}},
    "holds": {"h1": {"on": "a"}},
    "log": [{"id": "t1"}],
    "tags": ["x", "y"],
    "mode": "open",
}
FINAL = {
    "accounts": {"a": {"balance": 70, "frozen": True}, "b": {"balance": 5, "frozen": False},
                 "c": {"balance": 0, "frozen": False}},
    "holds": {},
    "log": [{"id": "t1"}, {"id": "t2"}],
    "tags": ["y"],
    "mode": "closed",
}  # fmt: skip


def test_the_diff_becomes_typed_items():
    kinds = {(i.kind, i.path, i.key) for i in derive_items(INITIAL, FINAL)}
    assert kinds == {
        ("moved", ("accounts", "a", "balance"), None), ("changed", ("accounts", "a", "frozen"), None),
        ("created", ("accounts",), "c"), ("deleted", ("holds",), "h1"), ("created", ("log",), None),
        ("deleted", ("tags",), None), ("changed", ("mode",), None), ("untouched", (), None),
    }  # fmt: skip
    assert derive_items(INITIAL, INITIAL) == []
    assert CheckItem(kind="moved", path=("accounts", "a", "balance"), value=-30).describe() == (
        "accounts.a.balance moves by -30"
    )


def test_derived_checks_are_clean_pass_on_the_final_state_and_fail_on_the_initial_one(sandbox):
    checks = derive_checks(INITIAL, FINAL)
    assert all(lint_check(source) == [] for source in checks)
    specs = checks_from_scenario(checks)
    assert run_checks(sandbox, specs, INITIAL, FINAL).solved
    on_initial = run_checks(sandbox, specs, INITIAL, INITIAL).checks
    assert [r.passed for r in on_initial] == [False] * (len(checks) - 1) + [True]  # only `untouched` holds
    assert all(r.error is None for r in on_initial)


def test_each_ablated_state_fails_some_derived_check(sandbox):
    specs = checks_from_scenario(derive_checks(INITIAL, FINAL))
    ablations = [
        FINAL | {"mode": "open"},  # one change left out
        FINAL | {"accounts": FINAL["accounts"] | {"a": {"balance": 60, "frozen": True}}},  # moved by a wrong amount
        FINAL | {"accounts": FINAL["accounts"] | {"b": {"balance": 6, "frozen": False}}},  # something else touched
        FINAL | {"log": FINAL["log"] + [{"id": "t3"}]} | {"extra": 1},
        FINAL | {"accounts": FINAL["accounts"] | {"c": {"balance": "0", "frozen": False}}},  # a wrong type
    ]
    for state in ablations:
        assert not run_checks(sandbox, specs, INITIAL, state).solved, state


def test_sampled_chains_verify_with_their_derived_checks(sandbox, bank):
    state, graph = bank
    sampled = sample_chains(sandbox, BANK, graph, state, 3, seed=11)
    for chain in sampled.chains:
        checks, evidence = verify_chain(sandbox, BANK, chain)
        if evidence.reason is None:
            assert evidence.checks_on_final == (True,) * len(checks)
            assert all(ablation.failing_checks for ablation in evidence.negative_control)
        else:  # a change a later call undid: no check can need that call
            assert evidence.reason == "negative_control_failed"
    assert any(verify_chain(sandbox, BANK, chain)[1].reason is None for chain in sampled.chains)


def test_a_chain_whose_changes_cancel_fails_the_negative_control(sandbox):
    calls = (
        ChainCall(name="freeze_account", arguments={"account_id": "acc-1"}, sources={}, result={}, changed=True),
        ChainCall(name="freeze_account", arguments={"account_id": "acc-1", "frozen": False}, sources={}, result={},
                  changed=True),
        ChainCall(name="transfer", arguments={"source": "acc-1", "target": "acc-2", "amount": 5}, sources={},
                  result={}, changed=True),
    )  # fmt: skip
    state = default_state(sandbox, BANK)
    accounts = state["accounts"]
    moved = {"acc-1": accounts["acc-1"] | {"balance": 9995}, "acc-2": accounts["acc-2"] | {"balance": 505}}
    transfer = {"id": "t1", "source": "acc-1", "target": "acc-2", "amount": 5, "memo": ""}
    final = state | {"accounts": accounts | moved, "transfers": [transfer]}
    _, evidence = verify_chain(sandbox, BANK, Chain(calls=calls, initial_state=state, final_state=final))
    assert evidence.reason == "negative_control_failed"
    assert "call 1 (freeze_account)" in evidence.detail


CLINIC = '''"""A clinic: patients, their visits (scheduled or done) and follow-up notes."""

import datetime


class Clinic:
    """State: patients and visits."""

    def __init__(self):
        self.patients = {}
        self.visits = {}

    def find_patient(self, name: str) -> dict:
        """Find a patient by name.

        Args:
            name: The patient's full name.
        """
        for pid, patient in self.patients.items():
            if patient["name"] == name:
                return {"success": True, "patient_id": pid}
        return {"success": False, "error": "no such patient"}

    def reschedule_visit(self, visit_id: str, start: str, end: str) -> dict:
        """Move a scheduled visit.

        Args:
            visit_id: The visit to move.
            start: New start, YYYY-MM-DDTHH:MM.
            end: New end, YYYY-MM-DDTHH:MM.
        """
        visit = self.visits.get(visit_id)
        if visit is None or visit["status"] != "scheduled":
            return {"success": False, "error": "only scheduled visits can be moved"}
        now = datetime.datetime.now()
        if datetime.datetime.fromisoformat(start) <= now or end <= start:
            return {"success": False, "error": "a visit must start in the future and end after it starts"}
        visit["start"] = start
        visit["end"] = end
        return {"success": True}
'''


def clinic_state():
    patients = {f"P-{i}": {"patient_id": f"P-{i}", "name": f"Person {i}"} for i in range(1, 4)}
    visits = {
        f"V-{i}": {"visit_id": f"V-{i}", "patient_id": f"P-{1 + i % 3}", "status": "done" if i % 2 else "scheduled",
                   "start": "2025-03-01T09:00", "end": "2025-03-01T09:30"}
        for i in range(1, 7)
    }  # fmt: skip
    return {"patients": patients, "visits": visits}


def test_chains_skip_wrong_status_records_keep_dates_consistent_and_stay_on_one_patient(sandbox):
    state = clinic_state()
    graph = extract_graph(sandbox, CLINIC, state, now="2025-03-10T10:00:00")
    sampled = sample_chains(sandbox, CLINIC, graph, state, 3, seed=2, min_calls=1, now="2025-03-10T10:00:00")
    assert sampled.chains
    for chain in sampled.chains:
        move = next(call for call in chain.calls if call.name == "reschedule_visit")
        visit = state["visits"][move.arguments["visit_id"]]
        assert visit["status"] == "scheduled"  # a done visit is refused, and another record of the table is tried
        start, end = move.arguments["start"], move.arguments["end"]
        assert "2025-03-10T10:00" < start < end and len(start) == 16  # after now, end after start, its format
        patient = chain.anchor.split("/")[1]
        assert chain.anchor.startswith("patients/") and visit["patient_id"] == patient  # the anchor's own visit
        for call in chain.calls:
            if call.name == "find_patient":
                assert call.arguments["name"] == state["patients"][patient]["name"]


def test_a_chain_naming_another_patients_record_is_dropped_as_incoherent():
    from builder.stages.scenarios.anchors import allowed, coherent_value, described_choices, world_of

    world = world_of(clinic_state())
    mine = allowed(world, ("patients", "P-2"))  # P-2's visits are V-1 and V-4
    assert coherent_value(world, "V-1", mine) and coherent_value(world, "Person 2", mine)
    assert not coherent_value(world, "V-2", mine)  # P-3's visit
    assert not coherent_value(world, "Person 3", mine)  # a value of another patient's record
    assert coherent_value(world, "scheduled", mine)  # vocabulary several records share
    assert described_choices({"description": "in_person or virtual"}) == ["in_person", "virtual"]
    assert described_choices({"description": "one of general, orthodontics or pediatric"}) == [
        "general", "orthodontics", "pediatric"]  # fmt: skip


def test_the_sampler_counts_incoherent_chains(sandbox, monkeypatch):
    from builder.stages.scenarios import chains

    state = clinic_state()
    graph = extract_graph(sandbox, CLINIC, state, now="2025-03-10T10:00:00")
    # the check before wording sees every visit id as another record's: each executed chain is dropped and counted
    monkeypatch.setattr(chains, "coherent_value", lambda world, value, allowed: not str(value).startswith("V-"))
    sampled = sample_chains(sandbox, CLINIC, graph, state, 2, seed=2, min_calls=1, attempts=6,
                            now="2025-03-10T10:00:00")  # fmt: skip
    assert not sampled.chains and sampled.dropped.get("incoherent", 0) > 0
