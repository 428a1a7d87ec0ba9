"""Rule probes and consistency gates of the evaluate stage, with a scripted model over fixture environments and a
real sandbox: a rule the code ignores goes back to the code stage with the probe's call, a wrong probe does not
reject, malformed probe replies are bounded and counted, and inconsistent records are refused."""

import json

import polars as pl
import pytest

from builder.config import load_config
from builder.llm import ChatRequest, ScriptedModel
from builder.llm.connect import client_for
from builder.records import Environment, EnvPlan, Rejection, Topic
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, ItemStage
from builder.sandbox.runtime import Sandbox
from builder.stages.code import code
from builder.stages.evaluate import evaluate
from builder.stages.evaluate.consistency import id_problem
from builder.stages.evaluate.probe_reply import ProbeDraft
from builder.stages.evaluate.probes import numbered_rules
from builder.stages.plan import plan
from builder.tables import from_frame
from tests.fixtures.run_tables import pipeline_stage
from tests.test_stage_evaluate import (
    FAST,
    LIBRARY_ARGS,
    LIBRARY_STATE,
    PASS,
    SYNTHESIS,
    calls,
    context,
    environment,
    kind,
    rejection,
    verdicts,
)

FAIL = {"analysis": "the call breaks the rule and was accepted", "verdict": "fail", "reason": "rule not enforced"}
CONFIRMING = "The tester wrote this call to break rule"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def probe(rule, tool, arguments, state=1, change=None, why="breaks it"):
    return {
        "rule": rule,
        "why": why,
        "state": state,
        "state_change": change or {},
        "tool": tool,
        "arguments": arguments,
    }


def valid(tool, arguments, state=1):
    return {"state": state, "tool": tool, "arguments": arguments}


# ------------------------------------------------------------------------------------ library: plan -> code


LIBRARY_PROBES = {
    "probes": [
        probe(1, "borrow_book", {"member_id": "m1", "book_id": "b1", "due": "2099-07-01"},
              change={"members": {"m1": {"member_id": "m1", "name": "Sam Vimes", "max_loans": 1}}},
              why="m1 already has one open loan (L1) and a limit of 1"),
        probe(2, "borrow_book", {"member_id": "m1", "book_id": "b2", "due": "2099-07-01"},
              why="b2 has 0 copies on the shelf"),
        probe(3, "return_book", {"loan_id": "L1"},
              change={"loans": {"L1": {"loan_id": "L1", "member_id": "m1", "book_id": "b1", "due": "2024-06-01",
                                       "returned": True}}},
              why="L1 is already returned"),
    ],
    "unprobed": [],
    "valid_calls": [valid("borrow_book", {"member_id": "m1", "book_id": "b1", "due": "2099-07-01"}),
                    valid("return_book", {"loan_id": "L1"})],
}  # fmt: skip


def library_chain(tmp_path, sandbox, *overrides, borrow="borrow_book_ignores_copies", repaired=None, probes=None,
                  confirm=FAIL):  # fmt: skip
    """topic -> plan -> code -> evaluate on the library fixtures with `borrow` as the written borrow_book;
    `repaired(n)` answers its n-th repair request, `probes(n)` the n-th probe request."""
    pieces = {path.stem: path.read_text() for path in (SYNTHESIS / "library_code").glob("*.txt")}
    if borrow != "borrow_book":
        pieces["borrow_book"] = (SYNTHESIS / "repair" / f"{borrow}.txt").read_text()
    repairs, probe_requests = [], []

    def answer(request: ChatRequest):
        role = kind(request)
        if role == "StateDraft":
            return (SYNTHESIS / "library_state.json").read_text()
        if role == "OperationsDraft":
            return (SYNTHESIS / "library_operations.json").read_text()
        if role == "TestState":
            return json.dumps({"purpose": "one member with an open loan", "state": LIBRARY_STATE})
        if role == "ProbeDraft":
            probe_requests.append(request)
            reply = probes(len(probe_requests)) if probes else LIBRARY_PROBES
            return reply if isinstance(reply, str) else json.dumps(reply)
        if role == "tester":
            return calls(lambda tool, case, r: (tool, LIBRARY_ARGS[tool]))(request)
        if role == "checker":
            return verdicts(PASS)(request)
        if role == "CheckerVerdict":
            return json.dumps(confirm if CONFIRMING in request.messages[1].content else PASS)
        text = request.messages[1].content
        piece = next((n for n in LIBRARY_ARGS if f"Write the method {n}," in text), "__init__")
        if piece == "borrow_book" and len(request.messages) > 2:
            repairs.append(request)
            return repaired(len(repairs))
        return pieces[piece]

    topic = Topic(provenance={"config_hash": "h"}, name="library_loans", description="A lending desk.",
                  domain="library")  # fmt: skip

    async def topics(_inputs, _ctx):
        return [topic]

    stages = (
        BatchStage("topics", topics, input=None, output=Topic),
        ItemStage("plan", plan, input=Topic, output=EnvPlan),
        ItemStage("code", code, input=EnvPlan, output=Environment),
        pipeline_stage("evaluate"),
    )
    config = load_config(None, [f"store.path={tmp_path / 'store'}", "evaluate.calls=8", *overrides])
    model = ScriptedModel(answer)
    llm = client_for(config.llm, model, model_id="m")
    run = run_stages(stages, config, tmp_path / "run", llm=lambda _stats: llm, sandbox=lambda: sandbox)
    return run, repairs, probe_requests


def kept(tmp_path) -> Environment:
    (env,) = from_frame(Environment, pl.read_parquet(tmp_path / "run" / "evaluate.parquet").drop("input_id"))
    return env


def rejections(tmp_path) -> list[Rejection]:
    return from_frame(Rejection, pl.read_parquet(tmp_path / "run" / "evaluate.rejected.parquet").drop("input_id"))


async def test_an_ignored_rule_goes_back_to_code_with_the_probe_and_is_accepted_once_repaired(tmp_path, sandbox):
    fixed = (SYNTHESIS / "library_code" / "borrow_book.txt").read_text()
    run, repairs, probe_requests = library_chain(tmp_path, sandbox, repaired=lambda n: fixed)
    stats = await run
    assert stats["evaluate"].kept == 1, stats["evaluate"].dropped
    # One probe request, carrying the rules and the test state; one repair of the tool that let rule 2 be broken.
    (asked,) = probe_requests
    rule = "A book can be lent only while it has a copy on the shelf."
    assert f"2. {rule}" in asked.messages[1].content
    assert asked.messages[1].content.count(rule) == 1  # the docstring's rules are shown once, numbered (teacher-14)
    assert '"b2"' in asked.messages[1].content and "return_book" in asked.messages[1].content
    (request,) = repairs
    told = "\n".join(m.content for m in request.messages)
    assert "rule 2 (A book can be lent only while it has a copy on the shelf.) is not enforced" in told
    assert 'borrow_book({"member_id": "m1", "book_id": "b2", "due": "2099-07-01"})' in told
    assert "b2 has 0 copies on the shelf" in told and "rule_not_enforced" in told
    env = kept(tmp_path)
    assert "copies" in env.code and "no copy" in env.code  # the repaired method checks the shelf
    evidence = env.evaluation.probes
    assert evidence.probed == (1, 2, 3) and evidence.unprobed == {} and evidence.repairs == 1
    statuses = [(o.rule, o.status) for o in evidence.probes]
    assert statuses == [(1, "refused"), (2, "refused"), (3, "refused"), (None, "accepted"), (None, "accepted")]
    assert evidence.probes[0].state_change == {"members": {"m1": {"member_id": "m1", "name": "Sam Vimes",
                                                                  "max_loans": 1}}}  # fmt: skip
    (repair,) = env.synthesis.repairs
    assert "[rule_not_enforced]" in repair.problems["borrow_book"][0] and repair.to == env.id
    report = stats["evaluate"].report.to_json()
    assert report["rule_probes"] | {} == {
        "rules": 3, "probed": 3, "unprobed": 0, "no_rules": 0, "probes": 3, "refused": 3, "wrong_probes": 0,
        "unjudged": 0, "invalid": 0, "repair_rounds": 1, "repaired": 1, "rejected": 0,
    }  # fmt: skip
    assert report["probe_problems"] == {"rule_not_enforced": 1}
    # The stored evidence replays: the same call on the stored state and code is refused.
    assert json.loads(env.model_dump_json())["evaluation"]["probes"]["probes"][1]["arguments"]["book_id"] == "b2"


async def test_a_rule_still_ignored_after_the_repairs_rejects_as_rule_not_enforced(tmp_path, sandbox):
    flawed = (SYNTHESIS / "repair" / "borrow_book_ignores_copies.txt").read_text()
    run, repairs, _ = library_chain(tmp_path, sandbox, "evaluate.probe_repairs=1", repaired=lambda n: flawed)
    stats = await run
    assert dict(stats["evaluate"].dropped) == {"rule_not_enforced": 1}
    (rejected,) = rejections(tmp_path)
    assert rejected.detail.startswith("rule_not_enforced after 1 repair(s): [rule_not_enforced] rule 2")
    assert '"book_id": "b2"' in rejected.detail
    evidence = json.loads(rejected.raw_output)
    assert [o["status"] for o in evidence["probes"] if o["rule"] == 2] == ["confirmed"]
    assert len(repairs) == 1
    assert stats["evaluate"].report.to_json()["rule_probes"]["rejected"] == 1


async def test_without_probe_repairs_an_ignored_rule_rejects_at_once(tmp_path, sandbox):
    run, repairs, _ = library_chain(tmp_path, sandbox, "evaluate.probe_repairs=0", repaired=lambda n: "unused")
    stats = await run
    assert dict(stats["evaluate"].dropped) == {"rule_not_enforced": 1} and repairs == []


async def test_a_wrong_probe_the_checker_does_not_confirm_does_not_reject(tmp_path, sandbox):
    # The good borrow_book; the probe of rule 2 wrongly picks b1, which has copies: it is accepted, rightly.
    wrong = {**LIBRARY_PROBES, "probes": [
        probe(2, "borrow_book", {"member_id": "m1", "book_id": "b1", "due": "2099-07-01"}, why="b1 has no copy"),
        *LIBRARY_PROBES["probes"][2:],
    ]}  # fmt: skip
    run, repairs, _ = library_chain(tmp_path, sandbox, borrow="borrow_book", probes=lambda n: wrong, confirm=PASS)
    stats = await run
    assert stats["evaluate"].kept == 1 and repairs == []
    evidence = kept(tmp_path).evaluation.probes
    assert [(o.rule, o.status) for o in evidence.probes if o.rule] == [(2, "wrong_probe"), (3, "refused")]
    assert evidence.probes[0].reason == "correct"  # the checker's reason is kept
    assert evidence.unprobed == {"1": "no usable probe was written"}  # visible, not skipped silently
    report = stats["evaluate"].report.to_json()["rule_probes"]
    assert (report["wrong_probes"], report["unprobed"], report["refused"]) == (1, 1, 1)


async def test_malformed_probe_replies_are_re_asked_dropped_and_counted(tmp_path, sandbox):
    """Bad JSON is re-asked; in the usable reply an unknown tool, arguments off the schema and a state that does
    not exist are dropped and counted; the rest run."""
    mixed = {**LIBRARY_PROBES, "probes": [
        probe(1, "lend_book", {"member_id": "m1", "book_id": "b1"}),
        probe(2, "borrow_book", {"member_id": "m1", "book": "b2"}),
        probe(2, "borrow_book", {"member_id": "m1", "book_id": "b2", "due": "2099-07-01"}, state=7),
        *LIBRARY_PROBES["probes"][2:],
    ]}  # fmt: skip
    replies = ['{"probes": [{"rule": 1, "tool": "borrow_book"', mixed]
    run, _, probe_requests = library_chain(tmp_path, sandbox, borrow="borrow_book", probes=lambda n: replies[n - 1])
    stats = await run
    assert stats["evaluate"].kept == 1 and len(probe_requests) == 2
    assert "cannot be used" in probe_requests[1].messages[-1].content  # the error fed back
    evidence = kept(tmp_path).evaluation.probes
    assert len(evidence.invalid) == 3
    assert "unknown tool 'lend_book'" in evidence.invalid[0] and "state 7 does not exist" in evidence.invalid[2]
    assert evidence.probed == (3,) and set(evidence.unprobed) == {"1", "2"}
    assert stats["evaluate"].report.to_json()["rule_probes"]["invalid"] == 3


async def test_a_probe_reply_that_stays_unusable_leaves_every_rule_unprobed_and_the_check_goes_on(tmp_path, sandbox):
    run, _, probe_requests = library_chain(tmp_path, sandbox, borrow="borrow_book", probes=lambda n: "not json")
    stats = await run
    assert stats["evaluate"].kept == 1
    evidence = kept(tmp_path).evaluation.probes
    assert evidence.probes == () and evidence.unprobed.keys() == {"1", "2", "3"}
    assert evidence.invalid[0].startswith("probe_invalid")
    assert len(probe_requests) == 1 + load_config(None, []).llm.structured_retries  # bounded re-asks
    report = stats["evaluate"].report.to_json()["rule_probes"]
    assert (report["unprobed"], report["invalid"]) == (3, 1)


async def test_probes_off_asks_nothing(tmp_path, sandbox):
    run, _, probe_requests = library_chain(tmp_path, sandbox, "evaluate.probes=false")
    stats = await run
    assert stats["evaluate"].kept == 1 and probe_requests == []  # the ignored rule goes unnoticed: the knob's cost
    assert kept(tmp_path).evaluation.probes is None


# ---------------------------------------------------------------------------------- desks: consistency gates


DESK_STATE = {
    "desks": {
        "D-101": {"desk_id": "D-101", "floor": 1, "in_service": True},
        "D-102": {"desk_id": "D-102", "floor": 1, "in_service": False},
        "D-207": {"desk_id": "D-207", "floor": 2, "in_service": True},
    },
    "bookings": {
        "B-1": {"booking_id": "B-1", "desk_id": "D-101", "date": "2025-03-12", "note": "near the window"},
        "B-2": {"booking_id": "B-2", "desk_id": "D-207", "date": "2025-03-12", "note": ""},
    },
}
DESK_PROBES = {
    "probes": [
        probe(1, "book_desk", {"desk_id": "D-102", "date": "2025-03-13"}, why="D-102 is out of service"),
        probe(2, "book_desk", {"desk_id": "D-101", "date": "2025-03-12"}, why="B-1 already holds D-101 that day"),
    ],
    "unprobed": [],
    "valid_calls": [
        valid("book_desk", {"desk_id": "D-207", "date": "2025-03-14"}),
        valid("clear_note", {"booking_id": "B-1"}),
        valid("add_desk", {"floor": 3}),
    ],
}
DESK_ARGS = {"book_desk": {"desk_id": "D-207", "date": "2025-03-14"}, "clear_note": {"booking_id": "B-1"},
             "add_desk": {"floor": 3}}  # fmt: skip


def desk_model(probes=DESK_PROBES) -> ScriptedModel:
    def answer(request: ChatRequest):
        role = kind(request)
        if role == "TestState":
            return json.dumps({"purpose": "three desks, two bookings", "state": DESK_STATE})
        if role == "ProbeDraft":
            return json.dumps(probes)
        if role == "tester":
            return calls(lambda tool, case, r: (tool, DESK_ARGS[tool]))(request)
        if role == "checker":
            return verdicts(PASS)(request)
        return json.dumps(FAIL if CONFIRMING in request.messages[1].content else PASS)

    return ScriptedModel(answer)


def desks(flaw: str = "", fixed: str = "") -> Environment:
    code = (SYNTHESIS.parent / "envs" / "desks.py").read_text()
    assert not flaw or flaw in code
    return environment("desks", code.replace(flaw, fixed) if flaw else code)


async def test_a_consistent_environment_with_enforced_rules_is_accepted(tmp_path, sandbox):
    (accepted,) = await evaluate(desks(), context(tmp_path, desk_model(), sandbox))
    evidence = accepted.evaluation.probes
    assert [o.status for o in evidence.probes] == ["refused", "refused", "accepted", "accepted", "accepted"]
    assert numbered_rules(accepted.code) == [
        "A desk can be booked only while it is in service.", "A desk holds at most one booking per date."
    ]  # fmt: skip


async def test_none_written_where_another_tool_writes_empty_text_is_refused(tmp_path, sandbox):
    env = desks('booking["note"] = ""', 'booking["note"] = None')
    ctx = context(tmp_path, desk_model(), sandbox)
    rejected = await rejection(env, ctx)
    assert rejected.reason == "inconsistent_state" and rejected.subject_id == env.id
    assert rejected.detail.startswith("[empty_value_mixed] it writes None for an empty `note` of a bookings record")
    assert '(book_desk) write ""' in rejected.detail
    assert ctx.stats.report.probe_problems == {"empty_value_mixed": 1}


async def test_new_ids_unlike_the_seeded_ones_are_refused(tmp_path, sandbox):
    env = desks('desk_id = f"D-{max(numbers, default=100) + 1}"', 'desk_id = f"D{len(self.desks) + 1}"')
    rejected = await rejection(env, context(tmp_path, desk_model(), sandbox))
    assert rejected.reason == "inconsistent_state"
    assert "[id_format] add_desk({\"floor\": 3}) created the desks record 'D4'" in rejected.detail
    assert "D-101, D-102, D-207" in rejected.detail


async def test_an_unenforced_rule_without_a_repair_rejects_with_the_call(tmp_path, sandbox):
    env = desks('        if not desk["in_service"]:\n', "        if False:\n")
    rejected = await rejection(env, context(tmp_path, desk_model(), sandbox))
    assert rejected.reason == "rule_not_enforced"
    assert 'book_desk({"desk_id": "D-102", "date": "2025-03-13"})' in rejected.detail
    assert "D-102 is out of service" in rejected.detail


def test_the_id_format_rule_needs_two_seeded_ids_of_one_format():
    seeded = {"D-101": {}, "D-102": {}}
    assert id_problem("desks", "D-103", seeded) is None
    assert "D-101, D-102" in id_problem("desks", "D7", seeded)
    assert id_problem("desks", "D7", {"D-101": {}}) is None  # one id shows no format
    assert id_problem("desks", "D7", {"D-101": {}, "X1": {}}) is None  # no single format to keep
    assert id_problem("loans", "L9", [{"loan_id": "L-1"}, {"loan_id": "L-2"}]) is not None  # a list of records


def test_the_probe_reply_schema_is_strict_json():
    from builder.llm.parsing import response_format

    schema = response_format(ProbeDraft)["json_schema"]["schema"]
    assert schema["additionalProperties"] is False and set(schema["required"]) == {"probes", "unprobed", "valid_calls"}


async def test_the_state_schema_sets_the_empty_value_when_one_tool_alone_writes_it(tmp_path, sandbox):
    """Only clear_note writes an empty note (None), and the declared schema says a note is text: refused."""
    note = {"type": "string", "description": "free text, empty for none"}
    bookings = {"type": "object", "additionalProperties": {"type": "object", "properties": {"note": note}}}
    env = desks('booking["note"] = ""', 'booking["note"] = None').model_copy(
        update={"state_schema": {"properties": {"bookings": bookings}}}
    )
    alone = {**DESK_PROBES, "valid_calls": [valid("clear_note", {"booking_id": "B-1"})]}
    rejected = await rejection(env, context(tmp_path, desk_model(alone), sandbox))
    assert rejected.reason == "inconsistent_state"
    assert "it writes None for an empty `note` of a bookings record, but the state schema says" in rejected.detail
