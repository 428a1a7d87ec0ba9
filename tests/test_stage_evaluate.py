"""The evaluate stage with a scripted model over hand-written fixture environments and a real sandbox."""

import json
from pathlib import Path

import polars as pl
import pytest

from builder.bench_teacher import TEST_STATE, TESTER_ARGS
from builder.config import SandboxConfig, load_config
from builder.envs.graph import extract_graph
from builder.envs.lint import Problem
from builder.envs.probe import ToolProblem
from builder.envs.schema import inspect_source
from builder.envs.session import SessionError
from builder.envs.state_schema import generated_state_schema, reference_problems
from builder.llm import (
    ChatRequest,
    LLMRequestError,
    PromptTooLongError,
    ResponseCache,
    ScriptedModel,
    text_reply,
)
from builder.llm.connect import client_for
from builder.records import Environment, EnvPlan, Rejection, Topic
from builder.reports import EvaluateReport
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, ItemStage, Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.code import code
from builder.stages.evaluate import evaluate
from builder.stages.evaluate.exercise import schedule
from builder.stages.evaluate.gates import piece_errors
from builder.stages.plan import plan
from builder.stats import StageStats
from builder.store import Store
from builder.tables import from_frame, from_row, to_row
from builder.usage import Usage
from builder.views.code import class_header, method_source
from builder.views.state import clip_json, state_output_type, state_text
from tests.fixtures.ledger import attempt
from tests.fixtures.run_tables import pipeline_stage
from tests.fixtures.teacher import calls_judged, slots_asked

FIXTURES = Path(__file__).parent / "fixtures" / "envs"
FAST = SandboxConfig(call_timeout_s=1.0, kill_grace_s=0.5, memory_mb=256)

BANK_STATE = {
    "customers": {"c7": {"name": "Grace Hopper", "tier": "silver"}, "c8": {"name": "Alan Turing", "tier": "gold"}},
    "accounts": {
        "acc-7": {"owner": "c7", "balance": 2500, "kind": "checking", "frozen": False},
        "acc-8": {"owner": "c8", "balance": 90000, "kind": "savings", "frozen": False},
        "acc-9": {"owner": "c8", "balance": 0, "kind": "checking", "frozen": True},
    },
    "transfers": [],
    "daily_limit": 40000,
}
GOOD_ARGS = {
    "get_account": {"account_id": "acc-7"},
    "list_accounts": {"owner": "c7"},
    "transfer": {"source": "acc-7", "target": "acc-8", "amount": 100},
    "freeze_account": {"account_id": "acc-404"},
}
PASS = {"analysis": "as documented", "verdict": "pass", "reason": "correct"}


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def environment(fixture: str, code: str | None = None, **fields) -> Environment:
    code = code if code is not None else (FIXTURES / f"{fixture}.py").read_text()
    try:
        tools = list(inspect_source(code).tools)
    except Exception:  # contract-broken code: the gates must say so
        tools = []
    values = {
        "provenance": {"config_hash": "h", "parent_ids": ["plan-1"]}, "plan_id": "plan-1", "name": fixture,
        "class_name": "X", "description": f"the {fixture} fixture", "domain": "test", "code": code,
        "tools": tools, "state_schema": {},
    }  # fmt: skip
    return Environment(**{**values, **fields})


def kind(request: ChatRequest) -> str:
    name = request.response_format["json_schema"]["name"] if request.response_format else ""
    return {"TesterCalls": "tester", "CheckerVerdicts": "checker"}.get(name, name)


def calls(per_slot):
    """A tester reply filling every slot of the request with `per_slot(tool, case, request)` = (name, arguments)."""

    def reply(request: ChatRequest) -> str:
        made = [(n, *per_slot(tool, case, request)) for n, tool, case in slots_asked(request)]
        return json.dumps({"calls": [{"call": n, "tool": name, "arguments": args} for n, name, args in made]})

    return reply


def verdicts(verdict: dict):
    """A checker reply giving `verdict` to every call of the request."""
    return lambda request: json.dumps({"verdicts": [{"call": n, **verdict} for n in calls_judged(request)]})


def scripted(state=None, tester=None, checker=None) -> ScriptedModel:
    """A model: states, tester calls and checker verdicts each from a value or a function of the request."""

    def pick(value, request, default):
        value = default if value is None else value
        return value(request) if callable(value) else value

    def answer(request: ChatRequest):
        role = kind(request)
        if role == "TestState":
            reply = pick(state, request, {"purpose": "two customers", "state": BANK_STATE})
        elif role == "tester":
            reply = pick(tester, request, calls(lambda tool, case, r: (tool, GOOD_ARGS[tool])))
        else:
            checker_reply = verdicts(checker) if isinstance(checker, dict) else checker
            reply = pick(checker_reply, request, verdicts(PASS))
        return json.dumps(reply) if isinstance(reply, dict) else reply

    return ScriptedModel(answer)


def context(tmp_path, model, sandbox, *overrides) -> StageContext:
    # The embedded CPU profile: N = 12 judged calls (the built-in default is the paper's 100).
    config = load_config(None, [f"store.path={tmp_path / 'store'}", *overrides], profile="cpu")
    llm = client_for(config.llm, model, model_id="m")
    return StageContext(
        config, "hash", tmp_path, StageStats("evaluate", report=EvaluateReport()), llm=llm, open_sandbox=lambda: sandbox
    )


async def rejection(env, ctx) -> Rejection:
    with pytest.raises(Rejected) as verdict:
        await evaluate(env, ctx)
    return verdict.value.rejection


# ------------------------------------------------------------------------------------------------ happy path


async def test_good_environment_is_accepted_with_evidence(tmp_path, sandbox):
    model = scripted()
    env = environment("bank")
    (accepted,) = await evaluate(env, context(tmp_path, model, sandbox))
    assert (accepted.id, accepted.status, accepted.reason) == (env.id, "accepted", None)
    assert accepted.provenance == env.provenance  # the code's provenance; the verdict's is in the evidence
    evidence = accepted.evaluation
    assert accepted.scores == {"dual_agent": 1.0, "tool_coverage": 1.0}
    assert evidence.counts.judged == 12 and len(evidence.calls) == 12
    assert len(evidence.test_states) == 2 and evidence.test_states[0].state == BANK_STATE
    # The harness schedules coverage: every tool in turn, cases alternating, so every tool gets both and half the
    # judged calls are negative cases.
    assert all(counts["positive"] >= 1 and counts["negative"] >= 1 for counts in evidence.tools.values())
    assert sum(counts.get("negative", 0) for counts in evidence.tools.values()) == 6
    transfer = next(c for c in evidence.calls if c.tool == "transfer")
    assert transfer.judge == "checker" and "acc-7.balance" in transfer.changes
    assert evidence.usage["calls"] == 2 + 12 + 12  # states, tester calls, checker verdicts
    assert evidence.provenance.prompt_versions[0].startswith("evaluate_state@")
    stored = json.loads(to_row(accepted)["evaluation"])  # the keys, in the order the untyped evidence had them
    assert list(stored) == [
        "score", "keep_score", "calls_required", "counts", "tool_coverage", "tools", "test_states",
        "failed_test_states", "calls", "invalid_replies", "usage", "provenance",
    ]  # fmt: skip
    assert list(stored["calls"][0]) == [
        "state", "round", "tool", "case", "arguments", "result", "error_kind", "error", "changes", "verdict",
        "reason", "judge",
    ]  # fmt: skip
    assert stored["counts"]["pass"] == 12 and list(stored["test_states"][0]) == ["purpose", "now", "state"]
    # Tester requests force the scheduled tool; checker requests carry the method source and the diff.
    tester = [r for r in model.requests if kind(r) == "tester"]
    assert {slots_asked(r)[0][1] for r in tester} == set(GOOD_ARGS)
    checker = next(r for r in model.requests if kind(r) == "checker" and "`transfer`" in r.messages[1].content)
    assert "def transfer(self" in checker.messages[1].content and "acc-7.balance" in checker.messages[1].content
    refused = next(r for r in model.requests if kind(r) == "checker" and "`freeze_account`" in r.messages[1].content)
    assert "reports failure and the state is unchanged" in refused.messages[1].content
    assert accepted.id == env.id and accepted.evaluation.score == 1.0


async def test_an_accepted_environment_carries_its_tool_graph_from_the_first_test_state(tmp_path, sandbox):
    (accepted,) = await evaluate(environment("bank"), context(tmp_path, scripted(), sandbox))
    first = accepted.evaluation.test_states[0]
    assert accepted.graph == extract_graph(sandbox, accepted.code, first.state, now=first.now)  # reproducible
    data = {(e.source, e.target, e.input) for e in accepted.graph.edges if e.kind == "data"}
    assert ("list_accounts", "get_account", "account_id") in data  # an account id from a listing, found by running
    assert {"transfer", "freeze_account"} <= set(accepted.graph.writers())
    assert from_row(Environment, to_row(accepted)).graph == accepted.graph  # stored as JSON, read back as is


async def test_a_graph_that_cannot_be_extracted_leaves_the_verdict_and_no_graph(tmp_path, sandbox, monkeypatch):
    def broken(*args, **kwargs):
        raise SessionError("load_failed", "the environment did not load")

    monkeypatch.setattr("builder.stages.evaluate.extract_graph", broken)
    (accepted,) = await evaluate(environment("bank"), context(tmp_path, scripted(), sandbox))
    assert (accepted.status, accepted.graph) == ("accepted", None)


async def test_evidence_usage_is_the_ledger_of_the_stage_and_the_client(tmp_path, sandbox):
    """An attempt that failed when the server went away at the first verdict, then an attempt once it is back: the
    states and tester calls asked before come from the cache, and every verdict is cut once and asked again grown."""
    llm = ["llm.max_model_len=32768", "llm.thinking=off", "llm.max_retries=0", "llm.max_budget_growths=1"]
    config = load_config(None, [f"store.path={tmp_path / 'store'}", *llm], profile="cpu")
    budget, base, server_gone = config.evaluate.checker_max_tokens, scripted(), True

    def answer(request: ChatRequest):
        if kind(request) == "checker":
            if server_gone:
                return LLMRequestError("connection refused", retryable=True)
            if request.sampling.max_tokens <= budget:
                return text_reply('{"analysis": "as docu', finish_reason="length")
        return base.script(request)

    model = ScriptedModel(answer)
    with ResponseCache(tmp_path / "llm_cache.sqlite") as cache:
        first = attempt("evaluate", config, model, cache, tmp_path, sandbox)
        with pytest.raises(Rejected, match="llm_request: connection refused"):
            await evaluate(environment("bank"), first)
        server_gone = False
        resumed = attempt("evaluate", config, model, cache, tmp_path, sandbox)
        (accepted,) = await evaluate(environment("bank"), resumed)
    usage = Usage.model_validate(accepted.evaluation.usage)
    assert usage == resumed.stats.usage == resumed.llm.totals
    assert usage.cached_calls == first.stats.usage.calls > 0  # what the stopped attempt paid for, replayed
    assert usage.regrowths == 12 and usage.calls == 12 * 2 + 2 + 12 - usage.cached_calls  # cut + grown verdicts
    assert usage.failed_calls == 0 and first.stats.usage.failed_calls >= 1


def test_schedule_alternates_cases_so_half_the_calls_test_a_refusal_and_every_tool_gets_both():
    tools = ("a", "b", "c")
    assert [schedule(tools, p, {"a", "b", "c"}) for p in range(7)] == [
        ("a", "positive"), ("b", "negative"), ("c", "positive"),
        ("a", "negative"), ("b", "positive"), ("c", "negative"), ("a", "positive"),
    ]  # fmt: skip
    # b admits no wrong value: its negative slot becomes a positive case.
    assert [schedule(tools, p, {"a", "c"}) for p in range(0, 6)] == [
        ("a", "positive"), ("b", "positive"), ("c", "positive"),
        ("a", "negative"), ("b", "positive"), ("c", "negative"),
    ]  # fmt: skip
    # Fewer calls than tools (evaluate.calls = 10 over 11 tools): half of them are negative cases all the same.
    many = tuple(f"t{i}" for i in range(11))
    assert sum(schedule(many, p, set(many))[1] == "negative" for p in range(10)) == 5


async def test_runner_writes_accepted_and_rejected_rows(tmp_path, sandbox):
    envs = [environment("bank"), environment("crashing")]

    async def source(_inputs, ctx):
        return envs

    stages = (
        BatchStage("code", source, input=None, output=Environment),
        pipeline_stage("evaluate"),
    )
    config = load_config(None, [f"store.path={tmp_path / 'store'}", "evaluate.calls=4"])
    model = client_for(config.llm, scripted(), model_id="m")
    stats = await run_stages(stages, config, tmp_path / "run", llm=lambda s: model, sandbox=lambda: sandbox)
    assert (stats["evaluate"].kept, dict(stats["evaluate"].dropped)) == (1, {"gates_failed": 1})
    kept = pl.read_parquet(tmp_path / "run" / "evaluate.parquet")
    assert kept["status"].to_list() == ["accepted"]
    assert json.loads(kept["evaluation"][0])["counts"]["judged"] == 4


# ----------------------------------------------------------------------------------------------------- gates


@pytest.mark.parametrize(
    ("fixture", "code"),
    [("crashing", "tool_raised"), ("nondeterministic", "nondeterministic"), ("set_state", "state_not_json")],
)
async def test_gates_reject_broken_environments_without_asking_the_model(tmp_path, sandbox, fixture, code):
    model = scripted()
    rejected = await rejection(environment(fixture), context(tmp_path, model, sandbox))
    assert rejected.reason == "gates_failed" and rejected.detail.startswith(code)
    assert model.requests == []


async def test_gates_refuse_a_tool_that_takes_the_current_time_as_an_argument(tmp_path, sandbox):
    # "A rescheduled date cannot be in the past" is the caller's to bypass when the caller says what today is.
    bank = (FIXTURES / "bank.py").read_text()
    code = bank.replace(
        'def transfer(self, source: str, target: str, amount: int, memo: str = "")',
        'def transfer(self, source: str, target: str, amount: int, today: str, memo: str = "")',
    )
    code = code.replace(
        "            memo: Free text stored with the transfer.",
        "            today: Today's date, YYYY-MM-DD.\n            memo: Free text stored with the transfer.",
    )
    assert code != bank
    model = scripted()
    rejected = await rejection(environment("bank", code), context(tmp_path, model, sandbox))
    assert rejected.reason == "gates_failed" and "clock_parameter" in rejected.detail and model.requests == []


async def test_gates_reject_contract_violations_and_stale_tool_schemas(tmp_path, sandbox):
    ctx = context(tmp_path, scripted(), sandbox)
    bad = await rejection(environment("bad", "import os\nclass X:\n    pass\n"), ctx)
    assert bad.reason == "gates_failed" and "import_not_allowed" in bad.detail
    stale = environment("bank", tools=list(inspect_source((FIXTURES / "counter.py").read_text()).tools))
    assert (await rejection(stale, ctx)).detail.startswith("tools_mismatch")


# ------------------------------------------------------------------------------------------- the dual check


async def test_checker_that_always_fails_gives_low_score_with_verdicts_kept(tmp_path, sandbox):
    fail = {"analysis": "wrong", "verdict": "fail", "reason": "the balance is wrong"}
    rejected = await rejection(environment("bank"), context(tmp_path, scripted(checker=fail), sandbox))
    assert rejected.reason == "low_score" and rejected.detail.startswith("score 0.00 < 0.85 over 12 judged calls")
    evidence = json.loads(rejected.raw_output)
    assert len(evidence["calls"]) == 12 and {c["verdict"] for c in evidence["calls"]} == {"fail"}
    assert not (tmp_path / "store" / "environments.parquet").exists()


async def test_warnings_count_as_not_failed(tmp_path, sandbox):
    warn = {"analysis": "vague", "verdict": "warning", "reason": "vague error message"}
    (accepted,) = await evaluate(environment("bank"), context(tmp_path, scripted(checker=warn), sandbox))
    assert accepted.scores["dual_agent"] == 1.0 and accepted.evaluation.counts.warning == 12


async def test_unknown_tools_are_the_testers_error_not_counted_but_bounded(tmp_path, sandbox):
    def sometimes_unknown(tool, case, request):  # every scheduled slot is first answered with a hallucinated tool
        if "(unknown_tool)" not in request.messages[1].content:
            return "delete_everything", {}
        return tool, GOOD_ARGS[tool]

    ctx = context(
        tmp_path,
        scripted(tester=calls(sometimes_unknown)),
        sandbox,
        "evaluate.calls=4",
        "evaluate.max_invalid_replies=2",
    )
    (accepted,) = await evaluate(environment("bank"), ctx)
    evidence = accepted.evaluation
    assert evidence.score == 1.0 and evidence.counts.judged == 4
    assert evidence.counts.invalid_replies == 4  # one per scheduled slot, within 2 per state
    assert {item.kind for item in evidence.invalid_replies} == {"unknown_tool"}

    model = scripted(tester=calls(lambda tool, case, request: ("delete_everything", {})))
    ctx = context(tmp_path, model, sandbox, "evaluate.max_invalid_replies=3")
    rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "tester_invalid" and "unknown_tool=8" in rejected.detail
    assert "delete_everything" in rejected.raw_output
    assert sum(kind(r) == "tester" for r in model.requests) == 8  # (3 + 1) per test state, then it stops


@pytest.mark.parametrize(
    ("reply", "code"),
    [
        ("I would call transfer.", "tester_invalid"),
        ('{"calls": [{"call": 1, "tool": "transfer", "arguments": "{not json"}]}', "tester_invalid"),
        ('{"calls": [{"call": 7, "tool": "transfer", "arguments": {}}]}', "tester_invalid"),  # no such slot
    ],
)
async def test_malformed_tester_output_ends_as_a_bounded_rejection(tmp_path, sandbox, reply, code):
    model = scripted(tester=reply)
    ctx = context(tmp_path, model, sandbox, "evaluate.max_invalid_replies=1", "llm.structured_retries=1")
    rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "tester_invalid" and f"{code}=4" in rejected.detail
    assert rejected.raw_output
    # 2 states x (1 + 1 invalid replies allowed) x (1 + 1 retries with the error fed back)
    assert sum(kind(r) == "tester" for r in model.requests) == 8
    last = model.requests[-1].messages
    assert "unusable" in last[1].content and "cannot be used" in last[-1].content


async def test_arguments_off_the_schema_never_reach_the_environment(tmp_path, sandbox):
    lots = {"source": "acc-7", "target": "acc-8", "amount": "lots"}
    model = scripted(tester=calls(lambda tool, case, request: ("transfer", lots)))
    overrides = ("evaluate.tester_tool_choice=required", "evaluate.max_invalid_replies=0")
    rejected = await rejection(environment("bank"), context(tmp_path, model, sandbox, *overrides))
    assert rejected.reason == "tester_invalid" and "bad_arguments=2" in rejected.detail


async def test_malformed_checker_output_ends_as_a_bounded_rejection(tmp_path, sandbox):
    model = scripted(checker='{"analysis": "hmm", "verdict": "maybe"')
    ctx = context(tmp_path, model, sandbox, "evaluate.max_invalid_replies=1", "llm.structured_retries=1")
    rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "checker_invalid" and rejected.raw_output.startswith('{"analysis": "hmm"')
    assert sum(kind(r) == "checker" for r in model.requests) == 2 * 2 * 2


async def test_a_refused_request_and_one_failed_after_every_retry_reject_the_environment(tmp_path, sandbox):
    refused = scripted(checker=LLMRequestError("400 bad", status_code=400))
    assert (await rejection(environment("bank"), context(tmp_path, refused, sandbox))).reason == "llm_request"
    down = scripted(checker=LLMRequestError("failed after 5 attempts: HTTP 502", status_code=502, retryable=True))
    failed = await rejection(environment("bank"), context(tmp_path, down, sandbox, "llm.max_retries=0"))
    assert failed.reason == "llm_request" and "HTTP 502" in failed.detail


# ------------------------------------------------------------------------------------------------ test states


async def test_states_off_the_schema_are_fed_back_then_rejected(tmp_path, sandbox):
    bad = {"purpose": "typo", "state": {**BANK_STATE, "accounts": {"acc-7": {"owner": 7}}}}
    model = scripted(state=bad)
    rejected = await rejection(environment("bank"), context(tmp_path, model, sandbox, "llm.structured_retries=1"))
    assert rejected.reason == "no_valid_test_state" and "state.accounts.acc-7.owner" in rejected.detail
    assert json.loads(rejected.raw_output) == bad
    assert len(model.requests) == 2 * 2  # each state slot: one try and one repair with the error fed back
    assert "cannot be used" in model.requests[-1].messages[-1].content


async def test_states_that_do_not_load_are_rejected(tmp_path):
    huge = {"purpose": "big", "state": {**BANK_STATE, "customers": {"c7": {"name": "x" * 3000, "tier": "a"}}}}
    with Sandbox(FAST.model_copy(update={"max_state_bytes": 1024})) as small:
        ctx = context(tmp_path, scripted(state=huge), small, "llm.structured_retries=0")
        rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "no_valid_test_state" and "does not load" in rejected.detail


async def test_one_bad_state_leaves_all_calls_to_the_good_one(tmp_path, sandbox):
    def state(request):
        good = "state 1 of" in request.messages[1].content.lower()
        return {"purpose": "ok", "state": BANK_STATE} if good else "not json"

    ctx = context(tmp_path, scripted(state=state), sandbox, "evaluate.calls=3", "llm.structured_retries=0")
    (accepted,) = await evaluate(environment("bank"), ctx)
    evidence = accepted.evaluation
    assert len(evidence.test_states) == 1 and {c.state for c in evidence.calls} == {0}
    assert evidence.failed_test_states[0].index == 1 and evidence.counts.judged == 3


async def test_crashes_the_tester_finds_are_failures_without_asking_the_checker(tmp_path, sandbox):
    # Passes the gates (the fuzzer uses ids that exist) but raises on an unknown id instead of returning an error.
    code = (
        (FIXTURES / "bank.py")
        .read_text()
        .replace("account = self.accounts.get(account_id)", "account = self.accounts[account_id]")
    )

    def tester(name, case, request):
        return name, {"account_id": "acc-404"} if case == "negative" and name == "get_account" else GOOD_ARGS[name]

    model = scripted(tester=calls(tester))
    (accepted,) = await evaluate(environment("bank", code), context(tmp_path, model, sandbox))
    evidence = accepted.evaluation
    (crash,) = [c for c in evidence.calls if c.verdict == "fail"]
    assert (crash.tool, crash.case, crash.judge, crash.error_kind) == (
        "get_account",
        "negative",
        "runtime",
        "raised",
    )
    assert "KeyError" in crash.reason
    assert evidence.score == round(11 / 12, 4) and evidence.counts.failed_by_runtime == 1
    assert sum(kind(r) == "checker" for r in model.requests) == 11


async def test_required_tool_choice_lets_the_tester_pick_and_marks_unscheduled_calls(tmp_path, sandbox):
    model = scripted(tester=calls(lambda tool, case, request: ("get_account", GOOD_ARGS["get_account"])))
    ctx = context(tmp_path, model, sandbox, "evaluate.tester_tool_choice=required", "evaluate.calls=4")
    (accepted,) = await evaluate(environment("bank"), ctx)
    cases = [call.case for call in accepted.evaluation.calls]
    assert cases.count("unscheduled") == 3 and accepted.scores["tool_coverage"] == 0.25


# ------------------------------------------------------------------------------------------- source helpers


def test_state_schema_prefers_the_declared_one_and_infers_the_rest():
    default = {"books": {"b1": {"title": "Dune", "copies": 2}}, "loans": [], "today": "2024-05-01", "note": None}
    declared = {"type": "object", "properties": {"today": {"type": "string", "format": "date"}, "gone": {}}}
    schema = generated_state_schema(declared, default)
    assert list(schema["properties"]) == ["books", "loans", "today", "note"]  # the constructor's attributes
    assert schema["properties"]["today"] == {"type": "string", "format": "date"}
    assert schema["properties"]["books"] == {
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "properties": {"title": {"type": "string"}, "copies": {"type": "integer"}},
            "required": ["title", "copies"],  # tools read every field of a record
        },
    }
    assert schema["properties"]["note"] == {} and schema["additionalProperties"] is False
    with_ref = generated_state_schema({"today": {"$ref": "#/$defs/Day"}}, default)
    assert with_ref["properties"]["today"] == {"type": "string"}  # a $ref cannot be embedded: inferred instead
    shape = state_output_type(schema, "TestState", purpose=True, default_now="2024-06-01T09:00:00")
    assert shape.model_validate({"purpose": "p", "state": default}).state.model_dump() == default
    with pytest.raises(ValueError, match="state.books.b1.copies"):
        shape.model_validate({"purpose": "p", "state": {**default, "books": {"b1": {"title": "x", "copies": "2"}}}})


def test_method_source_includes_called_helpers():
    code = (
        "class X:\n    def __init__(self):\n        self.items = {}\n        self.limit = 3\n\n"
        "    def add(self, key: str) -> dict:\n        '''Add.\n\n        Args:\n            key: k.\n        '''\n"
        "        if self._full():\n            return {'success': False}\n        self.items[key] = 1\n"
        "        return {'success': True}\n\n"
        "    def _full(self) -> bool:\n        return len(self.items) >= self.limit\n"
    )
    source = method_source(code, "add")
    assert source.startswith("def add(self, key: str)") and "def _full(self)" in source
    assert class_header(code).endswith("self.limit = 3")
    assert clip_json({"a": "x" * 50}, 20).endswith("(38 more characters cut)")


# ------------------------------------------------------------------------------------- the whole synthesis chain

SYNTHESIS = Path(__file__).parent / "fixtures" / "synthesis"
# The library desk's test state and positive tester arguments: the packaged scripted teacher's (one copy).
LIBRARY_STATE = TEST_STATE
LIBRARY_ARGS = TESTER_ARGS["positive"]


async def test_topic_to_accepted_environment_through_plan_code_and_evaluate(tmp_path, sandbox):
    code_pieces = {path.stem: path.read_text() for path in (SYNTHESIS / "library_code").glob("*.txt")}

    def answer(request: ChatRequest):
        role = kind(request)
        if role == "StateDraft":
            return (SYNTHESIS / "library_state.json").read_text()
        if role == "OperationsDraft":
            return (SYNTHESIS / "library_operations.json").read_text()
        if role == "TestState":
            return json.dumps({"purpose": "one member with an open loan", "state": LIBRARY_STATE})
        if role == "tester":
            return calls(lambda tool, case, r: (tool, LIBRARY_ARGS[tool]))(request)
        if role == "checker":
            return verdicts(PASS)(request)
        text = request.messages[1].content
        return code_pieces[next((n for n in LIBRARY_ARGS if f"Write the method {n}," in text), "__init__")]

    topic = Topic(
        provenance={"config_hash": "h"}, name="library_loans", description="A lending desk.", domain="library"
    )

    async def topics(_inputs, _ctx):
        return [topic]

    stages = (
        BatchStage("topics", topics, input=None, output=Topic),
        ItemStage("plan", plan, input=Topic, output=EnvPlan),
        ItemStage("code", code, input=EnvPlan, output=Environment),
        pipeline_stage("evaluate"),
    )
    config = load_config(None, [f"store.path={tmp_path / 'store'}", "evaluate.calls=8"])
    llm = client_for(config.llm, ScriptedModel(answer), model_id="m")
    stats = await run_stages(stages, config, tmp_path / "run", llm=lambda _stats: llm, sandbox=lambda: sandbox)
    assert (stats["code"].kept, stats["evaluate"].kept) == (1, 1), stats["evaluate"].dropped
    (stored,) = Store(tmp_path / "store").environments("accepted")
    assert stored.class_name == "LibraryLoansEnv" and stored.scores == {"dual_agent": 1.0, "tool_coverage": 1.0}
    assert stored.evaluation.test_states[0].state == LIBRARY_STATE  # follows the code stage's state schema
    assert stored.synthesis  # the code stage's evidence survives evaluation


# ------------------------------------------------------------------------------- repairs through the code stage

REPAIR = SYNTHESIS / "repair"


def library_chain(tmp_path, sandbox, borrow_repairs, *overrides):
    """topic -> plan -> code -> evaluate on the library fixtures, with a capable-shaped borrow_book that raises
    on the probe's input; `borrow_repairs(n)` answers the n-th repair request of borrow_book."""
    code_pieces = {path.stem: path.read_text() for path in (SYNTHESIS / "library_code").glob("*.txt")}
    code_pieces["borrow_book"] = (REPAIR / "borrow_book_fails.txt").read_text()
    args = {**LIBRARY_ARGS, "borrow_book": {"member_id": "m1", "book_id": "b1", "due": "2099-07-01"}}
    repairs = []

    def answer(request: ChatRequest):
        role = kind(request)
        if role == "StateDraft":
            return (SYNTHESIS / "library_state.json").read_text()
        if role == "OperationsDraft":
            return (SYNTHESIS / "library_operations.json").read_text()
        if role == "TestState":
            return json.dumps({"purpose": "one member with an open loan", "state": LIBRARY_STATE})
        if role == "tester":
            return calls(lambda tool, case, r: (tool, args[tool]))(request)
        if role == "checker":
            return verdicts(PASS)(request)
        text = request.messages[1].content
        piece = next((n for n in LIBRARY_ARGS if f"Write the method {n}," in text), "__init__")
        if piece == "borrow_book" and len(request.messages) > 2:
            repairs.append(request)
            return borrow_repairs(len(repairs))
        return code_pieces[piece]

    topic = Topic(
        provenance={"config_hash": "h"}, name="library_loans", description="A lending desk.", domain="library"
    )

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
    return run, model, repairs


async def test_a_tool_that_fails_the_probe_is_repaired_through_code_and_accepted(tmp_path, sandbox):
    fixed = (REPAIR / "borrow_book_fixed.txt").read_text()
    run, model, repairs = library_chain(tmp_path, sandbox, lambda n: fixed)
    stats = await run
    assert (stats["code"].kept, stats["evaluate"].kept) == (1, 1), stats["evaluate"].dropped
    (written,) = from_frame(Environment, pl.read_parquet(tmp_path / "run" / "code.parquet").drop("input_id"))
    (stored,) = Store(tmp_path / "store").environments("accepted")
    # The repaired environment is a new record: new code, new id, the repair in its synthesis evidence.
    assert stored.id != written.id and stored.plan_id == written.plan_id and stored.tools == written.tools
    assert "datetime.date.fromisoformat(due.strip())\n    now" in written.code.replace("        ", "    ")
    assert 'got {due!r}"}' in stored.code and "uuid.uuid4()" in stored.code and "datetime.now()" in stored.code
    (repair,) = stored.synthesis.repairs
    assert (repair.round, repair.from_, repair.to, repair.requests) == (1, written.id, stored.id, 1)
    (problem,) = repair.problems["borrow_book"]
    assert problem.startswith("[tool_raised]") and "ValueError" in problem
    assert stored.synthesis.requests == written.synthesis.requests  # the code stage's evidence survives
    # The one repair request regenerates only borrow_book: its code and the failing call with the error fed back.
    (request,) = repairs
    assert "def borrow_book(self" in request.messages[2].content
    feedback = request.messages[3].content
    assert 'borrow_book({"member_id": "x", "book_id": "x", "due": "x"})' in feedback
    assert "ValueError: Invalid isoformat string" in feedback and "must never raise" in feedback
    assert stats["evaluate"].report.to_json()["fuzz_repairs"] == {"rounds": 1, "repaired": 1, "failed": 0}
    # The plan's rules reach the tester and the checker (through the module docstring).
    rule = "1. A member may have at most max_loans open loans."
    assert all(rule in r.messages[1].content for r in model.requests if kind(r) in ("tester", "checker"))


async def test_a_repair_that_keeps_failing_ends_as_the_old_rejection_after_the_bound(tmp_path, sandbox):
    failing = (REPAIR / "borrow_book_fails.txt").read_text()
    run, model, repairs = library_chain(tmp_path, sandbox, lambda n: failing)
    stats = await run
    assert (stats["evaluate"].kept, dict(stats["evaluate"].dropped)) == (0, {"gates_failed": 1})
    (rejected,) = from_frame(
        Rejection, pl.read_parquet(tmp_path / "run" / "evaluate.rejected.parquet").drop("input_id")
    )
    (written,) = from_frame(Environment, pl.read_parquet(tmp_path / "run" / "code.parquet").drop("input_id"))
    assert rejected.subject_id == written.id
    assert rejected.detail.startswith("tool_raised after 2 repair(s) through the code stage: ")
    assert "borrow_book: ValueError" in rejected.detail
    assert [r["round"] for r in json.loads(rejected.raw_output)] == [1, 2]
    assert len(repairs) == 2 and repairs[0].sample_index != repairs[1].sample_index  # fresh samples, bounded
    assert stats["evaluate"].report.to_json()["fuzz_repairs"] == {"rounds": 2, "repaired": 0, "failed": 1}
    assert not any(kind(r) in ("tester", "TestState") for r in model.requests)


async def test_a_repair_the_code_stage_cannot_finish_ends_as_the_old_rejection(tmp_path, sandbox):
    broken = "def borrow_book(self, member_id: str, book_id: str, due: str) -> dict:\n    return {'success':\n"
    run, model, repairs = library_chain(tmp_path, sandbox, lambda n: broken, "code.repair_attempts=1")
    stats = await run
    assert dict(stats["evaluate"].dropped) == {"gates_failed": 1}
    (rejected,) = from_frame(
        Rejection, pl.read_parquet(tmp_path / "run" / "evaluate.rejected.parquet").drop("input_id")
    )
    assert rejected.detail.startswith("tool_raised after 1 repair(s) through the code stage: ")
    (repair,) = json.loads(rejected.raw_output)
    assert repair["requests"] == 2 and repair["failed"]["borrow_book"][0].startswith("[syntax]")
    assert len(repairs) == 2  # the code stage's own bound (1 + code.repair_attempts), not a second loop's


async def test_without_repairs_a_probe_failure_rejects_at_once(tmp_path, sandbox):
    run, model, repairs = library_chain(tmp_path, sandbox, lambda n: "unused", "evaluate.fuzz_repairs=0")
    stats = await run
    assert dict(stats["evaluate"].dropped) == {"gates_failed": 1} and repairs == []
    (rejected,) = from_frame(
        Rejection, pl.read_parquet(tmp_path / "run" / "evaluate.rejected.parquet").drop("input_id")
    )
    assert rejected.detail.startswith("tool_raised: line 0: [tool_raised] borrow_book: ValueError")


def test_only_problems_of_one_tool_become_errors_of_its_method():
    raised = ToolProblem(code="tool_raised", line=0, message="pay: KeyError: 'x'", tool="pay", arguments={"to": "x"})
    (error,) = piece_errors([raised])["pay"]
    assert error.code == "tool_raised" and 'pay({"to": "x"})' in error.message and "KeyError: 'x'" in error.message
    assert piece_errors([raised, Problem(code="load_failed", line=0, message="boom")]) is None
    state_only = Problem(code="nondeterministic", line=0, message="the final state differed between two runs")
    assert piece_errors([state_only]) is None


# ------------------------------------------------------------------- references, negative cases, state in prompts

LEDGER = '''"""Payments, some funded by transfers.

Rules:
1. A payment's transfer_id is empty when the payment came from no transfer.
2. Audits never change the state.
"""


class LedgerEnv:
    """Accounts, transfers and the payments they fund."""

    def __init__(self):
        self.accounts = {"a1": {"owner": "Ann Lee", "balance": 100}}
        self.transfers = {"t1": {"account_id": "a1", "amount": 5}}
        self.payments = {"p1": {"account_id": "a1", "transfer_id": "t1", "amount": 5}}

    def get_payment(self, payment_id: str) -> dict:
        """Look up a payment.

        Args:
            payment_id: The payment.

        Returns:
            The payment, or an error.
        """
        payment = self.payments.get(payment_id)
        if payment is None:
            return {"success": False, "error": "unknown payment"}
        return {"success": True, "data": payment}

    def audit(self, include_idle: bool = False) -> dict:
        """Count the payments that came from no transfer.

        Args:
            include_idle: Also list the accounts without payments.

        Returns:
            The counts.
        """
        loose = sum(1 for payment in self.payments.values() if not payment.get("transfer_id"))
        result = {"success": True, "without_transfer": loose}
        if include_idle:
            used = {payment["account_id"] for payment in self.payments.values()}
            result["idle_accounts"] = sorted(set(self.accounts) - used)
        return result
'''
LEDGER_SCHEMA = {
    "type": "object",
    "properties": {
        "payments": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "account_id": {"type": "string"},
                    "transfer_id": {"type": ["string", "null"], "description": "empty if not from a transfer"},
                    "amount": {"type": "integer"},
                },
                "required": ["account_id", "transfer_id", "amount"],
            },
        }
    },
}


def ledger_state(payments: int = 3, **changes) -> dict:
    records = {f"p{i}": {"account_id": "a1", "transfer_id": "t1", "amount": 10 + i} for i in range(1, payments + 1)}
    records["p1"]["transfer_id"], records["p2"]["transfer_id"] = "", None  # "no reference", both ways
    for key, value in changes.items():
        records[key] = {**records[key], **value}
    return {
        "accounts": {"a1": {"owner": "Ann Lee", "balance": 100}, "a2": {"owner": "Bo Chen", "balance": 0}},
        "transfers": {"t1": {"account_id": "a1", "amount": 5}},
        "payments": records,
    }


def ledger_call(tool, case, request):
    if tool == "get_payment":
        return "get_payment", {"payment_id": "p404" if case == "negative" else "p1"}
    return "audit", {"include_idle": True}


ledger_tester = calls(ledger_call)


def test_empty_and_null_references_are_no_references_but_a_dangling_id_is():
    state = ledger_state()
    assert reference_problems(state) == []
    dangling = ledger_state(p3={"transfer_id": "t9"})
    assert reference_problems(dangling) == ["payments['p3'].transfer_id = 't9' is not a known transfer"]
    assert reference_problems(ledger_state(p3={"transfer_id": "  "})) == []


async def test_test_states_with_empty_references_pass_and_dangling_ones_are_fed_back(tmp_path, sandbox):
    def state(request):
        if "cannot be used" in request.messages[-1].content:
            return {"purpose": "fixed", "state": ledger_state()}
        return {"purpose": "dangling", "state": ledger_state(p3={"transfer_id": "t9"})}

    model = scripted(state=state, tester=ledger_tester)
    ctx = context(tmp_path, model, sandbox, "evaluate.test_states=1", "evaluate.calls=4")
    env = environment("ledger", LEDGER, state_schema=LEDGER_SCHEMA)
    (accepted,) = await evaluate(env, ctx)
    assert accepted.evaluation.test_states[0].state == ledger_state()  # '' and None kept as they are
    states = [r for r in model.requests if kind(r) == "TestState"]
    assert len(states) == 2 and "payments['p3'].transfer_id = 't9' is not a known transfer" in (
        states[1].messages[-1].content
    )


async def test_no_negative_case_for_a_tool_whose_only_parameter_is_an_optional_flag(tmp_path, sandbox):
    model = scripted(state={"purpose": "ledger", "state": ledger_state()}, tester=ledger_tester)
    ctx = context(tmp_path, model, sandbox, "evaluate.test_states=1", "evaluate.calls=6")
    (accepted,) = await evaluate(environment("ledger", LEDGER, state_schema=LEDGER_SCHEMA), ctx)
    tools = accepted.evaluation.tools
    assert (tools["audit"]["positive"], tools["audit"].get("negative", 0)) == (3, 0)
    assert (tools["get_payment"]["positive"], tools["get_payment"]["negative"]) == (2, 1)
    audits = [r for r in model.requests if kind(r) == "tester" and slots_asked(r)[0][1] == "audit"]
    assert len(audits) == 3 and all(slots_asked(r)[0][2] == "positive" for r in audits)
    # The environment's rules (its module docstring) reach both agents.
    for request in model.requests:
        if kind(request) in ("tester", "checker"):
            assert "2. Audits never change the state." in request.messages[1].content


@pytest.mark.parametrize(
    ("properties", "required", "admits"),
    [
        ({"verbose": {"type": "boolean"}}, [], False),  # an optional flag
        ({"city": {"type": "string", "description": "only studios in this city"}}, [], False),  # a free filter
        ({"city": {"type": "string"}}, ["city"], True),  # required: empty text is wrong
        ({"date": {"type": "string", "description": "only this day, YYYY-MM-DD"}}, [], True),  # a format
        ({"member_id": {"type": "string"}}, [], True),  # names a record
        ({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, [], True),
        ({"status": {"type": "string", "enum": ["open", "closed"]}}, [], True),
        ({"limit": {"type": "integer"}}, [], False),
        ({"limit": {"type": "integer", "minimum": 1}}, [], True),
    ],
)
def test_which_tools_admit_a_wrong_value(properties, required, admits):
    from builder.stages.evaluate.cases import admits_wrong_value

    assert admits_wrong_value({"type": "object", "properties": properties, "required": required}) is admits


def shown_state(text: str, heading: str) -> tuple[dict, list[str]]:
    """The JSON state a prompt shows under `heading`, and the omission notes after it."""
    block = text.split(heading, 1)[1].split("\n\n", 1)[0]
    first, *notes = block.split("\n")
    return json.loads(first), notes


async def test_a_large_state_reaches_the_tester_cut_at_record_boundaries_with_a_note(tmp_path, sandbox):
    big = ledger_state(payments=80)
    model = scripted(state={"purpose": "busy", "state": big}, tester=ledger_tester)
    overrides = ("evaluate.test_states=1", "evaluate.calls=2", "llm.max_state_chars=1500")
    await evaluate(
        environment("ledger", LEDGER, state_schema=LEDGER_SCHEMA), context(tmp_path, model, sandbox, *overrides)
    )
    tester = next(r for r in model.requests if kind(r) == "tester")
    shown, notes = shown_state(tester.messages[1].content, "State as first set up (JSON):\n")
    assert shown["accounts"] == big["accounts"] and shown["transfers"] == big["transfers"]
    assert 0 < len(shown["payments"]) < 80
    assert all(big["payments"][key] == record for key, record in shown["payments"].items())  # whole records
    hidden = 80 - len(shown["payments"])
    (note,) = notes
    assert note.startswith(f"… {hidden} more payments not shown: ids p{81 - hidden}, p{82 - hidden},")
    assert len(json.dumps(shown, separators=(",", ":"))) + len(note) < 1500
    checker = next(r for r in model.requests if kind(r) == "checker")
    before, notes = shown_state(checker.messages[1].content, "State as first set up (JSON):\n")
    assert 0 < len(before["payments"]) < 80 and notes[0].startswith("… ")


def test_state_text_drops_whole_records_of_the_largest_collection_first():
    state = {
        "log": [{"id": i, "text": "x" * 20} for i in range(6)],
        "users": {"u1": {"name": "Ann"}, "u2": {"name": "Bo"}},
        "today": "2024-05-01",
    }
    assert state_text(state, 10_000) == json.dumps(state, separators=(",", ":"))
    text = state_text(state, 150)
    shown, notes = shown_state("S:\n" + text, "S:\n")
    assert shown["users"] == state["users"] and shown["today"] == "2024-05-01"
    assert shown["log"] == state["log"][: len(shown["log"])] and notes[0].startswith("… ")
    assert len(text) <= 150
    tiny = state_text(state, 10)  # nothing fits: every record is left out, the rest is still valid JSON
    shown, notes = shown_state("S:\n" + tiny, "S:\n")
    assert shown == {"log": [], "users": {}, "today": "2024-05-01"} and len(notes) == 2
    assert notes[1] == "… 2 more users not shown: ids u1, u2"


async def test_prompts_too_long_for_the_context_shrink_the_state_and_are_counted(tmp_path, sandbox):
    big = ledger_state(payments=80)

    def tester(request):
        if len(request.messages[1].content) > 2500:
            return PromptTooLongError("too long", prompt_tokens=40000, context_tokens=32768, min_completion=256)
        return ledger_tester(request)

    model = scripted(state={"purpose": "busy", "state": big}, tester=tester)
    overrides = ("evaluate.test_states=1", "evaluate.calls=2", "llm.max_state_chars=12000")
    ctx = context(tmp_path, model, sandbox, *overrides)
    (accepted,) = await evaluate(environment("ledger", LEDGER, state_schema=LEDGER_SCHEMA), ctx)
    assert accepted.evaluation.counts.judged == 2
    # The one shrink scheme (builder/views/budget.py): level 1 shows 6 of the 80 payments within 6000 characters,
    # which fits: one shrink for the first call, one for the second.
    assert ctx.stats.report.to_json()["prompt_shrunk"] == {"evaluate_tester": 2}

    always = scripted(
        state={"purpose": "busy", "state": big},
        tester=PromptTooLongError("too long", prompt_tokens=40000, context_tokens=4096, min_completion=256),
    )
    ctx = context(tmp_path, always, sandbox, *overrides)
    rejected = await rejection(environment("ledger", LEDGER, state_schema=LEDGER_SCHEMA), ctx)
    assert rejected.reason == "prompt_too_long"
    assert sum(kind(r) == "tester" for r in always.requests) == 7  # 12000 halved down to 200 characters


async def test_a_test_states_now_is_the_clock_the_tester_and_checker_are_told(tmp_path, sandbox):
    # States of capable models are dated (2025-2027 here); the sandbox clock must read the state's own "today",
    # not the sandbox's default, or "in the future" rules are judged against the wrong day.
    dated = {"purpose": "two customers", "now": "2025-10-06T09:00", "state": BANK_STATE}
    model = scripted(state=dated)
    (accepted,) = await evaluate(environment("bank"), context(tmp_path, model, sandbox))
    assert [s.now for s in accepted.evaluation.test_states] == ["2025-10-06T09:00:00"] * 2
    told = "Now: 2025-10-06T09:00:00 (Monday) (the environment's clock reads this date-time)."
    for role in ("tester", "checker"):
        requests = [r for r in model.requests if kind(r) == role]
        assert requests and all(told in r.messages[-1].content for r in requests), role


async def test_a_test_state_whose_now_is_not_a_date_time_is_asked_again(tmp_path, sandbox):
    replies = iter([{"purpose": "p", "now": "next Tuesday", "state": BANK_STATE}])
    model = scripted(state=lambda request: next(replies, {"purpose": "p", "now": "2025-01-02T08:00:00",
                                                          "state": BANK_STATE}))  # fmt: skip
    (accepted,) = await evaluate(environment("bank"), context(tmp_path, model, sandbox, "evaluate.test_states=1"))
    assert accepted.evaluation.test_states[0].now == "2025-01-02T08:00:00"
    retry = [r for r in model.requests if kind(r) == "TestState"][1]
    assert "now" in retry.messages[-1].content and retry.messages[-1].role == "user"
