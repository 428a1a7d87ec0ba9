"""The sufficiency gate (every gold argument comes from the user's words, an earlier result or the schema) and
the user simulator's single ending rule."""

import re

import pytest

from builder.llm import ScriptedModel
from builder.prompts import prompt
from builder.records import Action, Sampling
from builder.rollout.user_sim import STOP, UserSimulator
from builder.stages.scenarios.sufficiency import COMPOSITION_WORDS, looked_up_by, unsupported_arguments
from tests.fixtures.scenarios import bank_scenario


def tool(tool_name: str, **properties) -> dict:
    return {"type": "function", "function": {"name": tool_name, "description": "", "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}  # fmt: skip


TOOLS = [
    tool("find_patient", name={"type": "string"}),
    tool("book_visit", patient_id={"type": "string"}, kind={"type": "string", "enum": ["checkup", "follow_up"]},
         urgent={"type": "boolean"}, fee_cents={"type": "integer"}, day={"type": "string"}),
    tool("send_note", patient_id={"type": "string"}, body={"type": "string"},
         tags={"type": "array", "items": {"type": "string"}}, limit={"type": "integer", "default": 10}),
    tool("set_unit", unit={"type": "string", "description": "One of 'ward-a' or 'ward-b'."}),
]  # fmt: skip
BOOK = Action(name="book_visit", arguments={"patient_id": "P-1042", "kind": "checkup", "urgent": True,
                                              "fee_cents": 4500, "day": "2024-07-15"})  # fmt: skip
SAID = "Book a checkup for Maria Lopez on 2024-07-15; the fee is $45."


def test_an_id_the_task_never_gives_is_refused():
    # The real-run failure: the task names the patient, the gold uses the id from the state, nothing finds it.
    assert unsupported_arguments([BOOK], [None], SAID, TOOLS) == ["call 1 book_visit: patient_id = 'P-1042'"]


def test_an_id_in_the_task_or_from_an_earlier_lookup_is_accepted():
    assert unsupported_arguments([BOOK], [None], SAID + " My patient id is P-1042.", TOOLS) == []
    lookup = Action(name="find_patient", arguments={"name": "Maria Lopez"})
    found = {"success": True, "patients": [{"patient_id": "P-1042", "name": "Maria Lopez"}]}
    assert unsupported_arguments([lookup, BOOK], [found, None], SAID, TOOLS) == []
    keyed = {"P-1042": {"name": "Maria Lopez"}}  # ids as dict keys count too
    assert unsupported_arguments([lookup, BOOK], [keyed, None], SAID, TOOLS) == []
    # Only earlier results count: the lookup after the booking does not help it.
    assert unsupported_arguments([BOOK, lookup], [None, found], SAID, TOOLS) == [
        "call 1 book_visit: patient_id = 'P-1042'"
    ]


def test_enum_values_defaults_booleans_and_descriptions_are_free():
    call = Action(name="book_visit", arguments={**BOOK.arguments, "patient_id": "", "kind": "follow_up"})
    assert unsupported_arguments([call], [None], SAID, TOOLS) == []  # "follow_up" is not said: the enum lists it
    unit = Action(name="set_unit", arguments={"unit": "ward-b"})
    assert unsupported_arguments([unit], [None], "Move me.", TOOLS) == []
    page = Action(name="send_note", arguments={"patient_id": None, "body": "", "tags": [], "limit": 10})
    assert unsupported_arguments([page], [None], "", TOOLS) == []
    assert unsupported_arguments([Action(name=page.name, arguments={"limit": 25})], [None], "", TOOLS) == [
        "call 1 send_note: limit = 25"
    ]


@pytest.mark.parametrize(
    ("said", "value", "ok"),
    [
        ("the fee is $45", 4500, True),  # a money amount also stands for its cents
        ("the fee is 45.00", 4500, True),
        ("the fee is 45 dollars", 4500, True),
        ("the fee is 45", 45, True),
        ("the fee is 45", 4500, False),  # a bare number is not taken for dollars
        ("the fee is $1,200", 1200, True),
        ("the fee is 2.0", 2, True),
        ("account acc-45", 45, False),  # digits inside an id are no number
        ("two visits", 2, True),
    ],
)
def test_numbers_match_whatever_their_formatting(said, value, ok):
    call = Action(name="book_visit", arguments={"fee_cents": value})
    assert (unsupported_arguments([call], [None], said, TOOLS) == []) is ok


@pytest.mark.parametrize(
    ("said", "value", "ok"),
    [
        ("book p-1042 please", "P-1042", True),  # case-insensitive
        ("book P-10423 please", "P-1042", False),  # not inside a longer token
        ("on July 15, 2024", "2024-07-15", True),
        ("on the 15th of July", "2024-07-15", True),
        ("on July 16", "2024-07-15", False),
        ("for Lopez, Maria", "Maria Lopez", True),  # every word of a short name is said
        ("for Maria", "Maria Lopez", False),
    ],
)
def test_strings_match_as_tokens_dates_and_words(said, value, ok):
    call = Action(name="book_visit", arguments={"day": value})
    assert (unsupported_arguments([call], [None], said, TOOLS) == []) is ok


def test_composed_text_is_free_and_lists_are_checked_element_wise():
    body = "Your checkup is booked, see you soon"
    assert len(body.split()) >= COMPOSITION_WORDS
    note = Action(name="send_note", arguments={"patient_id": "P-1042", "body": body, "tags": ["checkup", "vip"]})
    assert unsupported_arguments([note], [None], "Note for P-1042, tag it checkup.", TOOLS) == [
        "call 1 send_note: tags[1] = 'vip'"
    ]
    short = Action(name="send_note", arguments={"body": "Booked X-9"})  # short strings are identifiers
    assert unsupported_arguments([short], [None], "", TOOLS) == ["call 1 send_note: body = 'Booked X-9'"]


# ------------------------------------------------------------------------------------------ user simulator


def test_user_sim_prompt_has_exactly_one_ending_rule():
    template = prompt("user_sim")
    assert template.count("$stop") == 1
    # One paragraph or rule says how the conversation ends, and it is the marker; the script's `ending` is only
    # the condition (the task prompt asks for a condition, not a manner such as "thanks and leaves").
    parts = re.split(r"\n\s*\n|\n- ", template)
    ending_rules = [part for part in parts if re.search(r"\bend\b", part)]
    assert len(ending_rules) == 1 and "$stop" in ending_rules[0]
    assert "`ending`: the condition" in prompt("scenario_task")
    scenario = bank_scenario("conversational")
    system = UserSimulator(ScriptedModel(lambda r: "x"), scenario, ["transfer"], sampling=Sampling()).system
    assert system.count(STOP) == 1 and scenario.user.ending in system


@pytest.mark.parametrize(
    ("reply", "stop"),
    [(STOP, True), (f"  {STOP}\n", True), (f"Thanks, that's all! {STOP}", True), ("Thanks, that's all!", False)],
)
async def test_user_sim_ends_exactly_when_the_reply_holds_the_marker(reply, stop):
    scenario = bank_scenario("conversational")
    sim = UserSimulator(ScriptedModel(lambda r: reply), scenario, ["transfer"], sampling=Sampling(), retries=0)
    turn = await sim.reply([])
    assert turn.stop is stop
    assert (turn.content is None) is stop  # what comes with the marker never reaches the agent


@pytest.mark.parametrize(
    ("said", "value", "ok"),
    [  # now is Monday 2025-10-06 (the task prompt says dates count from Now)
        ("a class on Wednesday, please", "2025-10-08", True),
        ("next Wednesday", "2025-10-15", True),  # "next" may mean the one after the coming one
        ("tomorrow morning", "2025-10-07", True),
        ("today", "2025-10-06", True),
        ("at 08:00 this morning", "2025-10-06T08:00:00", True),  # a date-time by its date
        ("in two weeks", "2025-10-20", True),
        ("in 3 days", "2025-10-09", True),
        ("last Friday", "2025-10-03", True),
        ("on Wednesday", "2025-10-09", False),  # a Thursday
        ("tomorrow", "2025-10-08", False),
    ],
)
def test_days_named_relative_to_now_are_the_users(said, value, ok):
    call = Action(name="book_visit", arguments={"day": value})
    assert (unsupported_arguments([call], [None], said, TOOLS, now="2025-10-06T09:00:00") == []) is ok
    assert unsupported_arguments([call], [None], said, TOOLS) != []  # without a now, a weekday names no date


@pytest.mark.parametrize(
    ("said", "value", "ok"),
    [
        ("I need a dermatologist in Los Angeles", "dermatology", True),  # another form of the word
        ("it has dual monitors", "dual_monitor", True),  # `_` separates words; a plural
        ("add it to the end of route 12", "R-12", True),  # a short id said as its name and number
        ("the desk in room 5", "RM-05", True),
        ("desk number 7", "D-7", True),
        ("add it to route 121", "R-12", False),  # another number
        ("add it to order 12", "R-12", False),  # the letters name another word
        ("the cat", "car", False),  # short words must be equal
        ("for a derm visit", "dermatology", False),  # a shared stem of five letters at least
    ],
)
def test_values_said_as_people_say_them_count_as_given(said, value, ok):
    call = Action(name="book_visit", arguments={"day": value})
    assert (unsupported_arguments([call], [None], said, TOOLS) == []) is ok


def test_a_number_before_a_hyphenated_word_is_said():
    """teacher-9: "Please leave a 4-star review" gives the rating; an id or a date holding the digit does not."""
    from builder.records import Action
    from builder.stages.scenarios.sufficiency import unsupported_arguments

    tools = [{"type": "function", "function": {"name": "add_review", "parameters": {"type": "object", "properties": {
        "rating": {"type": "integer"}, "provider_id": {"type": "string"}}}}}]  # fmt: skip
    call = [Action(name="add_review", arguments={"rating": 4, "provider_id": "PRV-14"})]
    assert unsupported_arguments(call, [{}], "Please leave a 4-star review for PRV-14.", tools) == []
    for text in ("Please leave a review for PRV-14 on 2025-04-14.", "Please review PRV-14, room B-4."):
        assert unsupported_arguments(call, [{}], text, tools) == ["call 1 add_review: rating = 4"]


# ---------------------------------------------------------------------------- a value the gold should look up

RETREATS = {
    "retreats": {
        "R-1": {"retreat_id": "R-1", "name": "Hanalei Bay Restorative Yoga", "status": "open"},
        "R-2": {"retreat_id": "R-2", "name": "Kyoto Zen Stillness", "status": "open"},
    },
    "guests": {"G-1": {"guest_id": "G-1", "name": "Rebecca Stein", "email": "rebecca@example.com"}},
    "bookings": {"B-1": {"booking_id": "B-1", "guest_id": "G-1", "retreat_id": "R-1", "status": "confirmed"}},
}


def tool(name: str, *parameters: str) -> dict:
    properties = {parameter: {"type": "string"} for parameter in parameters}
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


def test_a_value_the_user_names_a_record_of_is_one_a_tool_can_look_up():
    searchable = [tool("search_retreats", "query"), tool("list_sessions", "retreat_id")]
    said = "I can't make my  hanalei bay restorative yoga retreat in April; move me to June."
    assert looked_up_by("R-1", RETREATS, said, searchable) == "Hanalei Bay Restorative Yoga"
    assert looked_up_by("R-2", RETREATS, said, searchable) is None  # the user names another retreat
    # A record holding the value in a field (a booking's retreat) is found by what the user says of it too.
    assert looked_up_by("G-1", RETREATS, "This is rebecca@example.com.", [tool("find_guest", "email")]) == (
        "rebecca@example.com"
    )
    # Only through a tool that takes that field or a search text, and only by a distinctive detail.
    assert looked_up_by("R-1", RETREATS, said, [tool("list_sessions", "retreat_id")]) is None
    assert looked_up_by("R-1", RETREATS, "my open retreat", searchable) is None  # a status names no record
    assert looked_up_by("R-1", RETREATS, "the Hanalei Bay Restorative Yoga Plus retreat", searchable) == (
        "Hanalei Bay Restorative Yoga"
    )  # said within a longer name: the search still finds it
