"""Long-context states (builder/stages/scenarios/long_context.py): distractor records that look real, form their
own world, keep the task's names unique and leave the fixture scenario's gold and checks working."""

from __future__ import annotations

import copy
import json
import re
import time
from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.checks import checks_from_scenario, published_reward, run_checks
from builder.envs.guard import is_guard
from builder.envs.session import Session
from builder.json_values import leaves, record_pairs
from builder.records import Action
from builder.rollout.reward import gold_paths, with_guard
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.long_context import enlarge, protected_values
from tests.fixtures.scenarios import BANK_CHECKS, BANK_GOLD, BANK_STATE, LIBRARY_STATE

FIXTURES = Path(__file__).parent / "fixtures"
DENTAL = json.loads((FIXTURES / "states" / "teacher8_dental.json").read_text())
CLAIMS = json.loads((FIXTURES / "states" / "teacher8_claims.json").read_text())
# tests/test_stage_scenarios.py's bank: three customers, four accounts.
BANK_THREE = {
    "customers": {"c1": {"name": "Ada Lovelace", "tier": "gold"}, "c2": {"name": "Grace Hopper", "tier": "basic"},
                  "c3": {"name": "Alan Turing", "tier": "basic"}},
    "accounts": {"acc-1": {"owner": "c1", "balance": 10000, "kind": "checking", "frozen": False},
                 "acc-2": {"owner": "c1", "balance": 500, "kind": "savings", "frozen": False},
                 "acc-3": {"owner": "c2", "balance": 2500, "kind": "checking", "frozen": False},
                 "acc-4": {"owner": "c3", "balance": 0, "kind": "savings", "frozen": False}},
    "transfers": [],
    "daily_limit": 50000,
}  # fmt: skip
BANK_PROTECTED = ("acc-1", "acc-2", "Ada Lovelace", "c1", "checking", "savings", "300")
ENUM_FIELDS = {"tier", "kind", "frozen", "status", "mode", "specialty", "policy_type", "document_type", "method"}


def protected_of(scenario: dict) -> set[str]:
    """What the lead passes: the gold's argument values, and every state value the task mentions."""
    arguments = [action["arguments"] for action in scenario["gold_actions"]]
    return protected_values(scenario["initial_state"], [scenario["task"]], arguments)


def distractors(original: dict, enlarged: dict, name: str) -> list[tuple[object, dict]]:
    return (record_pairs(enlarged[name]) or [])[len(record_pairs(original[name]) or []) :]


def collections_of(state: dict) -> dict[str, list]:
    return {name: pairs for name, value in state.items() if (pairs := record_pairs(value)) is not None}


def assert_originals_intact(original: dict, enlarged: dict) -> None:
    for name, value in original.items():
        pairs = record_pairs(value)
        if pairs is None:
            assert enlarged[name] == value
        else:
            assert (record_pairs(enlarged[name]) or [])[: len(pairs)] == pairs  # same keys, values and order first


def conflicting(value: str, protected: set[str]) -> list[str]:
    text = value.casefold()
    return [p for p in protected if re.search(rf"(?<![0-9a-z]){re.escape(p.casefold())}(?![0-9a-z])", text)]


def assert_no_protected(original: dict, enlarged: dict, protected: set[str]) -> None:
    for name in collections_of(original):
        for key, record in distractors(original, enlarged, name):
            assert not conflicting(str(key), protected), (name, key)
            for field, value in record.items():
                if field in ENUM_FIELDS:
                    continue
                for leaf in leaves(value):
                    if isinstance(leaf, str):
                        assert not conflicting(leaf, protected), (name, key, field, leaf)


# ------------------------------------------------------------------------------------------ sizes and originals


@pytest.mark.parametrize(
    "state",
    [BANK_STATE, BANK_THREE, LIBRARY_STATE, DENTAL["initial_state"], CLAIMS["initial_state"]],
    ids=["bank", "bank3", "library", "dental", "claims"],
)
@pytest.mark.parametrize("records", [40, 300])
def test_sizes_reached_in_proportion_with_the_originals_first_and_unchanged(state, records):
    before = copy.deepcopy(state)
    enlarged = enlarge(state, records=records, protected=(), seed=3)
    assert state == before  # the input is not touched
    assert_originals_intact(state, enlarged)
    sizes = {name: len(pairs) for name, pairs in collections_of(state).items()}
    grown = {name: len(enlarged[name]) for name in sizes}
    total = sum(sizes.values())
    if records <= total:
        assert grown == sizes
        return
    assert abs(sum(grown.values()) - records) <= len(sizes)
    for name, size in sizes.items():
        assert grown[name] == max(size, round(size * records / total))


def test_a_state_already_large_enough_or_without_collections_comes_back_as_an_equal_copy():
    assert enlarge(DENTAL["initial_state"], records=10, protected=(), seed=1) == DENTAL["initial_state"]
    plain = {"value": 3, "log": [], "tags": ["a", "b"]}
    copied = enlarge(plain, records=500, protected=(), seed=1)
    assert copied == plain and copied is not plain


def test_the_same_seed_gives_the_same_state_and_another_seed_another():
    state = DENTAL["initial_state"]
    first = enlarge(state, records=500, protected=protected_of(DENTAL), seed=11)
    assert enlarge(state, records=500, protected=protected_of(DENTAL), seed=11) == first
    assert enlarge(state, records=500, protected=protected_of(DENTAL), seed=12) != first
    assert json.dumps(first)  # still JSON


# ------------------------------------------------------------------------------------------ keys


def test_numbered_keys_continue_after_the_largest_and_own_id_fields_follow():
    enlarged = enlarge(DENTAL["initial_state"], records=600, protected=(), seed=2)
    for name, prefix, field in (("patients", "P-", "patient_id"), ("time_slots", "TS-", "slot_id"),
                                ("appointments", "A-", "appointment_id")):  # fmt: skip
        originals = DENTAL["initial_state"][name]
        largest = max(int(key.removeprefix(prefix)) for key in originals)
        new = distractors(DENTAL["initial_state"], enlarged, name)
        numbers = [int(key.removeprefix(prefix)) for key, _ in new]
        assert numbers == list(range(largest + 1, largest + 1 + len(new)))  # contiguous: count+1 / max+1 ids stay free
        assert all(record[field] == key for key, record in new)


def test_unnumbered_keys_get_random_keys_of_the_same_shape():
    enlarged = enlarge(CLAIMS["initial_state"], records=400, protected=(), seed=2)
    new = [key for key, _ in distractors(CLAIMS["initial_state"], enlarged, "claims")]
    assert new and all(re.fullmatch(r"[A-Z]{3}\d{3}", key) for key in new)
    assert len(set(new) | set(CLAIMS["initial_state"]["claims"])) == len(enlarged["claims"])  # none collide
    assert all(enlarged["claims"][key]["claim_id"] == key for key in new)


def test_zero_padded_uuid_and_list_ids_keep_their_format():
    state = {
        "tickets": {"0041": {"title": "Printer jam", "user": "u-1"}, "0042": {"title": "VPN down", "user": "u-2"}},
        "devices": {"3f2b9c1e-77aa-4c1d-9e0f-1a2b3c4d5e6f": {"model": "X1"}},
        "events": [{"id": 7, "ticket_id": "0041", "note": "opened"}, {"id": 9, "ticket_id": "0042", "note": "seen"}],
        "lines": [{"text": "a"}, {"text": "b"}],
    }
    enlarged = enlarge(state, records=60, protected=(), seed=4)
    tickets = [key for key, _ in distractors(state, enlarged, "tickets")]
    assert tickets[:3] == ["0043", "0044", "0045"]
    devices = [key for key, _ in distractors(state, enlarged, "devices")]
    assert devices and all(
        re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", d) for d in devices
    )
    events = enlarged["events"][2:]
    assert [e["id"] for e in events] == list(range(10, 10 + len(events)))
    assert all(e["ticket_id"] in tickets for e in events)  # list items point at ticket clones too
    assert enlarged["lines"][:2] == state["lines"] and len(enlarged["lines"]) > 2


def test_a_list_items_own_id_is_the_field_named_like_the_list_and_the_others_are_references():
    state = {
        "members": {"m1": {"name": "Sam"}, "m2": {"name": "Kim"}},
        "books": {"b1": {"title": "Dune"}},
        "loans": [{"member_id": "m1", "book_id": "b1", "loan_id": "L1"}],
    }
    enlarged = enlarge(state, records=40, protected=(), seed=1)
    loans = enlarged["loans"][1:]
    assert loans and [loan["loan_id"] for loan in loans] == [f"L{i}" for i in range(2, 2 + len(loans))]
    assert all(loan["member_id"] not in ("m1", "m2") and loan["member_id"] in enlarged["members"] for loan in loans)
    assert all(loan["book_id"] != "b1" and loan["book_id"] in enlarged["books"] for loan in loans)


def test_a_protected_key_is_skipped():
    enlarged = enlarge(BANK_THREE, records=30, protected=("acc-6",), seed=1)
    keys = list(enlarged["accounts"])
    assert "acc-6" not in keys and "acc-5" in keys and "acc-7" in keys


# ------------------------------------------------------------------------------------------ references


def test_distractors_refer_only_to_distractors_so_the_task_keeps_its_meaning():
    state = DENTAL["initial_state"]
    enlarged = enlarge(state, records=1000, protected=protected_of(DENTAL), seed=5)
    targets = {"patient_id": "patients", "dentist_id": "dentists", "slot_id": "time_slots",
               "service_id": "services", "clinic_id": "clinics"}  # fmt: skip
    for name in collections_of(state):
        for key, record in distractors(state, enlarged, name):
            for field, target in targets.items():
                if field in record and target != name:
                    assert record[field] not in state[target], (name, key, field)  # never an original
                    assert record[field] in enlarged[target], (name, key, field)  # always an existing clone
    lucas = [a for a in enlarged["appointments"].values() if a["patient_id"] == "P-4"]
    assert len(lucas) == 2  # "cancel all my bookings" still means A-2 and A-9


def test_the_bank_owner_references_move_to_distractor_customers():
    enlarged = enlarge(BANK_STATE, records=40, protected=BANK_PROTECTED, seed=1)
    new_customers = {key for key, _ in distractors(BANK_STATE, enlarged, "customers")}
    owners = {record["owner"] for _, record in distractors(BANK_STATE, enlarged, "accounts")}
    assert owners and owners <= new_customers
    assert [k for k, a in enlarged["accounts"].items() if a["owner"] == "c1"] == ["acc-1", "acc-2", "acc-3"]


def test_a_clone_whose_reference_has_no_clone_is_dropped_not_attached_to_an_original():
    state = {"owners": {"o1": {"name": "Ada Lovelace"}}, "pets": {f"p{i}": {"owner_id": "o1"} for i in range(1, 20)}}
    enlarged = enlarge(state, records=24, protected=(), seed=1)  # 1 owner stays 1: no owner clone to point at
    assert len(enlarged["owners"]) == 1 and list(enlarged["pets"]) == list(state["pets"])


# ------------------------------------------------------------------------------------------ values


def test_values_look_like_the_collections_own():
    state = DENTAL["initial_state"]
    enlarged = enlarge(state, records=2000, protected=protected_of(DENTAL), seed=6)
    new_slots = [r for _, r in distractors(state, enlarged, "time_slots")]
    starts = sorted(s["start"][:10] for s in state["time_slots"].values())
    for slot in new_slots:
        assert slot["start"] < slot["end"] and slot["start"][10:] in {
            s["start"][10:] for s in state["time_slots"].values()
        }
        assert starts[0] <= slot["start"][:10] <= starts[-1]
        assert slot["mode"] in {"in_person", "virtual"} and isinstance(slot["is_booked"], bool)
    services = [r for _, r in distractors(state, enlarged, "services")]
    prices = [s["price_cents"] for s in state["services"].values()]
    assert all(min(prices) <= s["price_cents"] <= max(prices) and s["price_cents"] % 500 == 0 for s in services)
    assert len({s["price_cents"] for s in services}) > len(set(prices))  # perturbed, not only copied
    patients = [r for _, r in distractors(state, enlarged, "patients")]
    names = {p["name"] for p in patients}
    assert len(names - {p["name"] for p in state["patients"].values()}) > 100
    for patient in patients:  # the e-mail follows the renamed person
        first, last = patient["name"].casefold().split(" ")
        assert re.fullmatch(rf"{first}\.{last}\d*@example\.com", patient["email"])
        assert re.fullmatch(r"\+1-\d{3}-555-\d{4}", patient["phone"])
    emails = [p["email"] for p in patients] + [p["email"] for p in state["patients"].values()]
    assert len(set(emails)) == len(emails)  # an identifier-like field stays unique
    dentists = [r["name"] for _, r in distractors(state, enlarged, "dentists")]
    assert all(name.startswith("Dr. ") for name in dentists)


def test_nested_values_and_numbers_stay_coherent_within_a_record():
    state = CLAIMS["initial_state"]
    enlarged = enlarge(state, records=800, protected=protected_of(CLAIMS), seed=8)
    for _, claim in distractors(state, enlarged, "claims"):
        assert claim["incident_date"] <= claim["filed_date"]  # one shift per record keeps the order
        assert claim["status_history"][0]["timestamp"][:10] >= claim["incident_date"]
        assert 0 <= claim["approved_amount"] <= claim["claimed_amount"]


# ------------------------------------------------------------------------------------------ protected values


@pytest.mark.parametrize("scenario", [DENTAL, CLAIMS], ids=["dental", "claims"])
def test_no_distractor_contains_a_protected_value(scenario):
    protected = protected_of(scenario)
    assert {"lucas.ferreira@example.com", "Lucas Ferreira"} <= protected or "ABC123" in protected
    enlarged = enlarge(scenario["initial_state"], records=2000, protected=protected, seed=9)
    assert_no_protected(scenario["initial_state"], enlarged, protected)


def test_protected_values_match_whole_words_case_insensitively_and_enums_are_exempt():
    enlarged = enlarge(BANK_THREE, records=200, protected=BANK_PROTECTED, seed=2)
    assert_no_protected(BANK_THREE, enlarged, set(BANK_PROTECTED))
    names = {c["name"] for _, c in distractors(BANK_THREE, enlarged, "customers")}
    assert not any("ada lovelace" in n.casefold() for n in names)
    assert any(n.endswith(" Lovelace") for n in names)  # a part of a protected name is fine
    assert "acc-10" in enlarged["accounts"]  # `acc-1` does not block `acc-10`
    kinds = {a["kind"] for _, a in distractors(BANK_THREE, enlarged, "accounts")}
    assert kinds == {"checking", "savings"}  # enum values named by the task stay in use


def test_one_and_two_digit_numbers_are_not_protected_so_phones_survive():
    state = DENTAL["initial_state"]
    enlarged = enlarge(state, records=500, protected=["1", "30", "Lucas Ferreira"], seed=1)
    phones = [p["phone"] for _, p in distractors(state, enlarged, "patients")]
    assert len(phones) == round(7 * 500 / 53) - 7 and all(p.startswith("+1-") for p in phones)
    assert len(enlarge(state, records=500, protected=["555"], seed=1)["patients"]) == 7  # every phone has -555-


def test_a_distractor_that_cannot_avoid_a_protected_value_is_dropped():
    state = {"notes": {"n1": {"text": "Call Ada Lovelace back about the loan"}}, "tags": {"t1": {"label": "x y"}}}
    enlarged = enlarge(state, records=20, protected=("Ada Lovelace",), seed=1)
    assert list(enlarged["notes"]) == ["n1"] and len(enlarged["tags"]) > 1


def test_protected_values_are_the_golds_arguments_and_the_state_values_the_texts_mention():
    found = protected_of(DENTAL)
    assert {"Lucas Ferreira", "lucas.ferreira@example.com", "P-4", "A-2", "TS-4", "D-1", "S-1"} <= found
    assert {"Dr. Rebecca Liang", "in_person"} & found == {"Dr. Rebecca Liang"}  # "in_person" is not said
    assert "Olivia Bennett" not in found and "virtual consultation" in found  # named by the task
    bank = protected_values(BANK_THREE, ["Move 3 from acc-1 to acc-2", "I am Ada Lovelace"], [{"amount": 3}])
    assert bank == {"3", "acc-1", "acc-2", "Ada Lovelace"}  # not acc-3 or "checking": the texts do not say them
    assert protected_values(BANK_THREE, [], [{"flag": True, "memo": " "}]) == set()


# ------------------------------------------------------------------------------------------ speed


def test_two_thousand_records_take_well_under_a_second_or_two():
    started = time.perf_counter()
    enlarged = enlarge(CLAIMS["initial_state"], records=2000, protected=protected_of(CLAIMS), seed=1)
    assert time.perf_counter() - started < 3.0
    assert sum(len(v) for v in collections_of(enlarged).values()) >= 1990


# ------------------------------------------------------------------------------------------ in a sandbox


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(call_timeout_s=10.0, kill_grace_s=1.0, memory_mb=512)) as runtime:
        yield runtime


def run_gold(sandbox, code: str, state: dict, gold, now: str | None = None) -> tuple[dict, list]:
    kwargs = {"now": now} if now else {}
    with Session(sandbox, code, state, **kwargs) as session:
        results = [session.call(action.name, action.arguments) for action in gold]
        return session.snapshot(), results


def test_the_bank_gold_still_passes_its_checks_and_guard_on_the_enlarged_state(sandbox):
    code = (FIXTURES / "envs" / "bank.py").read_text()
    enlarged = enlarge(BANK_STATE, records=1000, protected=BANK_PROTECTED, seed=4)
    assert len(enlarged["accounts"]) > 500
    final, _ = run_gold(sandbox, code, enlarged, BANK_GOLD)
    specs = checks_from_scenario(list(BANK_CHECKS))
    assert run_checks(sandbox, specs, enlarged, final).solved
    assert not any(c.passed for c in run_checks(sandbox, specs, enlarged, enlarged).checks)
    guarded = with_guard(BANK_CHECKS, gold_paths(sandbox, code, enlarged, BANK_GOLD))
    verdict = published_reward(sandbox, checks_from_scenario(guarded), enlarged, final)
    assert (verdict.reward, verdict.solved) == (1.0, True)


@pytest.mark.parametrize("name", ["bank", "desks", "lending", "library", "counter", "crashing", "orders"])
def test_fixture_environments_default_states_load_enlarged(sandbox, name):
    code = (FIXTURES / "envs" / f"{name}.py").read_text()
    with Session(sandbox, code) as session:
        default = session.snapshot()
    enlarged = enlarge(default, records=300, protected=(), seed=1)
    assert_originals_intact(default, enlarged)
    with Session(sandbox, code, enlarged) as session:
        assert session.snapshot() == enlarged  # the class takes the enlarged state as it is


def test_the_desks_environment_books_a_fresh_id_after_the_distractors(sandbox):
    code = (FIXTURES / "envs" / "desks.py").read_text()
    with Session(sandbox, code) as session:
        default = session.snapshot()
    enlarged = enlarge(default, records=100, protected=("D-101", "2025-03-20"), seed=1)
    book = Action(name="book_desk", arguments={"desk_id": "D-101", "date": "2025-03-20"})
    final, results = run_gold(sandbox, code, enlarged, [book])
    assert results[0].ok and results[0].result["success"] is True
    assert len(final["bookings"]) == len(enlarged["bookings"]) + 1  # nothing overwritten


def test_a_capable_models_gold_still_passes_on_two_thousand_records(sandbox):
    code = (FIXTURES / "states" / "teacher8_dental_env.py").read_text()
    gold = [Action(name=a["name"], arguments=a["arguments"]) for a in DENTAL["gold_actions"]]
    enlarged = enlarge(DENTAL["initial_state"], records=2000, protected=protected_of(DENTAL), seed=1)
    final, results = run_gold(sandbox, code, enlarged, gold, now=DENTAL["now"])
    assert all(r.ok and not r.refused for r in results), [r.content() for r in results]
    found = results[0].content()  # find_patients by e-mail still finds exactly one patient
    assert "P-4" in found and found.count('"patient_id"') == 1
    task_checks = [c for c in DENTAL["checks"] if not is_guard(c)]
    checks = with_guard(task_checks, gold_paths(sandbox, code, enlarged, gold, now=DENTAL["now"]))
    verdict = published_reward(sandbox, checks_from_scenario(checks), enlarged, final, now=DENTAL["now"])
    assert (verdict.reward, verdict.solved) == (1.0, True)
