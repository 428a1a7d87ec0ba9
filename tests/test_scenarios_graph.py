"""The graph method of the scenarios stage: sampled chains worded by a scripted model that replies as a capable
one does (a <think> block, prose, JSON in a fence), over the fixture environments and a real sandbox."""

import json
import re

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.envs.graph import extract_graph
from builder.envs.guard import GUARD_ITEM
from builder.llm import ChatRequest, ScriptedModel, tool_reply
from builder.llm.connect import client_for
from builder.records import Environment, Rejection, Scenario, scenario_seed
from builder.reports import ScenariosReport
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import scenarios, slot_methods
from builder.stages.scenarios.families import FAMILIES, slot_families
from builder.stages.scenarios.graph_method import find_chains, start_graph
from builder.stages.scenarios.method_stats import derive_report
from builder.stages.scenarios.verbalise import UserRequest, created_values, leaks, parse_reply
from builder.stages.scenarios.verify import load_state
from builder.stats import StageStats
from builder.store import Store
from tests.fixtures.run_tables import pipeline_stage
from tests.test_stage_scenarios import BANK_STATE, NOW, environment, schema_name
from tests.test_stage_scenarios import scripted as llm_method_model

FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)
CALL = re.compile(r"^\d+\. (\w+)\((.*)\)$", re.M)
MUST = re.compile(r"^   - \w+ = (.+): the user must give it$", re.M)
CREATED = re.compile(r"^## Values the user cannot know \(the system creates them\)\n(.*)$", re.M)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def request_of(request: ChatRequest) -> str:
    return request.messages[1].content


def words(request: ChatRequest, *, omit: bool = False, leak: str = "") -> dict:
    """What a careful user would say for the calls of the request: every value it marks as the user's."""
    values = ", ".join(str(json.loads(v)) for v in dict.fromkeys(MUST.findall(request_of(request))))
    task = "Hello, please sort out my accounts as we discussed." if omit else f"Hello, please do this with {values}."
    return {
        "task": f"{task} {leak}".strip(),
        "user_profile": "A customer who writes complete, polite sentences.",
        "known_up_front": "Wants some changes made to their accounts.",
        "reveal_when_asked": "Nothing more to add." if omit else f"The details are: {values}.",
        "ending": "Stops once told it is done.",
        "difficulty": "medium",
    }


def capable(answer: dict | str) -> str:
    """A reply as Qwen3-8B-class models write it: reasoning, prose, the JSON in a fence, more prose."""
    body = answer if isinstance(answer, str) else f"```json\n{json.dumps(answer, indent=2)}\n```"
    return (
        "<think>\nThe calls change balances and flags. Rule 2: every value marked as the user's must be stated "
        "exactly. Rule 3: nothing the system creates. Let me draft the message, then check each rule again.\n"
        "</think>\n\nHere is what the user says. I checked that every value the calls need is stated and that "
        f"nothing the system creates is named.\n\n{body}\n\nEvery rule is satisfied."
    )


def verbaliser(*attempts):
    """Replies to the verbalisation requests: `attempts[n]` (a function of the request, or a text) answers a
    slot's n-th request (the last one repeats); the default answers every request well."""
    plans = attempts or (lambda request: words(request),)
    asked: dict[str, int] = {}

    def answer(request: ChatRequest):
        assert schema_name(request) == "UserRequest", schema_name(request)
        attempt = asked[request_of(request)] = asked.get(request_of(request), -1) + 1
        plan = plans[min(attempt, len(plans) - 1)]
        return capable(plan(request) if callable(plan) else plan)

    return ScriptedModel(answer)


def context(tmp_path, model, sandbox, *overrides, stats=None):
    plain = "scenarios.families={plain=1}"  # `both` alternates plain slots; the families have their own tests
    config = load_config(None, [f'store.path="{tmp_path / "store"}"', 'scenarios.method="graph"', plain, *overrides])
    stats = stats or StageStats("scenarios", report=ScenariosReport())
    llm = client_for(config.llm, model, model_id="m", on_call=stats.add_call)
    return StageContext(config, "hash", tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)


def gold_of(request: ChatRequest) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for name, arguments in CALL.findall(request_of(request))]


async def test_graph_method_words_verified_chains_into_scenarios(tmp_path, sandbox):
    model = verbaliser()
    # one slot: the default bank has one customer with two accounts, and chains stay on one customer's records,
    # so a second slot's chain names the same accounts and the scripted words near-duplicate the first (§11)
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=1")
    results = await scenarios(environment("bank"), ctx)
    assert [type(r) for r in results] == [Scenario] * 2 and {r.method for r in results} == {"graph"}
    assert len(model.requests) == 1  # one wording per slot, nothing else asked of the model
    for plain, talk in (results[:2],):
        assert (plain.mode, talk.mode) == ("non_conversational", "conversational") and talk.user is not None
        assert plain.verification.verified and plain.verification.repairs == ()
        assert all(plain.verification.checks_on_final) and not all(plain.verification.checks_on_initial)
        assert plain.verification.negative_control and len(plain.checks) == len(plain.checklist)
        assert 3 <= len(plain.gold_actions) <= 8 and plain.now == "2024-06-01T09:00:00"
        assert plain.initial_state["accounts"]["acc-1"]["balance"] == 10000  # the class's default state
        assert plain.provenance.prompt_version.startswith("scenario_request@")
        assert plain.checklist[-2:] == ("nothing else in the state changes", GUARD_ITEM)
    # The gold is the chain the request showed, call for call.
    shown = [gold_of(request) for request in model.requests]
    golds = [[(a.name, a.arguments) for a in s.gold_actions] for s in results[::2]]
    assert sorted(map(json.dumps, shown)) == sorted(map(json.dumps, golds))  # chains may share a first call
    assert model.requests[0].response_format["json_schema"]["name"] == "UserRequest"
    derive_report(ctx.stats)  # what the executor does once the stage's inputs are done
    graph = ctx.stats.report.to_json()["methods"]["graph"]
    assert (graph["slots"], graph["verified"], graph["yield"], graph["calls"]) == (1, 1, 1.0, 1)
    assert graph["per_verified"]["calls"] == 1.0 and graph["prompt_tokens"] == ctx.stats.usage.prompt_tokens > 0
    assert graph["mean_chain_length"] == len(results[0].gold_actions)
    assert 0 < graph["tool_coverage"] <= 1 and "llm" not in ctx.stats.report.to_json()["methods"]


def test_created_values_and_leaks():
    from builder.stages.scenarios.chain import Chain, ChainCall

    call = ChainCall(name="borrow_book", arguments={"book_id": "b1"}, sources={"book_id": "state"},
                     result={"success": True, "loan_id": "L4", "message": "book lent", "updated": ["due_date"]},
                     changed=True)  # fmt: skip
    chain = Chain(
        calls=(call,),
        initial_state={"loans": {"L1": {"book_id": "b1"}}, "books": {"b1": {"copies": 2}}},
        final_state={"loans": {"L1": {"book_id": "b1"}, "L4": {"book_id": "b1", "due_date": "2024-06-15"}},
                     "books": {"b1": {"copies": 1}}},
    )  # fmt: skip
    # Field names (also a result naming one: "due_date") and prose are no values; the scenario's date is the user's.
    assert created_values(chain, "2024-06-15T09:00:00") == ["L4"]
    assert created_values(chain, "2024-06-01T09:00:00") == ["2024-06-15", "L4"]
    # a date the user picks for a call is theirs, though a result repeats it (by day too); one from a result is not
    picked = call.model_copy(update={"arguments": {"book_id": "b1", "due": "2024-06-15T10:00"},
                                     "sources": {"book_id": "state", "due": "now"}})  # fmt: skip
    assert created_values(chain.model_copy(update={"calls": (picked,)}), "2024-06-01T09:00:00") == ["L4"]
    # ... also when the system stores it with seconds; and a snake_case key of a result is a kind, not a value
    stored = chain.model_copy(update={"calls": (picked.model_copy(update={"result": {
        "loan_id": "L4", "due": "2024-06-15T10:00:00", "time_slot": {"start": "2024-06-15T10:00:00"},
        "pickup_code": "desk_code_7q"}}),)})  # fmt: skip
    assert created_values(stored, "2024-06-01T09:00:00") == ["L4", "desk_code_7q"]  # a generated code is no key
    fed = picked.model_copy(update={"sources": {"book_id": "state", "due": "result 1 due"}})
    assert created_values(chain.model_copy(update={"calls": (fed,)}), "2024-06-01T09:00:00") == ["2024-06-15", "L4"]
    said = UserRequest(task="Lend me b1, loan l4 please", user_profile="", known_up_front="",
                       reveal_when_asked="use borrow_book", ending="", difficulty="easy")  # fmt: skip
    assert leaks(said, ["L4", "L44"], ["borrow_book", "lend"]) == [
        "it names 'L4', which the user cannot know: the system creates it during the calls",
        "it names the tool 'borrow_book'; a user does not know the tools",
    ]
    assert parse_reply(capable(json.loads(said.model_dump_json()))) == said
    with pytest.raises(ValueError, match="whole reply"):
        parse_reply('Here:\n```json\n{"task": 3}\n```')


async def test_a_leaked_id_or_tool_name_is_refused_and_asked_again(tmp_path, sandbox):
    def leak_created(request):
        created = CREATED.search(request_of(request))[1].split(", ")[0]
        return words(request, leak=f"My reference is {created}.")

    model = verbaliser(leak_created, lambda r: words(r, leak="Use get_account first."), words)
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=1")
    plain, _ = await scenarios(environment("bank"), ctx)
    assert plain.verification.repairs == ("request_leaks", "request_leaks")
    first, second, third = model.requests
    created = CREATED.search(request_of(first))[1].split(", ")[0]
    assert created != "(none)" and created not in plain.task
    assert f"it names {created!r}, which the user cannot know" in second.messages[-1].content
    assert "the tool 'get_account'" in third.messages[-1].content and "get_account" not in plain.task
    assert second.messages[2].role == "assistant" and created in second.messages[2].content  # the refused reply
    assert ctx.stats.report.to_json()["methods"]["graph"]["calls"] == 3


async def test_an_ungrounded_literal_is_refused_then_the_slot_is_rejected(tmp_path, sandbox):
    model = verbaliser(lambda request: words(request, omit=True))
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=1", "scenarios.repair_attempts=1",
                  "llm.structured_retries=0")  # fmt: skip
    (rejection,) = await scenarios(environment("bank"), ctx)
    assert isinstance(rejection, Rejection) and rejection.reason == "task_underspecified"
    assert rejection.subject_id.endswith("/scenario-0") and "the task does not give call 1" in rejection.detail
    assert len(model.requests) == 2  # repair_attempts + structured_retries + 1
    feedback = model.requests[1].messages[-1].content
    assert "the user script (known_up_front, reveal_when_asked) does not give" in feedback
    derive_report(ctx.stats)
    graph = ctx.stats.report.to_json()["methods"]["graph"]
    assert (graph["slots"], graph["verified"], graph["yield"], graph["per_verified"]) == (1, 0, 0.0, None)


async def test_a_reply_without_valid_json_is_asked_again(tmp_path, sandbox):
    model = verbaliser("I think the user should sound friendly and brief.", words)
    plain, _ = await scenarios(environment("bank"), context(tmp_path, model, sandbox, "scenarios.per_environment=1"))
    assert plain.verification.repairs == ("request_invalid",)
    assert "not valid" in model.requests[1].messages[-1].content


async def test_no_state_gives_a_chain_no_model_is_asked(tmp_path, sandbox):
    model = verbaliser()
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=1")
    (rejection,) = await scenarios(environment("orders"), ctx)
    assert rejection.reason == "no_chain" and "0 verified chains for 1 slots from 0 start states" in rejection.detail
    assert model.requests == []


def test_both_methods_alternate_slots_llm_first():
    assert slot_methods("both", ["plain"] * 3) == ["llm", "graph", "llm"] and slot_methods("both", ["plain"]) == ["llm"]
    assert slot_methods("graph", ["plain"] * 2) == ["graph", "graph"]
    assert slot_methods("llm", ["plain", "infeasible"]) == ["llm", "llm"]
    # `both` keeps the family mix: only plain slots alternate, the other families are the llm method's.
    mix = slot_families(8, {"plain": 3, "missing_info": 1, "infeasible": 1, "policy_trap": 1, "error_recovery": 1,
                            "long_context": 1})  # fmt: skip
    methods = slot_methods("both", mix)
    assert [family for family, method in zip(mix, methods, strict=True) if method == "graph"] == ["plain"]
    assert {family for family, method in zip(mix, methods, strict=True) if method == "llm"} == set(FAMILIES)


def both_methods_model():
    """The llm method's four requests as test_stage_scenarios scripts them, and the graph method's wording."""
    llm, words_model = llm_method_model(), verbaliser()

    def answer(request: ChatRequest):
        return (words_model if schema_name(request) == "UserRequest" else llm).script(request)

    return ScriptedModel(answer)


async def test_both_methods_each_report_their_cost_and_yield(tmp_path, sandbox):
    model = both_methods_model()
    ctx = context(tmp_path, model, sandbox, 'scenarios.method="both"', "scenarios.per_environment=2")
    results = await scenarios(environment("bank"), ctx)
    assert [(r.method, r.mode) for r in results] == [
        ("llm", "non_conversational"), ("llm", "conversational"),
        ("graph", "non_conversational"), ("graph", "conversational"),
    ]  # fmt: skip
    derive_report(ctx.stats)
    methods = ctx.stats.report.to_json()["methods"]
    assert (methods["llm"]["calls"], methods["graph"]["calls"]) == (4, 1)  # state, task, gold, checks; wording
    assert methods["llm"]["prompt_tokens"] + methods["graph"]["prompt_tokens"] == ctx.stats.usage.prompt_tokens
    assert methods["llm"]["prompt_tokens"] > methods["graph"]["prompt_tokens"] > 0
    assert methods["llm"]["mean_chain_length"] == 4.0 and methods["llm"]["tools_covered"] == 4
    assert ctx.stats.report.to_json()["verified_slots"] == 2


async def test_a_given_start_state_serves_both_methods(tmp_path, sandbox):
    code = environment("bank").code
    state, problems = load_state(sandbox, code, BANK_STATE, now=NOW)
    assert not problems
    model = both_methods_model()
    ctx = context(tmp_path, model, sandbox, 'scenarios.method="both"', "scenarios.per_environment=2")
    results = await scenarios(environment("bank"), ctx, start=(state, NOW))
    assert {r.method for r in results} == {"llm", "graph"} and all(r.initial_state == state for r in results)
    assert all(r.now == NOW for r in results)
    assert not [r for r in model.requests if schema_name(r) == "InitialState"]  # the llm method wrote no state


async def test_old_scenario_tables_read_as_the_llm_method(tmp_path, sandbox):
    plain, _ = await scenarios(
        environment("bank"), context(tmp_path, verbaliser(), sandbox, "scenarios.per_environment=1")
    )
    store = Store(tmp_path / "store")
    store.upsert("scenarios", [plain])
    pl.read_parquet(store.path("scenarios")).drop("method").write_parquet(store.path("scenarios"))
    (back,) = store.scenarios()
    assert back.method == "llm" and back.id == plain.id  # the method is not part of the id


async def test_graph_scenarios_go_through_rollout_select_and_export(tmp_path, sandbox):
    from builder.publish.export import build_tables

    golds: dict[str, list] = {}  # task -> the calls its wording request showed: what the scripted agent does
    worder = verbaliser()

    def answer(request: ChatRequest):
        if schema_name(request) == "UserRequest":
            said = words(request)
            golds[" ".join(said["task"].split())] = gold_of(request)
            return worder.script(request)
        task = next(m.content for m in request.messages if m.role == "user")
        if any(m.role == "tool" for m in request.messages):
            return "All done."
        return tool_reply(*golds[task])

    async def accepted(_, ctx):
        # a test state with three customers: chains stay on one customer's records, so the default bank (one
        # customer) would give a second slot a near-duplicate of the first
        return [evaluated(environment("bank"), [(BANK_STATE, NOW)])]

    stages = (
        BatchStage("evaluate", accepted, input=None, output=Environment, persist="environments"),
        pipeline_stage("scenarios"),
        pipeline_stage("rollout"),
        pipeline_stage("select"),
    )
    config = load_config(None, [
        f'store.path="{tmp_path / "store"}"', 'scenarios.method="graph"', "scenarios.per_environment=2",
        'scenarios.modes=["non_conversational"]', "rollout.samples_per_scenario=1", "select.rl_env_fraction=0",
    ])  # fmt: skip
    model = client_for(config.llm, ScriptedModel(answer), model_id="m")
    stats = await run_stages(stages, config, tmp_path / "run", llm=lambda s: model, sandbox=lambda: sandbox)
    assert (stats["scenarios"].kept, stats["rollout"].kept, stats["select"].kept) == (2, 2, 2)
    store = Store(config.store.path)
    trajectories = store.trajectories()
    assert all(t.solved and t.reward == 1.0 and t.end_reason == "agent_done" for t in trajectories)
    frames = [store.read_frame(name) for name in ("environments", "scenarios", "trajectories", "selections")]
    tables = build_tables(*frames, rl_fraction=0)
    published = tables["scenarios"]["train"]
    assert sorted(published["scenario_id"]) == sorted(s.id for s in store.scenarios())
    assert {s.method for s in store.scenarios()} == {"graph"} and published["pass_rate"].to_list() == [1.0, 1.0]
    assert sorted(tables["sft"]["train"]["trajectory_id"]) == sorted(t.id for t in trajectories)


def evaluated(env: Environment, states: list[tuple[dict, str]]) -> Environment:
    """`env` as evaluate leaves it: its test states in the evidence (the rest of the evidence is immaterial)."""
    evaluation = {
        "score": 1.0, "keep_score": 0.8, "calls_required": 0, "tool_coverage": 1.0, "tools": {}, "calls": [],
        "counts": {"judged": 0, "pass": 0, "warning": 0, "fail": 0, "failed_by_runtime": 0, "invalid_replies": 0},
        "test_states": [{"purpose": "a closed order", "now": now, "state": state} for state, now in states],
        "usage": {}, "provenance": {"model": None, "prompt_versions": [], "sampling": {}, "tester_tool_choice": "auto",
                                    "config_hash": "hash", "builder_version": "0"},
    }  # fmt: skip
    return Environment.model_validate({**env.model_dump(exclude={"id"}), "evaluation": evaluation})


def test_chains_from_evaluates_first_test_state_reuse_the_graph_it_stored(sandbox):
    env = evaluated(environment("bank"), [(BANK_STATE, NOW)])
    extracted = extract_graph(sandbox, env.code, BANK_STATE, now=NOW)  # what evaluate stores
    assert find_chains(sandbox, env.model_copy(update={"graph": extracted}), [(BANK_STATE, NOW)], 2, 2)[0]
    # A stored graph no extraction gives (no tools): it is the one used, so no chain has a tool to start from.
    toolless = extracted.model_copy(update={"nodes": (), "edges": ()})
    reusing = env.model_copy(update={"graph": toolless})
    assert start_graph(sandbox, reusing, BANK_STATE, NOW) is toolless
    found, dropped = find_chains(sandbox, reusing, [(BANK_STATE, NOW)], 2, 2)
    assert found == [] and dropped["no_writer"] > 0


def test_chains_from_another_state_or_now_extract_their_own_graph(sandbox):
    toolless = extract_graph(sandbox, environment("bank").code).model_copy(update={"nodes": (), "edges": ()})
    env = evaluated(environment("bank"), [(BANK_STATE, NOW)]).model_copy(update={"graph": toolless})
    later = "2024-06-01T09:00:00"
    graph = start_graph(sandbox, env, BANK_STATE, later)  # evaluate's state, but not at its `now`
    assert graph == extract_graph(sandbox, env.code, BANK_STATE, now=later, seed=scenario_seed(env.id, later))
    fewer = {**BANK_STATE, "accounts": {"acc-1": BANK_STATE["accounts"]["acc-1"]}}
    assert start_graph(sandbox, env, fewer, NOW).nodes == graph.nodes  # another state: extracted, tools and all
    found, _ = find_chains(sandbox, env, [(fewer, NOW), (BANK_STATE, NOW)], 2, 2)  # the graph of the first state
    assert found


async def test_chains_start_from_the_test_states_evaluate_wrote(tmp_path, sandbox):
    # The orders desk starts empty: only its test state (a closed order, at its own `now`) gives chains.
    order = {"order_id": "ORD-1", "customer": "Ada Palmer", "item": "green tea", "quantity": 2, "status": "closed"}
    env = evaluated(environment("orders"), [({"orders": {"ORD-1": order}, "audit": []}, NOW)])
    model = verbaliser()
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=1", "scenarios.min_gold_calls=1")
    plain, _ = await scenarios(env, ctx)
    assert plain.method == "graph" and plain.now == NOW and plain.initial_state["orders"]["ORD-1"] == order
    assert "place_order" in [action.name for action in plain.gold_actions]
    created = CREATED.search(request_of(model.requests[0]))[1]
    assert "ORD-" in created and "ORD-1," not in created  # the new order's id, not the one the state holds


async def test_an_imported_class_the_strict_lint_refuses_gets_graph_scenarios(tmp_path, sandbox):
    # A BFCL-style class (no hints, `_load_scenario`): the strict contract refuses it before anything runs; as an
    # imported environment (its provenance names an origin) the sandbox is the boundary and the stage works on it.
    from pathlib import Path

    from builder.envs.schema import inspect_source
    from builder.records import Origin

    code = (Path(__file__).parent / "fixtures" / "bfcl" / "trading_bot.py").read_text()
    interface = inspect_source(code, "import")
    origin = Origin(source="classes", location="trading_bot.py", revision="sha256:0", ref="trading_bot.py:TradingBot")
    imported = Environment(
        provenance={"config_hash": "hash", "origin": origin}, plan_id="plan-trading", name="trading_bot",
        class_name=interface.class_name, description="A trading bot.", domain="finance", code=code,
        tools=list(interface.tools), state_schema={}, status="accepted",
    )  # fmt: skip
    assert imported.contract == "import"
    results = await scenarios(imported, context(tmp_path, verbaliser(), sandbox, "scenarios.per_environment=2"))
    kept = [r for r in results if isinstance(r, Scenario)]
    assert kept and all(s.method == "graph" and s.verification.verified for s in kept), results

    strict = imported.model_copy(update={"provenance": imported.provenance.model_copy(update={"origin": None})})
    with pytest.raises(Rejected, match="env_load_failed: environment violates the contract"):
        await scenarios(strict, context(tmp_path / "strict", verbaliser(), sandbox))


async def test_a_graph_slot_with_no_chain_falls_back_to_the_llm_method_under_both(tmp_path, sandbox):
    # The orders fixture has no state a chain can start from: its graph slot is the llm method's under `both`.
    model = both_methods_model()
    ctx = context(tmp_path, model, sandbox, 'scenarios.method="both"', "scenarios.per_environment=2")
    results = await scenarios(environment("orders"), ctx)
    assert not [r for r in results if isinstance(r, Rejection) and r.reason == "no_chain"]
    assert {r.subject_id.rsplit("-", 1)[1] for r in results if isinstance(r, Rejection)} <= {"0", "1"}
    assert len([r for r in model.requests if schema_name(r) == "InitialState"]) >= 2  # both slots wrote a state
    derive_report(ctx.stats)
    methods = ctx.stats.report.to_json()["methods"]
    assert methods["graph"]["fell_back_to_llm"] == 1 and methods["graph"]["slots"] == 1
    assert methods["graph"]["verified"] == 0 and methods["llm"]["slots"] == 2


async def test_a_graph_slot_with_no_chain_is_rejected_under_graph(tmp_path, sandbox):
    ctx = context(tmp_path, verbaliser(), sandbox, 'scenarios.method="graph"', "scenarios.per_environment=1")
    (rejection,) = await scenarios(environment("orders"), ctx)
    assert rejection.reason == "no_chain"
    assert ctx.stats.report.methods["graph"].fell_back_to_llm == 0
