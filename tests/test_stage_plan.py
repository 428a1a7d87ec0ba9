import json
from pathlib import Path

import pytest

from builder.config import load_config
from builder.llm import ChatRequest, ScriptedModel
from builder.llm.connect import client_for
from builder.records import EnvPlan, Topic
from builder.run.stage import Rejected, StageContext
from builder.stages.plan import plan
from builder.stages.plan.rules import (
    OperationsDraft,
    StateDraft,
    class_name_for,
    clean_operations,
    clean_state,
    entity_plans,
    normal_type,
    operation_errors,
    plural,
    state_errors,
)
from builder.stats import StageStats

FIXTURES = Path(__file__).parent / "fixtures" / "synthesis"
STATE = json.loads((FIXTURES / "library_state.json").read_text())
OPERATIONS = json.loads((FIXTURES / "library_operations.json").read_text())


def schema_name(request: ChatRequest) -> str:
    return request.response_format["json_schema"]["name"] if request.response_format else ""


def scripted(states=(STATE,), operations=(OPERATIONS,)):
    """Answers state and operations requests from the given lists in turn (the last one repeats)."""
    served = {"StateDraft": 0, "OperationsDraft": 0}

    def answer(request: ChatRequest):
        name = schema_name(request)
        replies = states if name == "StateDraft" else operations
        reply = replies[min(served[name], len(replies) - 1)]
        served[name] += 1
        return reply if isinstance(reply, str) else json.dumps(reply)

    return ScriptedModel(answer)


def context(tmp_path, model, *overrides):
    config = load_config(None, list(overrides))
    return StageContext(config, "hash", tmp_path, StageStats("plan"), llm=client_for(config.llm, model, model_id="m"))


def topic():
    return Topic(
        provenance={"config_hash": "hash"},
        name="library_loans",
        description="A public library's lending desk: members, books and loans.",
        domain="library",
        entities=("member", "book", "loan"),
        example_requests=("Renew loan L-77 for member M-3",),
    )


def requests_named(model, name):
    return [r for r in model.requests if schema_name(r) == name]


async def test_topic_becomes_a_clean_valid_plan(tmp_path):
    model = scripted()
    (result,) = await plan(topic(), context(tmp_path, model))
    assert isinstance(result, EnvPlan)
    assert (result.class_name, result.name, result.domain, result.topic_id) == (
        "LibraryLoansEnv", "library_loans", "library", topic().id,
    )  # fmt: skip
    assert [e.collection for e in result.entities] == ["books", "members", "loans"]
    member = result.entities[1]
    types = [(a.name, a.type) for a in member.attributes]
    assert types == [("member_id", "str"), ("name", "str"), ("max_loans", "int")]
    ops = {op.name: op for op in result.operations}
    # borrowBook cleaned
    assert list(ops) == ["get_book", "list_member_loans", "borrow_book", "return_book", "find_books", "find_members"]
    assert ops["find_books"].reads == ("book",)
    assert ops["borrow_book"].kind == "change" and ops["borrow_book"].enforces == (1, 2)
    assert ops["list_member_loans"].reads == ("loan",)  # "loans" (the collection) mapped to the entity
    assert ops["list_member_loans"].parameters[1].required is False
    assert result.provenance.parent_ids == (topic().id,)
    assert result.provenance.prompt_version.startswith("plan_state@")
    assert len(model.requests) == 2
    assert "3. A loan can be returned only once." in requests_named(model, "OperationsDraft")[0].messages[1].content


async def test_malformed_json_is_a_rejection_with_the_raw_text(tmp_path):
    model = scripted(states=['{"class_name": "LibraryLoansEnv", "entities": ['])
    with pytest.raises(Rejected) as verdict:
        await plan(topic(), context(tmp_path, model, "llm.structured_retries=1"))
    rejection = verdict.value.rejection
    assert rejection.reason == "plan_malformed"
    assert rejection.raw_output.startswith('{"class_name"')
    assert len(model.requests) == 2


async def test_invalid_operations_are_repaired_with_the_errors_fed_back(tmp_path):
    broken = json.loads(json.dumps(OPERATIONS))
    broken["operations"][3]["writes"] = []  # a change that writes nothing
    broken["operations"][0]["reads"] = ["shelf"]  # an unknown entity
    model = scripted(operations=[broken, OPERATIONS])
    (result,) = await plan(topic(), context(tmp_path, model))
    assert isinstance(result, EnvPlan)
    ops_requests = requests_named(model, "OperationsDraft")
    assert len(ops_requests) == 2
    feedback = ops_requests[1].messages[-1].content
    assert "operations[3] (return_book): a change must write state" in feedback
    assert "operations[0] (get_book).reads: 'shelf' is not a planned entity" in feedback
    assert ops_requests[1].messages[-2].role == "assistant"


async def test_invalid_state_is_repaired_before_operations_are_asked(tmp_path):
    broken = json.loads(json.dumps(STATE))
    broken["entities"][0]["key"] = "isbn"
    model = scripted(states=[broken, STATE])
    (result,) = await plan(topic(), context(tmp_path, model))
    assert isinstance(result, EnvPlan)
    state_requests = requests_named(model, "StateDraft")
    assert len(state_requests) == 2
    assert "the key 'isbn' must be one of its attributes" in state_requests[1].messages[-1].content
    assert len(requests_named(model, "OperationsDraft")) == 1


async def test_a_plan_that_stays_invalid_is_rejected_after_bounded_repairs(tmp_path):
    too_few = {"operations": OPERATIONS["operations"][:2]}  # two queries: too few, and no change
    model = scripted(operations=[too_few])
    with pytest.raises(Rejected) as verdict:
        await plan(topic(), context(tmp_path, model, "plan.repair_attempts=2"))
    rejection = verdict.value.rejection
    assert rejection.reason == "plan_invalid"
    assert "plan between 4 and 12 operations (got 2)" in rejection.detail
    assert "at least one change operation" in rejection.detail
    assert json.loads(rejection.raw_output)["operations"][0]["name"] == "get_book"
    assert len(requests_named(model, "OperationsDraft")) == 3  # the first try and two repairs


async def test_repairs_show_only_the_latest_draft_so_the_request_stays_small(tmp_path):
    too_few = {"operations": OPERATIONS["operations"][:2]}
    model = scripted(operations=[too_few])
    with pytest.raises(Rejected):
        await plan(topic(), context(tmp_path, model, "plan.repair_attempts=3"))
    first, *repairs = requests_named(model, "OperationsDraft")
    assert len(repairs) == 3
    for repair in repairs:  # a growing conversation outgrew a 4096-token context in a real run
        assert repair.messages[:-2] == first.messages
        assert [m.role for m in repair.messages[-2:]] == ["assistant", "user"]


async def test_a_repeated_invalid_draft_gets_fresh_samples_through_the_response_cache(tmp_path):
    from builder.llm.cache import ResponseCache

    broken = json.loads(json.dumps(STATE))
    broken["entities"][0]["key"] = "isbn"  # a real run: the 135M model sent the same invalid state three times
    model = scripted(states=[broken, broken, STATE])
    ctx = context(tmp_path, model, "plan.repair_attempts=2")
    ctx.llm = client_for(ctx.config.llm, model, model_id="m", cache=ResponseCache(tmp_path / "cache.sqlite"))
    (result,) = await plan(topic(), ctx)
    assert isinstance(result, EnvPlan)  # the third, fresh sample was valid; a cache hit would have repeated
    assert len(requests_named(model, "StateDraft")) == 3


async def test_operation_bounds_come_from_the_config(tmp_path):
    model = scripted()
    with pytest.raises(Rejected) as verdict:
        await plan(
            topic(),
            context(tmp_path, model, "plan.min_operations=2", "plan.max_operations=3", "plan.repair_attempts=0"),
        )
    assert "plan between 2 and 3 operations (got 6)" in verdict.value.rejection.detail
    assert len(model.requests) == 2


def valid_parts():
    state = clean_state(StateDraft.model_validate(STATE), "library_loans")
    entities = entity_plans(state)
    operations = clean_operations(OperationsDraft.model_validate(OPERATIONS), entities)
    return state, entities, operations


def with_op(operations, index, **changes):
    ops = list(operations.operations)
    ops[index] = ops[index].model_copy(update=changes)
    return OperationsDraft(operations=ops)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"name": "reset"}, "'reset' is reserved for the runtime"),
        ({"name": "books"}, "'books' is also the name of a state attribute"),
        ({"name": "get_book_"}, None),
        ({"name": "1st_book"}, "'1st_book' is not a valid snake_case Python identifier"),
        ({"name": "list_member_loans"}, "the name 'list_member_loans' is used more than once"),
        ({"writes": ["book"]}, "a query must not write state"),
        ({"enforces": [4]}, "4 is not a rule number (rules are numbered 1 to 3)"),
    ],
)
def test_operation_rules(changes, expected):
    state, entities, operations = valid_parts()
    errors = operation_errors(with_op(operations, 0, **changes), entities, len(state.rules), 4, 12)
    if expected is None:
        assert errors == []
    else:
        assert any(expected in error for error in errors), errors


def test_duplicate_parameters_and_self_are_errors():
    state, entities, operations = valid_parts()
    params = list(operations.operations[2].parameters)
    changed = with_op(operations, 2, parameters=[params[0], params[0], params[1].model_copy(update={"name": "self"})])
    errors = operation_errors(changed, entities, len(state.rules), 4, 12)
    assert any("the parameter 'member_id' appears more than once" in e for e in errors)
    assert any("'self' cannot be a parameter name" in e for e in errors)


def test_state_rules():
    state = StateDraft.model_validate(STATE)
    entities = [e.model_dump() for e in state.entities]
    entities[1]["attributes"][2]["name"] = "name"  # duplicate attribute
    entities[2]["attributes"][0]["type"] = "float"  # key of a bad type
    entities.append({**entities[0]})  # the book entity twice
    broken = StateDraft.model_validate({**STATE, "entities": entities, "rules": [], "class_name": "lib env"})
    errors = state_errors(broken)
    assert any("the attribute 'name' appears more than once" in e for e in errors)
    assert any("the key 'loan_id' must have type str or int, not float" in e for e in errors)
    assert any("the entity 'book' is planned twice" in e for e in errors)
    assert any(e.startswith("rules:") for e in errors)
    assert any(e.startswith("class_name:") for e in errors)
    assert state_errors(clean_state(broken, "x")) != []
    assert clean_state(broken, "x").class_name == "LibEnv"


def test_deterministic_clean_up():
    assert normal_type("String") == "str"
    assert normal_type("List[Integer]") == "list[int]"
    assert normal_type("Optional[datetime]") == "str"
    assert normal_type("array") == "list[str]"
    assert normal_type("Dict[str, Any]") == "dict"
    assert normal_type("list[Dict[str, int]]") == "list[dict]"
    assert normal_type("tuple") == "tuple"  # unknown types are left for validation to refuse
    assert [plural(w) for w in ("member", "category", "address", "books", "box", "status", "day")] == [
        "members", "categories", "addresses", "books", "boxes", "statuses", "days",
    ]  # fmt: skip
    assert class_name_for("hotel_booking") == "HotelBookingEnv"
    assert class_name_for("LibraryLoansEnv") == "LibraryLoansEnv"
    assert class_name_for("library loans") == "LibraryLoansEnv"


def test_unknown_types_fail_schema_validation():
    bad = json.loads(json.dumps(STATE))
    bad["entities"][0]["attributes"][1]["type"] = "tuple"
    with pytest.raises(ValueError):
        StateDraft.model_validate(bad)


async def test_the_plan_budget_is_its_own_not_capped_by_llm_max_tokens(tmp_path):
    model = scripted()
    await plan(topic(), context(tmp_path, model, "plan.max_tokens=3000"))
    assert {r.sampling.max_tokens for r in model.requests} == {3000}
    other = scripted()
    await plan(topic(), context(tmp_path, other, "plan.max_tokens=3000", "llm.max_tokens=128"))
    assert {r.sampling.max_tokens for r in other.requests} == {3000}  # llm.max_tokens: only for calls without one


def test_a_parameter_carrying_the_current_time_is_an_error_and_a_records_own_date_is_not():
    state, entities, operations = valid_parts()
    params = list(operations.operations[2].parameters)
    today = params[0].model_copy(update={"name": "today", "description": "Today's date, YYYY-MM-DD."})
    stamped = params[0].model_copy(update={"name": "resolved_at", "description": "The time of this action."})
    due = params[0].model_copy(update={"name": "due", "description": "When the book is due back, YYYY-MM-DD."})
    changed = with_op(operations, 2, parameters=[*params, today, stamped, due])
    errors = operation_errors(changed, entities, len(state.rules), 4, 12)
    clock = [e for e in errors if "carries the current date or time" in e]
    assert len(clock) == 2 and "(today)" in clock[0] and "(resolved_at)" in clock[1]
    assert "datetime.datetime.now()" in clock[0] and not any("(due)" in e for e in errors)


async def test_an_operation_taking_today_is_repaired_with_the_clock_advice(tmp_path):
    broken = json.loads(json.dumps(OPERATIONS))
    broken["operations"][2]["parameters"].append(
        {"name": "today", "type": "str", "description": "The current date.", "required": True}
    )
    model = scripted(operations=[broken, OPERATIONS])
    (result,) = await plan(topic(), context(tmp_path, model))
    assert isinstance(result, EnvPlan)
    assert not any(p.name == "today" for op in result.operations for p in op.parameters)
    feedback = requests_named(model, "OperationsDraft")[1].messages[-1].content
    assert "(today) carries the current date or time" in feedback


def without(operations, *names):
    return OperationsDraft(operations=[op for op in operations.operations if op.name not in names])


def test_an_entity_users_name_needs_a_query_that_finds_it_by_that_name():
    state, entities, operations = valid_parts()
    errors = operation_errors(without(operations, "find_members"), entities, len(state.rules), 4, 12)
    assert errors == [
        "member: no query operation finds a member by its name; users name a member that way, not by member_id; "
        "add a query operation that finds a member by name, e.g. find_members(name: str) -> list of matching "
        "members (reads: [member]), or one that lists all members with no required parameter"
    ]  # the book keeps find_books; a loan (references, a date, a flag) is named by nothing a user says
    both = operation_errors(without(operations, "find_members", "find_books"), entities, len(state.rules), 4, 12)
    assert [e.split(":")[0] for e in both] == ["book", "member"]
    assert "find_books(title: str)" in both[0]


@pytest.mark.parametrize(
    ("parameter", "required", "found"),
    [
        ("name", True, True),
        ("member_name", True, True),  # shares the word "name"
        ("query", True, True),  # a free-text search
        ("keyword", True, True),
        ("member_id", True, False),  # the internal key is what the user does not know
        ("max_loans", True, False),
        ("max_loans", False, True),  # no required parameter: a listing the agent can scan
    ],
)
def test_what_counts_as_finding_a_member(parameter, required, found):
    state, entities, operations = valid_parts()
    index = [op.name for op in operations.operations].index("find_members")
    lookup = operations.operations[index]
    changed = with_op(operations, index, parameters=[lookup.parameters[0].model_copy(
        update={"name": parameter, "required": required})])  # fmt: skip
    errors = operation_errors(changed, entities, len(state.rules), 4, 12)
    assert (errors == []) is found, errors


def test_a_listing_counts_but_a_change_does_not():
    state, entities, operations = valid_parts()
    index = [op.name for op in operations.operations].index("find_members")
    listing = with_op(operations, index, name="list_members", parameters=[])
    assert operation_errors(listing, entities, len(state.rules), 4, 12) == []
    change = with_op(operations, index, kind="change", writes=["member"])  # finds, but is not a query
    assert any(e.startswith("member: no query operation") for e in operation_errors(
        change, entities, len(state.rules), 4, 12))  # fmt: skip


def attributes(*names_and_types):
    return [{"name": name, "type": type_} for name, type_ in names_and_types]


def test_entities_needing_no_lookup_pass():
    state = json.loads(json.dumps(STATE))
    state["entities"][1]["key"] = "email"  # the key is what the user says: found by key
    state["entities"][1]["attributes"][0] = {"name": "email", "type": "str", "description": "e.g. ada@example.org"}
    audit = attributes(
        ("entry_id", "str"), ("book_id", "str"), ("at", "str"), ("action", "str"),
        ("status_code", "str"),  # describes the entry, does not name it
        ("book_title", "str"),  # a copy of the book's title: the book is found by find_books
    )  # fmt: skip
    fine = attributes(("fine_number", "int"), ("label", "str"), ("amount", "float"))
    state["entities"] += [
        {"name": "audit_entry", "key": "entry_id", "attributes": audit},
        {"name": "fine", "key": "fine_number", "attributes": fine},  # found by its key
    ]
    cleaned = clean_state(StateDraft.model_validate(state), "library_loans")
    entities = entity_plans(cleaned)
    operations = without(clean_operations(OperationsDraft.model_validate(OPERATIONS), entities), "find_members")
    assert operation_errors(operations, entities, len(cleaned.rules), 4, 12) == []
    state["entities"][-1]["key"] = "fine_id"  # now its label is what a user names it by
    state["entities"][-1]["attributes"][0]["name"] = "fine_id"
    cleaned = clean_state(StateDraft.model_validate(state), "library_loans")
    errors = operation_errors(operations, entity_plans(cleaned), len(cleaned.rules), 4, 12)
    assert [e.split(";")[0] for e in errors] == ["fine: no query operation finds a fine by its label"]


async def test_a_plan_without_a_lookup_is_repaired_when_the_model_adds_one(tmp_path):
    no_lookup = {"operations": [op for op in OPERATIONS["operations"] if op["name"] != "find_members"]}
    model = scripted(operations=[no_lookup, OPERATIONS])
    (result,) = await plan(topic(), context(tmp_path, model))
    assert "find_members" in [op.name for op in result.operations]
    first, repair = requests_named(model, "OperationsDraft")
    assert "member: no query operation finds a member by its name" in repair.messages[-1].content
    assert "find_members(name: str)" in repair.messages[-1].content
    assert "Users name records" in first.messages[0].content  # the prompt says it up front
