"""Long-context states (builder/stages/scenarios/long_context.py): distractor records that look real, form whole
copies of the world that keep its relations (builder/stages/scenarios/invariants.py), keep the task's names unique,
leave the fixture scenario's gold and checks working, and fall back to fewer when the sandbox refuses them."""

from __future__ import annotations

import copy
import datetime as dt
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
from builder.stages.scenarios.invariants import relation_problems, relations
from builder.stages.scenarios.long_context import checked_enlarge, enlarge, protected_values, week_shifts
from tests.fixtures.scenarios import BANK_CHECKS, BANK_GOLD, BANK_STATE, LIBRARY_STATE

FIXTURES = Path(__file__).parent / "fixtures"
DENTAL = json.loads((FIXTURES / "states" / "teacher8_dental.json").read_text())
CLAIMS = json.loads((FIXTURES / "states" / "teacher8_claims.json").read_text())
PROVIDERS = json.loads((FIXTURES / "states" / "teacher9_providers.json").read_text())  # teacher-9's provider network
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
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")
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
                    if isinstance(leaf, str) and not DATE.match(leaf):  # copied dates are exempt
                        assert not conflicting(leaf, protected), (name, key, field, leaf)


# ------------------------------------------------------------------------------------------ sizes and originals


@pytest.mark.parametrize(
    "state",
    [BANK_STATE, BANK_THREE, LIBRARY_STATE, *(s["initial_state"] for s in (DENTAL, CLAIMS, PROVIDERS))],
    ids=["bank", "bank3", "library", "dental", "claims", "providers"],
)
@pytest.mark.parametrize("records", [40, 300])
def test_whole_rounds_of_every_collection_with_the_originals_first_and_unchanged(state, records):
    before = copy.deepcopy(state)
    enlarged = enlarge(state, records=records, protected=(), seed=3)
    assert state == before  # the input is not touched
    assert_originals_intact(state, enlarged)
    sizes = {name: len(pairs) for name, pairs in collections_of(state).items()}
    total = sum(sizes.values())
    rounds = max(0, round((records - total) / total))
    assert {name: len(enlarged[name]) for name in sizes} == {name: size * (1 + rounds) for name, size in sizes.items()}
    if rounds:
        assert abs(sum(len(enlarged[name]) for name in sizes) - records) <= total / 2


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


def test_each_round_copies_a_record_with_everything_that_refers_to_it():
    state = {"owners": {"o1": {"name": "Ada Lovelace"}}, "pets": {f"p{i}": {"owner_id": "o1"} for i in range(1, 20)}}
    enlarged = enlarge(state, records=60, protected=(), seed=1)  # two rounds: two owners with 19 pets each
    assert list(enlarged["owners"]) == ["o1", "o2", "o3"]
    owners = [pet["owner_id"] for pet in enlarged["pets"].values()]
    assert {owner: owners.count(owner) for owner in owners} == {"o1": 19, "o2": 19, "o3": 19}


def test_a_catalog_of_codes_is_shared_not_grown():
    state = {
        "modalities": {"MRI": {"name": "Magnetic Resonance Imaging", "price_cents": 118000},
                       "CT": {"name": "Computed Tomography", "price_cents": 64000}},
        "slots": {f"S-{i}": {"modality_id": "MRI" if i % 2 else "CT", "start": f"2025-02-0{i}T09:00"}
                  for i in range(1, 7)},
    }  # fmt: skip
    enlarged = enlarge(state, records=40, protected=(), seed=1)
    assert enlarged["modalities"] == state["modalities"] and len(enlarged["slots"]) == 6 * 6  # (40 - 8) / 6 rounds
    assert {slot["modality_id"] for slot in enlarged["slots"].values()} == {"MRI", "CT"}


# ------------------------------------------------------------------------------------------ values


def test_values_look_like_the_collections_own():
    state = DENTAL["initial_state"]
    enlarged = enlarge(state, records=2000, protected=protected_of(DENTAL), seed=6, now=DENTAL["now"])
    new_slots = [r for _, r in distractors(state, enlarged, "time_slots")]
    for slot in new_slots:  # a copy of an original slot: its time, mode and booking
        assert slot["start"] < slot["end"] and slot["mode"] in {"in_person", "virtual"}
        assert any((s["start"], s["end"], s["mode"]) == (slot["start"], slot["end"], slot["mode"])
                   for s in state["time_slots"].values())  # fmt: skip
    prices = {s["price_cents"] for s in state["services"].values()}
    assert {s["price_cents"] for _, s in distractors(state, enlarged, "services")} == prices  # copied, not scaled
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


@pytest.mark.parametrize("scenario", [PROVIDERS, DENTAL], ids=["providers", "dental"])
def test_the_relations_between_records_hold_among_the_distractors(scenario):
    state = scenario["initial_state"]
    found = {str(r) for r in relations(state)}
    assert "appointment_slots.is_booked = exists appointments by slot_id where status != 'cancelled'" in found or (
        "time_slots.is_booked = exists appointments by slot_id where status != 'cancelled'" in found
    )
    enlarged = enlarge(state, records=1000, protected=protected_of(scenario), seed=2, now=scenario["now"])
    assert relation_problems(state, enlarged) == []
    if scenario is PROVIDERS:  # teacher-9's review: a rating without reviews, counts that did not match
        assert {"providers.rating = mean of reviews.rating by provider_id",
                "providers.review_count = count reviews by provider_id"} <= found  # fmt: skip
        reviews = [r for r in enlarged["reviews"].values()]
        for key, provider in enlarged["providers"].items():
            ratings = [r["rating"] for r in reviews if r["provider_id"] == key]
            assert provider["review_count"] == len(ratings)
            assert abs(provider["rating"] - (sum(ratings) / len(ratings) if ratings else 0)) < 0.06
        # the review of a distractor is of an appointment of the same distractor patient and provider
        appointments = enlarged["appointments"]
        for review in reviews:
            visit = appointments[review["appointment_id"]]
            assert (visit["patient_id"], visit["provider_id"]) == (review["patient_id"], review["provider_id"])


def test_a_broken_relation_is_found():
    state = PROVIDERS["initial_state"]
    enlarged = enlarge(state, records=300, protected=(), seed=2)
    slot = next(k for k, s in list(enlarged["appointment_slots"].items())[30:] if s["is_booked"])
    enlarged["appointment_slots"][slot]["is_booked"] = False
    review = list(enlarged["reviews"])[-1]
    enlarged["reviews"][review]["rating"] = 1 if enlarged["reviews"][review]["rating"] > 3 else 5
    problems = relation_problems(state, enlarged)
    assert any(slot in p and "is_booked" in p for p in problems)
    assert any("providers.rating" in p for p in problems)


def test_dates_move_by_whole_weeks_per_round_and_stay_on_their_side_of_now():
    state = {"visits": {f"V-{i}": {"start": f"2025-03-{10 + i}T09:30", "booked_on": f"2025-02-{10 + i}"}
                        for i in range(1, 6)}}  # fmt: skip
    now = "2025-02-28T12:00:00"  # booked before (Feb 11-15), visits after (Mar 11-15): one week either way
    assert week_shifts(state, now) == [-7, 0, 7]
    assert week_shifts(state, None) == [0]
    enlarged = enlarge(state, records=100, protected=(), seed=4, now=now)
    original = list(state["visits"].values())
    for index, (_, visit) in enumerate(distractors(state, enlarged, "visits")):
        template = original[index % 5]
        moved = (dt.date.fromisoformat(visit["start"][:10]) - dt.date.fromisoformat(template["start"][:10])).days
        assert moved % 7 == 0 and visit["start"][10:] == template["start"][10:]
        booked = (dt.date.fromisoformat(visit["booked_on"]) - dt.date.fromisoformat(template["booked_on"])).days
        assert booked == moved  # one shift for the whole record (and round)
        assert visit["booked_on"] < now[:10] < visit["start"]
    assert len({visit["start"] for visit in enlarged["visits"].values()}) > 5  # rounds moved differently


def test_nested_values_and_numbers_stay_coherent_within_a_record():
    state = CLAIMS["initial_state"]
    enlarged = enlarge(state, records=800, protected=protected_of(CLAIMS), seed=8)
    for _, claim in distractors(state, enlarged, "claims"):
        assert claim["incident_date"] <= claim["filed_date"]  # one shift per round keeps the order
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
    assert len(phones) == 7 * round((500 - 53) / 53) and all(p.startswith("+1-") for p in phones)
    assert len(enlarge(state, records=500, protected=["555"], seed=1)["patients"]) == 7  # every phone has -555-


def test_a_round_that_cannot_avoid_a_protected_value_is_dropped_whole():
    state = {"notes": {"n1": {"text": "Call Ada Lovelace back about the loan"}}, "tags": {"t1": {"label": "x y"}}}
    assert enlarge(state, records=20, protected=("Ada Lovelace",), seed=1) == state  # no world with a hole
    notes = {f"n{i}": {"text": f"note {i}", "author": "Ada Lovelace" if i == 1 else "Grace Hopper"} for i in (1, 2)}
    enlarged = enlarge({"notes": notes}, records=10, protected=("Ada Lovelace",), seed=1)
    assert list(enlarged["notes"]) == ["n1", "n2", "n3", "n4", "n5", "n6", "n7", "n8", "n9", "n10"]  # no gaps


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


# ------------------------------------------------------------------------------------------ checked in the sandbox

CLUB = '''"""A club: members on plans; a plan counts its members."""


class ClubEnv:
    """Members belong to plans."""

    def __init__(self):
        self.plans = {"gold": {"title": "Gold", "members": 2}, "basic": {"title": "Basic", "members": 1}}
        self.members = {"m1": {"name": "Ada Lovelace", "plan_id": "gold"},
                        "m2": {"name": "Grace Hopper", "plan_id": "gold"},
                        "m3": {"name": "Alan Turing", "plan_id": "basic"}}
        self.desks = {"d1": {"floor": 1}, "d2": {"floor": 2}}

    def list_members(self, plan_id: str) -> list:
        """Members of a plan.

        Args:
            plan_id: The plan, e.g. "gold".

        Returns:
            Member ids.
        """
        if len(self.desks) > LIMIT:
            raise RuntimeError("too many desks to list")
        return sorted(k for k, m in self.members.items() if m["plan_id"] == plan_id)
'''


def test_a_state_whose_relations_or_tools_break_falls_back_to_fewer_distractors(sandbox):
    counted = CLUB.replace("LIMIT", "10**6")
    state = {"plans": {"gold": {"title": "Gold", "members": 2}, "basic": {"title": "Basic", "members": 1}},
             "members": {"m1": {"name": "Ada Lovelace", "plan_id": "gold"},
                         "m2": {"name": "Grace Hopper", "plan_id": "gold"},
                         "m3": {"name": "Alan Turing", "plan_id": "basic"}},
             "desks": {"d1": {"floor": 1}, "d2": {"floor": 2}}}  # fmt: skip
    assert [str(r) for r in relations(state)] == ["plans.members = count members by plan_id"]
    assert relation_problems(state, enlarge(state, records=100, seed=1))  # the shared plans now miscount
    kept = checked_enlarge(sandbox, counted, state, records=100, protected=(), seed=1, now="2025-01-01T09:00:00")
    assert kept == state  # every size breaks the count: the original, not an inconsistent state
    without_count = {**state, "plans": {"gold": {"title": "Gold"}, "basic": {"title": "Basic"}}}
    limited = CLUB.replace("LIMIT", "20").replace(', "members": 2', "").replace(', "members": 1', "")
    assert len(enlarge(without_count, records=100, seed=1)["desks"]) > 20  # the tool would crash on it
    kept = checked_enlarge(sandbox, limited, without_count, records=100, protected=(), seed=1,
                           now="2025-01-01T09:00:00")  # fmt: skip
    assert 2 < len(kept["desks"]) <= 20 and len(kept["members"]) > 3  # fewer distractors, not none


def test_teacher_nines_provider_state_grows_consistently_and_its_gold_still_runs(sandbox):
    code = (FIXTURES / "states" / "teacher9_providers_env.py").read_text()
    state, now = PROVIDERS["initial_state"], PROVIDERS["now"]
    enlarged = checked_enlarge(sandbox, code, state, records=1000, protected=protected_of(PROVIDERS), seed=1,
                               now=now)  # fmt: skip
    assert sum(len(v) for v in collections_of(enlarged).values()) >= 1000 and relation_problems(state, enlarged) == []
    gold = [Action(name=a["name"], arguments=a["arguments"]) for a in PROVIDERS["gold_actions"]]
    _, results = run_gold(sandbox, code, enlarged, gold, now=now)
    assert all(r.ok and not r.refused for r in results), [r.content() for r in results]
    assert results[1].content().count('"provider_id"') == 1  # Dr. Benjamin Osei is still one provider
