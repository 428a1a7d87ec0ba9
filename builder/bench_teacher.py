"""The scripted model of `bench pipeline` (builder/bench_pipeline.py): an answer to every request the pipeline
makes, from mining a seed to the rollout agent and its user, for N lending desks.

A seed names its desk by number ("lending desk number 17"); the miner turns it into a topic of that number, and
every topic is planned as the lending desk of builder/data/bench_lending.json under a class name of its own, so
each environment has its own code and id. The tester, checker, scenario writers, agent and user answer as
tests/fixtures/teacher.py does (the test suite's teacher, which an installed package cannot import). It is a pure
function of the request; a request it does not know is a `RunError`, never a made-up reply.
"""

from __future__ import annotations

import json
import re
from importlib import resources as package_files
from typing import Any

from builder.errors import RunError
from builder.llm import ChatRequest, Reply, tool_reply
from builder.prompts import prompt
from builder.rollout.user_sim import STOP

FIXTURE = json.loads(package_files.files("builder.data").joinpath("bench_lending.json").read_text())
PLACES = ("harbor", "valley", "market", "river", "hill", "garden", "station", "forest", "meadow", "bridge")
KINDS = ("library", "tool shed", "makerspace", "game shelf", "camera desk", "bike depot", "music room", "lab")

TEST_STATE = {
    "books": {
        "b1": {"book_id": "b1", "title": "Dune", "copies": 2},
        "b2": {"book_id": "b2", "title": "Emma", "copies": 0},
    },
    "members": {"m1": {"member_id": "m1", "name": "Sam Vimes", "max_loans": 2}},
    "loans": {"L1": {"loan_id": "L1", "member_id": "m1", "book_id": "b1", "due": "2024-06-01", "returned": False}},
}
TESTER_ARGS = {
    "positive": {
        "get_book": {"book_id": "b1"},
        "list_member_loans": {"member_id": "m1", "open_only": True},
        "borrow_book": {"member_id": "m1", "book_id": "b1", "due": "2024-07-01"},
        "return_book": {"loan_id": "L1"},
        "find_books": {"title": "dune"},
        "find_members": {"name": "Vimes"},
    },
    "negative": {
        "get_book": {"book_id": "b404"},
        "list_member_loans": {"member_id": "m404"},
        "borrow_book": {"member_id": "m404", "book_id": "b1", "due": "2024-07-01"},
        "return_book": {"loan_id": "L404"},
        "find_books": {"title": ""},
        "find_members": {"name": "  "},
    },
}
PROBES = {
    "probes": [
        {"rule": 1, "why": "m1 has one open loan (L1) and a limit lowered to 1", "state": 1,
         "state_change": {"members": {"m1": {"member_id": "m1", "name": "Sam Vimes", "max_loans": 1}}},
         "tool": "borrow_book", "arguments": {"member_id": "m1", "book_id": "b1", "due": "2024-07-01"}},
        {"rule": 2, "why": "b2 has no copy on the shelf", "state": 1, "state_change": {},
         "tool": "borrow_book", "arguments": {"member_id": "m1", "book_id": "b2", "due": "2024-07-01"}},
        {"rule": 3, "why": "L1 is returned already in the changed state", "state": 1,
         "state_change": {"loans": {"L1": {**TEST_STATE["loans"]["L1"], "returned": True}}},
         "tool": "return_book", "arguments": {"loan_id": "L1"}},
    ],
    "unprobed": [],
    "valid_calls": [
        {"state": 1, "tool": "borrow_book", "arguments": TESTER_ARGS["positive"]["borrow_book"]},
        {"state": 1, "tool": "return_book", "arguments": TESTER_ARGS["positive"]["return_book"]},
    ],
}  # fmt: skip
SCENARIO_STATE = {
    "books": {
        "b1": {"book_id": "b1", "title": "Dune", "copies": 2},
        "b2": {"book_id": "b2", "title": "Emma", "copies": 0},
        "b3": {"book_id": "b3", "title": "The Left Hand of Darkness", "copies": 1},
    },
    "members": {
        "m1": {"member_id": "m1", "name": "Sam Vimes", "max_loans": 2},
        "m2": {"member_id": "m2", "name": "Ada Palmer", "max_loans": 3},
        "m3": {"member_id": "m3", "name": "Lu Chen", "max_loans": 1},
    },
    "loans": {
        "L1": {"loan_id": "L1", "member_id": "m1", "book_id": "b1", "due": "2024-06-01", "returned": False},
        "L2": {"loan_id": "L2", "member_id": "m2", "book_id": "b2", "due": "2024-05-20", "returned": True},
        "L3": {"loan_id": "L3", "member_id": "m3", "book_id": "b1", "due": "2024-06-10", "returned": False},
    },
}
DUE = "2024-07-15"
LOANED = f"Does member m2 have an open loan of book b3 due {DUE}?"
COPY_TAKEN = "Has book b3 one copy fewer on the shelf?"
TASK = {
    "task": f"I'm Ada Palmer, member m2. Please lend me book b3, The Left Hand of Darkness, until {DUE}.",
    "difficulty": "easy",
    "user_profile": "Ada Palmer, a retired teacher who writes polite, short messages.",
    "known_up_front": "Wants to borrow a novel from the library.",
    "reveal_when_asked": f"Member id m2; the book id is b3; due date {DUE}.",
    "ending": "Says thanks and stops once the loan is confirmed.",
    "checklist": [LOANED, COPY_TAKEN],
}
CHECKS = {
    LOANED: "def check(initial_state, final_state):\n"
    "    return any(\n"
    "        loan['member_id'] == 'm2' and loan['book_id'] == 'b3' and loan['due'] == '2024-07-15'\n"
    "        and not loan['returned']\n"
    "        for loan in final_state['loans'].values()\n"
    "    )\n",
    COPY_TAKEN: "def check(initial_state, final_state):\n"
    "    return final_state['books']['b3']['copies'] == initial_state['books']['b3']['copies'] - 1\n",
}
GOLD = [
    {"name": "list_member_loans", "arguments": {"member_id": "m2", "open_only": True}},
    {"name": "get_book", "arguments": {"book_id": "b3"}},
    {"name": "borrow_book", "arguments": {"member_id": "m2", "book_id": "b3", "due": DUE}},
]
WRONG_DUE = [*GOLD[:2], {**GOLD[2], "arguments": {**GOLD[2]["arguments"], "due": "2024-07-30"}}]
VERDICT = {"analysis": "the method follows its docstring", "verdict": "pass", "reason": "correct result and state"}
SLOT = re.compile(r"^(\d+)\. `(\w+)` with a (POSITIVE|NEGATIVE) case", re.MULTILINE)
CALL = re.compile(r"^## Call (\d+)$", re.MULTILINE)
DESK = re.compile(r"lending desk number (\d+)")


def teacher(request: ChatRequest) -> Reply | str:
    """The reply to any request of the pipeline; a request it does not know is a RunError (the bench is out of
    date with a prompt)."""
    if request.tools:
        return _agent(request)
    schema = request.response_format["json_schema"]["name"] if request.response_format else ""
    if schema:
        if schema not in STRUCTURED:
            raise RunError(f"bench pipeline: the scripted model has no answer to {schema!r}")
        return json.dumps(STRUCTURED[schema](request))
    system = request_text(request, 0)
    if system in (prompt("code_state"), prompt("code_method")):
        return _code_piece(request)
    if STOP in system:
        return _user(request)
    raise RunError(f"bench pipeline: the scripted model has no answer to {request.messages[-1].content!r:.200}")


def request_text(request: ChatRequest, index: int = 1) -> str:
    return request.messages[index].content or ""


def asking(request: ChatRequest, pattern: re.Pattern[str]) -> str:
    asking = [m.content for m in request.messages if m.role == "user" and m.content and pattern.search(m.content)]
    return asking[-1] if asking else ""


def _topic(request: ChatRequest) -> dict[str, Any]:
    desk = int(DESK.search(request_text(request)).group(1))
    place, kind = PLACES[desk % len(PLACES)], KINDS[desk // len(PLACES) % len(KINDS)]
    return {
        "name": f"Desk {desk} {place.title()} {kind.title()} Loans",
        "description": f"The {kind} lending desk of the {place} branch, number {desk}: members borrow items, "
        "renew and return them.",
        "domain": "Lending",
        "core_entities": ["item", "member", "loan"],
        "modelability": 9,
        "usefulness": 8,
    }


def _state_draft(request: ChatRequest) -> dict[str, Any]:
    topic = re.search(r"^Environment: (\w+)", request_text(request), re.MULTILINE).group(1)
    return {**FIXTURE["state_draft"], "class_name": "".join(word.capitalize() for word in topic.split("_")) + "Env"}


def _tester(request: ChatRequest) -> dict[str, Any]:
    slots = SLOT.findall(asking(request, SLOT))
    return {"calls": [{"call": int(n), "tool": t, "arguments": TESTER_ARGS[case.lower()][t]} for n, t, case in slots]}


def _verdicts(request: ChatRequest) -> dict[str, Any]:
    return {"verdicts": [{"call": int(n), **VERDICT} for n in CALL.findall(asking(request, CALL))]}


def task_reply(request: ChatRequest) -> dict[str, Any]:
    # A user of each environment's own: two environments' simulators never send the very same request, so neither's
    # rollouts replay the other's replies from the cache (which rollout then paid for them, by the ledger rule of
    # `records.Usage`, would depend on which asked first).
    name = re.search(r"^# Environment (\S+)", request_text(request), re.MULTILINE).group(1)
    return {**TASK, "user_profile": f"{TASK['user_profile']} Borrows at the {name} desk."}


def checks_reply(request: ChatRequest) -> dict[str, Any]:
    section = request_text(request).rsplit("## Checklist (", 1)[1].split("\n", 1)[1]
    return {"checks": [CHECKS[line.split(". ", 1)[1]] for line in section.splitlines()]}


STRUCTURED = {
    "Judgement": lambda request: {"reason": "needs a persistent system", "needs_stateful_system": True},
    "TopicDraft": _topic,
    "StateDraft": _state_draft,
    "OperationsDraft": lambda request: FIXTURE["operations_draft"],
    "TestState": lambda request: {"purpose": "one member with an open loan and a book with no copy left",
                                  "state": TEST_STATE},
    "TesterCalls": _tester,
    "CheckerVerdicts": _verdicts,
    "CheckerVerdict": lambda request: VERDICT,
    "ProbeDraft": lambda request: PROBES,
    "InitialState": lambda request: {"now": "2024-03-14T10:30:00", "state": SCENARIO_STATE},
    "TaskDraft": task_reply,
    "CheckCodes": checks_reply,
    "GoldSolution": lambda request: {"actions": GOLD},
}  # fmt: skip


def _code_piece(request: ChatRequest) -> str:
    text = request_text(request)
    method = re.search(r"^Write the method (\w+),", text, re.MULTILINE)
    if method:
        return FIXTURE["code"][method.group(1)]
    class_name = re.search(r"^Write the class (\w+) with its __init__\.", text, re.MULTILINE).group(1)
    return FIXTURE["code"]["__init__"].replace("class LibraryLoansEnv:", f"class {class_name}:")


def _agent(request: ChatRequest) -> Reply | str:
    """Asks for the details, then makes the calls at once (sample 1 with a wrong due date), then reports."""
    said = [m.content or "" for m in request.messages if m.role == "user"]
    if not any("m2" in text for text in said):
        return "Happy to help. Could you give me your member id, the book and when you will bring it back?"
    last_user = max(i for i, m in enumerate(request.messages) if m.role == "user")
    if not any(m.role == "assistant" for m in request.messages[last_user:]):
        calls = GOLD if request.sample_index == 0 else WRONG_DUE
        return tool_reply(*((call["name"], call["arguments"]) for call in calls))
    return "Done: book b3 is lent to member m2."


def _user(request: ChatRequest) -> str:
    if len(request.messages) == 2:
        return "Hi, I would like to borrow a novel please."
    if request.messages[-1].content.endswith("?"):
        return f"Sure: I'm member m2, the book id is b3, and I need it until {DUE}."
    return STOP
