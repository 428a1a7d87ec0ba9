"""Gold sequences that use what an earlier call creates: references (`"$2.loan.loan_id"`) resolved as the gold
runs, in the real sandbox over the lending fixture (a loan's id exists only once `borrow` made it)."""

import json

import pytest

from builder.records import Action, Scenario
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.references import Earlier, parse, resolve
from builder.stages.scenarios.sufficiency import unsupported_arguments
from builder.stages.scenarios.verify import verify
from builder.tables import to_row
from tests.test_stage_scenarios import FAST, NOW, context, environment, requests_of, scripted


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


STATE = {
    "books": {"b1": {"title": "Dune", "author": "Frank Herbert", "copies": 2},
              "b2": {"title": "Emma", "author": "Jane Austen", "copies": 1},
              "b3": {"title": "Ulysses", "author": "James Joyce", "copies": 1}},
    "members": {"m1": {"name": "Sam Reed", "max_loans": 3}, "m2": {"name": "Ada Park", "max_loans": 2},
                "m3": {"name": "Lee Chan", "max_loans": 2}},
    "loans": {f"L{n}": {"member_id": f"m{n - 99}", "book_id": "b2", "due": "2024-03-20", "returned": True}
              for n in (100, 101, 102)},
    "next_loan": 103,  # the next loan is L103: nothing in the task or the state says so
    "today": "2024-03-14",
}  # fmt: skip
OPEN = "Has member m1 an open loan of book b1?"
DUE = "Is that loan due on 2024-04-04 (14 days plus a 7-day renewal)?"
TASK = {
    "task": "I'm Sam Reed, member m1. Lend me a copy of Dune, then renew that loan by 7 days right away.",
    "difficulty": "medium",
    "user_profile": "Sam, a regular who writes short messages.",
    "known_up_front": "Wants to borrow Dune and renew the loan by 7 days at once.",
    "reveal_when_asked": "Member id m1.",
    "ending": "Stops once the renewal is confirmed.",
    "checklist": [OPEN, DUE],
}
NEW_LOANS = "    new = [l for k, l in final_state['loans'].items() if k not in initial_state['loans']]\n"
CHECKS = {
    OPEN: "def check(initial_state, final_state):\n"
    + NEW_LOANS
    + "    return any(l['member_id'] == 'm1' and l['book_id'] == 'b1' and not l['returned'] for l in new)\n",
    DUE: "def check(initial_state, final_state):\n"
    + NEW_LOANS
    + "    return any(l['book_id'] == 'b1' and l['due'] == '2024-04-04' for l in new)\n",
}


def gold(book: str = "$1[0].book_id", loan: str = "$2.loan.loan_id") -> list[dict]:
    """The capable model's reply: look the book up, borrow it, renew the loan borrow made."""
    return [
        {"name": "search_books", "arguments": {"query": "Dune"}},
        {"name": "borrow", "arguments": {"member_id": "m1", "book_id": book}},
        {"name": "renew", "arguments": {"loan_id": loan, "days": 7}},
    ]


def lending(tmp_path, sandbox, golds, *overrides):
    model = scripted(state={"now": NOW, "state": STATE}, task=TASK, checks=CHECKS, gold=golds)
    return model, scenarios(environment("lending"), context(tmp_path, model, sandbox, *overrides))


async def test_gold_with_references_verifies_and_stores_the_resolved_values(tmp_path, sandbox):
    model, running = lending(tmp_path, sandbox, [gold()])
    plain, talk = await running
    assert isinstance(plain, Scenario) and plain.verification.repairs == ()
    concrete = [
        Action(name="search_books", arguments={"query": "Dune"}),
        Action(name="borrow", arguments={"member_id": "m1", "book_id": "b1"}),
        Action(name="renew", arguments={"loan_id": "L103", "days": 7}),
    ]
    assert list(plain.gold_actions) == concrete and list(talk.gold_actions) == concrete
    assert "$" not in to_row(plain)["gold_actions"]  # what rollouts, exports and trainers read
    evidence = plain.verification
    # The two checks, then the collateral guard (holding on both by construction).
    assert evidence.checks_on_final == (True, True, True) and evidence.checks_on_initial == (False, False, True)
    # Without borrow the replayed (concrete) renew finds no loan L103; without renew the loan is due too early.
    assert [(a.name, a.failing_checks) for a in evidence.negative_control] == [("borrow", (0, 1)), ("renew", (1,))]
    # The request told the model how to refer to an earlier result.
    system = requests_of(model, "GoldSolution")[0].messages[0].content
    assert '"$2.loan.loan_id"' in system and "$N.path" in system


async def test_bad_references_are_refused_with_feedback_and_repaired(tmp_path, sandbox):
    later = gold(loan="$3.loan.loan_id")  # the renew call itself
    missing = gold(loan="$2.loan_id")  # the id is under "loan"
    model, running = lending(tmp_path, sandbox, [later, missing, gold()])
    plain, _ = await running
    assert plain.verification.repairs == ("gold_call_failed", "gold_call_failed")
    assert plain.gold_actions[2].arguments == {"loan_id": "L103", "days": 7}
    first, second, third = (r.messages[-1].content for r in requests_of(model, "GoldSolution"))
    assert "refused (gold_call_failed)" in second
    assert "call 3 renew: loan_id = '$3.loan.loan_id' refers to call 3, which does not come before call 3" in second
    assert "call 3 renew: loan_id = '$2.loan_id' names a path call 2 (borrow) did not return" in third
    assert "has no key 'loan_id'" in third and '"loan": {"loan_id": "L103"' in third  # what it did return
    # The repair shows the model its own sequence, references as written.
    assert "$3.loan.loan_id" in requests_of(model, "GoldSolution")[1].messages[-2].content


async def test_a_reference_to_a_failed_call_is_refused_with_that_failure(tmp_path, sandbox):
    model, running = lending(tmp_path, sandbox, [gold(book="b9")], "scenarios.repair_attempts=0")
    (rejection,) = await running
    assert rejection.reason == "gold_call_failed"
    assert 'call 2 borrow({"member_id": "m1", "book_id": "b9"}) -> {"success": false' in rejection.detail
    assert "call 3 renew: loan_id = '$2.loan.loan_id' refers to call 2 (borrow), which failed" in rejection.detail
    assert json.loads(rejection.raw_output)["gold"][2]["arguments"]["loan_id"] == "$2.loan.loan_id"


async def test_the_literal_form_still_works(tmp_path, sandbox):
    model, running = lending(tmp_path, sandbox, [gold(book="b1", loan="L103")])
    plain, _ = await running
    assert plain.verification.repairs == () and plain.gold_actions[2].arguments["loan_id"] == "L103"


def test_a_wrong_guess_of_a_created_id_fails_the_gold(sandbox):
    env = environment("lending")
    actions = [Action(**call) for call in gold(loan="L4")]  # guessed from the pattern of the state's ids
    evidence = verify(sandbox, env.code, STATE, actions, list(CHECKS.values()), now=NOW)
    assert evidence.reason == "gold_call_failed" and "no such open loan" in evidence.detail


def test_reference_syntax_and_its_variants():
    assert parse("$2.loan.loan_id").path == ("loan", "loan_id") and parse("$2.loan.loan_id").call == 2
    same = ["${2.loan.loan_id}", "$2['loan'][\"loan_id\"]", " $2.loan.loan_id ", "$2.loan['loan_id']"]
    assert {parse(text).path for text in same} == {("loan", "loan_id")}
    assert parse("$1[0].book_id").path == (0, "book_id") and parse("$1.0.book_id").path == (0, "book_id")
    assert parse("$1[-1].book_id").path == (-1, "book_id") and parse("$2['loan id']").path == ("loan id",)
    # Literals: money, a bare call number, other text, non-strings.
    for literal in ["$5.00", "$3.50", "$12", "$1[0]", "$", "L103", "2.loan_id", "$x.loan", 7, None, ["$1"]]:
        assert parse(literal) is None, literal


BORROWED = Earlier(name="borrow", ok=True, result={"success": True, "loan": {"loan_id": "L103", "days": 14}})
FOUND = Earlier(name="search_books", ok=True, result=[{"book_id": "b1"}, {"book_id": "b7"}])


def test_resolution_follows_keys_and_indices_and_keeps_json_types():
    arguments = {
        "loan_id": "$2.loan.loan_id", "days": "$2.result.loan.days", "books": ["$1[-1].book_id", "b2"],
        "filter": {"book": "$1.0.book_id"}, "note": "$5.00 fee", "ok": "$2.success",
    }  # fmt: skip
    resolved, problems = resolve(arguments, [FOUND, BORROWED], 3)
    assert problems == []
    assert resolved == {
        "loan_id": "L103", "days": 14, "books": ["b7", "b2"], "filter": {"book": "b1"}, "note": "$5.00 fee",
        "ok": True,
    }  # fmt: skip
    assert resolve({"loan": "$2.loan"}, [FOUND, BORROWED], 3)[0] == {"loan": {"loan_id": "L103", "days": 14}}


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("$0.loan.loan_id", "refers to call 0, which does not come before call 3"),
        ("$4.loan.loan_id", "refers to call 4, which does not come before call 3"),
        ("$2.loan.id", "names a path call 2 (borrow) did not return: its result.loan has no key 'id'"),
        ("$1[2].book_id", "its result itself has no item 2"),
        ("$2.loan[0]", "its result.loan has no item 0"),
        ("$2.success.loan_id", "its result.success has no key 'loan_id'"),
        ("renew $2.loan.loan_id", 'a reference must be the whole argument value ("$2.loan.loan_id" alone)'),
    ],
)
def test_unresolvable_references_say_why(value, problem):
    _, problems = resolve({"loan_id": value}, [FOUND, BORROWED], 3)
    assert len(problems) == 1 and problem in problems[0] and problems[0].startswith(f"loan_id = {value!r}")


def test_a_reference_to_a_failed_call_says_it_failed():
    failed = Earlier(name="borrow", ok=False, result={"success": False, "error": "no copy available"})
    _, problems = resolve({"loan_id": "$2.loan.loan_id"}, [FOUND, failed], 3)
    assert problems == ["loan_id = '$2.loan.loan_id' refers to call 2 (borrow), which failed, so it returned nothing "
                        "to use"]  # fmt: skip


def test_sufficiency_takes_references_as_grounded():
    tools = environment("lending").tools
    results = [[{"book_id": "b1"}], {"success": True, "loan": {"loan_id": "L103"}}, {"success": True}]
    actions = [Action(**call) for call in gold()]
    assert unsupported_arguments(actions, results, TASK["task"], tools) == []
    # A literal the user never says and no earlier call returned is still refused.
    guessed = [Action(**call) for call in gold(loan="L4")]
    assert unsupported_arguments(guessed, results, TASK["task"], tools) == ["call 3 renew: loan_id = 'L4'"]
