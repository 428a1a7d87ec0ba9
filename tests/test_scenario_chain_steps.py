"""The graph method's step rules (`chain_steps`) and answer facts (`chain_facts`): no-op writes, free text of other
records, empty reads and duplicate creates are never sampled; the reads a user asks about give answer facts that
the scenario grades. Unit tests on values, then the sampler and the stage on a care desk environment (real
sandbox)."""

import json

import pytest

from builder.config import SandboxConfig
from builder.envs.answer import states
from builder.envs.graph import extract_graph
from builder.envs.schema import inspect_source
from builder.json_values import leaves
from builder.records import Environment, Scenario
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.chain import ChainCall
from builder.stages.scenarios.chain_facts import read_facts, reported, without
from builder.stages.scenarios.chain_steps import (
    duplicate_values,
    duplicates,
    field_of,
    free_text_values,
    is_empty,
    is_free_text,
    targets,
    undone,
    without_noop,
)
from builder.stages.scenarios.chains import STEP_REASONS, sample_chains
from builder.stages.scenarios.graph_method import answer_facts
from tests.test_scenario_template import no_model
from tests.test_scenarios_graph import context, evaluated

NOW = "2025-03-12T09:00:00"
FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)

CARE = '''"""A care desk: patients, their prescriptions and the notes on them."""

from typing import Optional


class CareDesk:
    """State: patients and prescriptions."""

    def __init__(self):
        self.patients = {}
        self.prescriptions = {}

    def get_patient(self, patient_id: str) -> dict:
        """Look up one patient.

        Args:
            patient_id: The patient's id.
        """
        patient = self.patients.get(patient_id)
        if patient is None:
            return {"success": False, "error": "no such patient"}
        return {"success": True, "patient": dict(patient)}

    def list_prescriptions(self, patient_id: str, status: Optional[str] = None) -> dict:
        """List a patient's prescriptions, optionally with one status.

        Args:
            patient_id: The patient's id.
            status: active, paused or stopped.
        """
        if patient_id not in self.patients:
            return {"success": False, "error": "no such patient"}
        found = [dict(p) for p in self.prescriptions.values()
                 if p["patient_id"] == patient_id and (status is None or p["status"] == status)]
        return {"success": True, "prescriptions": found}

    def register_patient(self, name: str, date_of_birth: str) -> dict:
        """Register a new patient.

        Args:
            name: Full name.
            date_of_birth: YYYY-MM-DD.
        """
        patient_id = f"P-{len(self.patients) + 1}"
        self.patients[patient_id] = {"patient_id": patient_id, "name": name, "date_of_birth": date_of_birth,
                                     "email": ""}
        return {"success": True, "patient_id": patient_id}

    def update_contact(self, patient_id: str, email: Optional[str] = None) -> dict:
        """Change a patient's email.

        Args:
            patient_id: The patient's id.
            email: The new email.
        """
        patient = self.patients.get(patient_id)
        if patient is None:
            return {"success": False, "error": "no such patient"}
        if email is not None:
            patient["email"] = email
        return {"success": True}

    def set_prescription_status(self, prescription_id: str, status: str) -> dict:
        """Pause, resume or stop a prescription.

        Args:
            prescription_id: The prescription's id.
            status: active, paused or stopped.
        """
        prescription = self.prescriptions.get(prescription_id)
        if prescription is None or status not in ("active", "paused", "stopped"):
            return {"success": False, "error": "no such prescription or status"}
        prescription["status"] = status
        return {"success": True}

    def annotate_prescription(self, prescription_id: str, note: str) -> dict:
        """Set the note on a prescription.

        Args:
            prescription_id: The prescription's id.
            note: The note.
        """
        prescription = self.prescriptions.get(prescription_id)
        if prescription is None:
            return {"success": False, "error": "no such prescription"}
        prescription["note"] = note
        return {"success": True}
'''


def care_state():
    patients = {
        f"P-{i}": {"patient_id": f"P-{i}", "name": name, "date_of_birth": born, "email": f"p{i}@example.com"}
        for i, (name, born) in enumerate([("Margaret Olsen", "1954-07-22"), ("Daniel Okafor", "1988-02-14"),
                                          ("Ines Duarte", "1971-11-02")], 1)
    }  # fmt: skip
    drugs = ["Lisinopril 10 mg", "Metformin 500 mg", "Montelukast 10 mg", "Levothyroxine 50 mcg", "Atorvastatin"]
    prescriptions = {
        f"RX-{i}": {"prescription_id": f"RX-{i}", "patient_id": f"P-{1 + i % 3}", "drug_name": drugs[i - 1],
                    "status": "active" if i % 2 else "paused", "note": "take with food" if i < 3 else "",
                    "start_date": f"2025-0{i}-0{i}"}
        for i in range(1, 6)
    }  # fmt: skip
    return {"patients": patients, "prescriptions": prescriptions}


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def call(name, arguments, result, changed=False, sources=None):
    return ChainCall(name=name, arguments=arguments, sources=sources or {}, result=result, changed=changed)


# ------------------------------------------------------------------------------------------ values


def test_free_text_is_prose_by_its_name_never_an_identifier():
    assert is_free_text("reason") and is_free_text("denial_reason") and is_free_text("note")
    assert not any(map(is_free_text, ("name", "email", "customer", "claim_id", "status", "query", "reason_code")))


def test_a_write_leaves_out_what_the_record_has_and_is_refused_when_nothing_is_left():
    state = care_state()
    patient = state["patients"]["P-1"]
    written = targets(state, {"patient_id": "P-1"}, "patients")
    assert written == [patient] and targets(state, {"patient_id": "P-1"}, None) == []
    same = {"patient_id": "P-1", "email": "p1@example.com"}
    assert without_noop(same, state, written, required={"patient_id"}) is None  # re-saving the email on file
    assert without_noop(same, state, written, required={"patient_id", "email"}) is None
    new = {"patient_id": "P-1", "email": "new@example.com", "name": "Margaret Olsen"}
    assert without_noop(new, state, written, required={"patient_id"}) == {"patient_id": "P-1",
                                                                          "email": "new@example.com"}  # fmt: skip
    assert field_of({"accepting_new_patients": True}, "accepting") == "accepting_new_patients"
    assert field_of({"status": "a"}, "new_status") == "status"
    assert field_of({"email_work": "a", "email_home": "b"}, "email") is None  # ambiguous: two fields fit


def test_free_text_takes_only_the_written_records_own_text():
    state = care_state()
    rx = targets(state, {"prescription_id": "RX-1"}, "prescriptions")
    assert free_text_values("note", state, rx) == ["take with food"]
    assert free_text_values("note", state, targets(state, {"prescription_id": "RX-4"}, "prescriptions")) == []
    state["prescriptions"]["RX-1"]["note"] = "RX-2"  # an id is never free text
    assert free_text_values("note", state, rx) == []


def test_duplicates_and_empty_reads():
    state = care_state()
    assert duplicate_values("patients", "name", state) == {"Margaret Olsen", "Daniel Okafor", "Ines Duarte"}
    assert duplicate_values("patients", "date_of_birth", state) == set()  # not identifying alone
    after = json.loads(json.dumps(state))
    after["patients"]["P-4"] = {"patient_id": "P-4", "name": "Daniel Okafor", "date_of_birth": "1983-03-12"}
    assert duplicates(state, after) == ["patients/P-4 (name='Daniel Okafor')"]
    after["patients"]["P-4"]["name"] = "Ruth Abara"
    assert duplicates(state, after) == []
    assert is_empty([]) and is_empty({"success": True, "results": [], "count": 0}) and is_empty({"found": False})
    assert not is_empty({"success": True, "balance": 0}) and not is_empty({"success": True})
    assert not is_empty({"success": True, "results": [{"id": "x"}]})


def test_answer_facts_are_distinctive_values_of_the_reads_nobody_takes():
    initial = care_state()
    listed = {"success": True, "prescriptions": [initial["prescriptions"]["RX-3"], initial["prescriptions"]["RX-5"]]}
    calls = [
        call("get_patient", {"patient_id": "P-1"}, {"success": True, "patient": initial["patients"]["P-1"]}),
        call(
            "set_prescription_status",
            {"prescription_id": "RX-3", "status": "paused"},
            {"success": True},
            changed=True,
            sources={"prescription_id": "state"},
        ),  # fmt: skip
        call("list_prescriptions", {"patient_id": "P-1"}, listed),
    ]
    final = json.loads(json.dumps(initial))
    final["prescriptions"]["RX-3"]["status"] = "paused"
    assert reported(calls) == [0, 2]
    # the patient's name first, no id the user gave, no lower-case word; a list gives its first and last item
    assert read_facts(calls[0], calls, initial, final) == ["Margaret Olsen", "1954-07-22"]
    assert read_facts(calls[2], calls, initial, final) == ["Montelukast 10 mg", "Atorvastatin"]
    fed = [calls[0], call("annotate_prescription", {"prescription_id": "RX-1", "note": "x"}, {"success": True},
                          changed=True, sources={"prescription_id": "result 1 patient.patient_id"})]  # fmt: skip
    assert reported(fed) == []  # a look-up a later call takes: the user does not ask about it
    kept = without([calls[0], calls[2], fed[1].model_copy(update={"sources": {"prescription_id": "result 3 x"}})], [0])
    assert [c.name for c in kept] == ["list_prescriptions", "annotate_prescription"]
    assert kept[1].sources == {"prescription_id": "result 2 x"}  # renumbered after the dropped read


def test_answer_facts_the_users_words_state_are_not_graded():
    texts = {"non_conversational": "Tell me about Margaret Olsen's prescriptions, and pause RX-3 (10 mg)."}
    assert answer_facts(("Margaret Olsen", "Atorvastatin", "10"), texts) == ("Atorvastatin", "10")


# ------------------------------------------------------------------------------------------ the sampler


def test_sampled_chains_make_no_noop_write_no_duplicate_and_no_borrowed_text(sandbox):
    state = care_state()
    graph = extract_graph(sandbox, CARE, state, now=NOW)
    writers = set(graph.writers())
    assert {"register_patient", "annotate_prescription", "update_contact"} <= writers
    sampled = sample_chains(sandbox, CARE, graph, state, 8, seed=4, min_calls=2, now=NOW, attempts=120)
    assert sampled.chains
    names = {p["name"] for p in state["patients"].values()}
    for chain in sampled.chains:
        for step in chain.calls:
            assert step.changed == (step.name in writers)  # every write changed something, no read did
            assert not is_empty(step.result)
            if step.name == "register_patient":
                assert step.arguments["name"] not in names
            # its only fitting note is the prescription's own, which changes nothing: never a borrowed text or an id
            assert step.name != "annotate_prescription"
            if step.name == "update_contact":
                assert "email" not in step.arguments or step.arguments["email"] not in {
                    p["email"] for p in state["patients"].values()}  # fmt: skip
        said = {json.dumps(v) for step in chain.calls for v in leaves(step.arguments)}
        for fact in chain.facts:
            assert json.dumps(fact) not in said
            assert any(states(json.dumps(step.result), fact) for step in chain.calls if not step.changed)
    assert {"free_text_unfit", "duplicate_record", "noop_write"} <= set(sampled.dropped) <= {
        *STEP_REASONS, "call_failed", "no_value", "no_state_change", "too_short", "duplicate", "incoherent",
        "nondeterministic"}  # fmt: skip


async def test_graph_scenarios_grade_the_answer_to_what_the_user_asks(tmp_path, sandbox):
    interface = inspect_source(CARE)
    env = Environment(
        provenance={"config_hash": "hash"}, plan_id="plan-care", name="care_desk", class_name=interface.class_name,
        description="A care desk.", domain="health", code=CARE, tools=list(interface.tools), state_schema={},
        status="accepted",
    )  # fmt: skip
    ctx = context(tmp_path, no_model(), sandbox, "scenarios.per_environment=4", 'scenarios.wording="template"')
    results = await scenarios(evaluated(env, [(care_state(), NOW)]), ctx)
    made = [r for r in results if isinstance(r, Scenario)]
    assert len(made) >= 6 and all(r.verification.verified for r in made)
    asked = [r for r in made if r.answer_facts]
    assert asked  # some task asks to be told what a read returns, and its answer is graded
    for record in asked:
        assert "tell me what you find when you" in record.task
        for fact in record.answer_facts:
            assert not states(record.task, fact)
            assert any(states(result.result, fact) for result in record.verification.gold)


def test_the_template_asks_for_a_reported_read_in_the_imperative():
    from builder.stages.scenarios.template import _imperative

    assert _imperative("Lists a provider's unbooked slots") == "List a provider's unbooked slots"
    assert _imperative("searches the catalog") == "search the catalog"
    assert _imperative("get one patient") == "get one patient" and _imperative("process a refund") == "process a refund"


def test_the_wording_prompt_marks_the_reads_the_user_asks_about():
    from builder.stages.scenarios.chain import Chain
    from builder.stages.scenarios.verbalise import request_text
    from builder.views.budget import prompt_budgets

    state = care_state()
    interface = inspect_source(CARE)
    env = Environment(
        provenance={"config_hash": "hash"}, plan_id="plan-care", name="care_desk", class_name=interface.class_name,
        description="A care desk.", domain="health", code=CARE, tools=list(interface.tools), state_schema={},
        status="accepted",
    )  # fmt: skip
    final = json.loads(json.dumps(state))
    final["prescriptions"]["RX-1"]["status"] = "stopped"
    patient = {"success": True, "patient": state["patients"]["P-2"]}
    calls = (
        call("get_patient", {"patient_id": "P-2"}, patient),  # no later call takes it: reported
        call(
            "list_prescriptions",
            {"patient_id": "P-2"},
            {"success": True, "prescriptions": [state["prescriptions"]["RX-1"]]},
        ),  # fmt: skip
        call(
            "set_prescription_status",
            {"prescription_id": "RX-1", "status": "stopped"},
            {"success": True},
            changed=True,
            sources={"prescription_id": "result 2 prescriptions[].prescription_id"},
        ),  # fmt: skip
    )
    chain = Chain(calls=calls, initial_state=state, final_state=final, facts=("Daniel Okafor", "1988-02-14"))
    text = request_text(env, chain, [], NOW, [], prompt_budgets(20000)[0])
    marked = [line for line in text.splitlines() if "the user asks to be told this result" in line]
    assert len(marked) == 1 and "Daniel Okafor, 1988-02-14" in marked[0]  # the patient read, not the look-up


def test_a_write_that_takes_back_an_earlier_step_is_found():
    initial = {"slots": {"S1": {"booked": False}}, "appointments": {}}
    booked = {"slots": {"S1": {"booked": True}}, "appointments": {"A1": {"slot": "S1", "status": "scheduled"}}}
    cancelled = {"slots": {"S1": {"booked": False}}, "appointments": {"A1": {"slot": "S1", "status": "cancelled"}}}
    assert undone(initial, booked, cancelled) == ["slots.S1.booked"]
    # moving on (a status that was never the initial one) or a first change is no undoing
    completed = {"slots": {"S1": {"booked": True}}, "appointments": {"A1": {"slot": "S1", "status": "completed"}}}
    assert undone(initial, booked, completed) == [] and undone(initial, initial, booked) == []


def test_a_chain_naming_two_people_acts_for_two_users():
    from builder.stages.scenarios.anchors import people_named, world_of

    world = world_of({
        "donors": {"D-1": {"donor_id": "D-1", "name": "Tomasz"}, "D-2": {"donor_id": "D-2", "name": "Lucas"}},
        "time_slots": {"S-1": {"slot_id": "S-1", "center": "Leeds"}},
        "accounts": {"A-1": {"owner": "D-1"}, "A-2": {"owner": "D-1"}},
    })  # fmt: skip
    assert people_named(world, ["D-1", "S-1"]) == {("donors", "D-1")}
    assert len(people_named(world, ["D-1", "D-2", "S-1"])) == 2  # a donor booking for his nephew
    assert people_named(world, ["A-1", "A-2"]) == set()  # one user's two accounts
