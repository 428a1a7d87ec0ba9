"""Typed evidence: the models read the JSON the stages stored as plain dicts and write it back key for key; rows
written before the models existed read through the store; malformed evidence is a validation error."""

import json

import polars as pl
import pytest
from pydantic import ValidationError

from builder.evidence import Evaluation, Synthesis, Verification
from builder.records import Action, Environment, Scenario
from builder.store import Store
from builder.tables import from_row, schema, to_row
from tests.fixtures.scenarios import PROVENANCE, environment, verification

# What `summarize` stored before the evidence was typed: every kind of entry, keys in their order.
OLD_EVALUATION = {
    "score": 0.5,
    "keep_score": 0.85,
    "calls_required": 2,
    "counts": {"judged": 2, "pass": 1, "warning": 0, "fail": 1, "failed_by_runtime": 1, "invalid_replies": 1},
    "tool_coverage": 0.5,
    "tools": {"transfer": {"calls": 2, "positive": 1, "pass": 1, "negative": 1, "fail": 1}, "audit": {}},
    "test_states": [{"purpose": "two accounts", "now": "2025-10-06T09:00:00", "state": {"accounts": {"a": 1}}}],
    "failed_test_states": [{"index": 1, "kind": "state_invalid", "detail": "missing accounts"}],
    "calls": [
        {
            "state": 0,
            "round": 0,
            "tool": "transfer",
            "case": "positive",
            "arguments": {"amount": 3},
            "result": '{"success":true}',
            "error_kind": None,
            "error": None,
            "changes": '[{"path":"accounts.a","before":1,"after":4}]',
            "verdict": "pass",
            "reason": "moved the money",
            "judge": "checker",
        },
        {
            "state": 0,
            "round": 2,
            "tool": "transfer",
            "case": "negative",
            "arguments": {"amount": -1},
            "result": None,
            "error_kind": "raised",
            "error": "ValueError: negative",
            "changes": None,
            "verdict": "fail",
            "reason": "raised: ValueError: negative",
            "judge": "runtime",
        },
    ],
    "invalid_replies": [{"state": 0, "round": 1, "kind": "unknown_tool", "detail": "no tool delete_everything"}],
    "usage": {"requests": 5, "prompt_tokens": 900, "completion_tokens": 120},
    "provenance": {
        "model": "m",
        "prompt_versions": ["evaluate_state@1", "evaluate_tester@1", "evaluate_checker@1"],
        "sampling": {
            role: {"temperature": 0.2, "top_p": None, "max_tokens": 512, "seed": 0}
            for role in ("state", "tester", "checker")
        },
        "tester_tool_choice": "named",
        "config_hash": "abc",
        "builder_version": "0.1.0",
    },
}

# What the code stage stored, then the evaluate gates' repairs added (one repaired round, one that failed).
OLD_SYNTHESIS = {
    "requests": 4,
    "regenerated": {"borrow": 1},
    "fixes": {"borrow": ["stripped_fences"]},
    "added_imports": ["import datetime"],
    "repairs": [
        {"round": 1, "from": "env-a", "problems": {"borrow": ["[tool_raised] x"]}, "requests": 1, "to": "env-b"},
        {"round": 2, "from": "env-b", "problems": {"borrow": ["[tool_raised] y"]}, "requests": 2,
         "failed": {"borrow": ["[syntax] line 1"]}},
    ],
}  # fmt: skip

# What the scenario stage stored: an ablation that was graded and one whose episode broke.
OLD_VERIFICATION = {
    "verified": True,
    "scenario_group": "0123456789abcdef",
    "gold": [
        {"name": "get_account", "ok": True, "state_changed": False, "result": '{"balance": 1}'},
        {"name": "transfer", "ok": True, "state_changed": True, "result": '{"success": true}'},
        {"name": "freeze", "ok": True, "state_changed": True, "result": '{"success": true}'},
    ],
    "state_changing_calls": [1, 2],
    "gold_state_changes": [
        {"path": "accounts.a.balance", "before": 1, "after": 4},
        {"path": "accounts.a.note", "after": None},
        {"path": "holds[0]", "before": {"id": "h1"}},
    ],
    "checks_on_initial": [False, False],
    "checks_on_final": [True, True],
    "negative_control": [
        {"removed": 1, "name": "transfer", "failing_checks": [0]},
        {"removed": 2, "name": "freeze", "failing_checks": [0, 1], "error": "crashed: worker died"},
    ],
    "vacuous_checks": [],
    "model_difficulty": "medium",
    "state_repairs": 1,
    "repairs": ["gold_call_failed"],
}


@pytest.mark.parametrize(
    ("model", "old"),
    [(Evaluation, OLD_EVALUATION), (Synthesis, OLD_SYNTHESIS), (Verification, OLD_VERIFICATION)],
)
def test_old_evidence_reads_into_the_model_and_dumps_to_the_same_json(model, old):
    typed = model.model_validate(old)
    assert json.dumps(typed.model_dump(mode="json")) == json.dumps(old)  # same keys, same order, same values
    assert model.model_validate_json(typed.model_dump_json()) == typed


def test_evidence_is_read_by_attribute_and_keyword_keys_by_their_alias():
    evaluation = Evaluation.model_validate(OLD_EVALUATION)
    assert (evaluation.counts.pass_, evaluation.calls[1].judge, evaluation.test_states[0].now) == (
        1, "runtime", "2025-10-06T09:00:00",
    )  # fmt: skip
    synthesis = Synthesis.model_validate(OLD_SYNTHESIS)
    assert (synthesis.repairs[0].from_, synthesis.repairs[0].to, synthesis.repairs[1].failed) == (
        "env-a", "env-b", {"borrow": ("[syntax] line 1",)},
    )  # fmt: skip
    assert Verification.model_validate(OLD_VERIFICATION).negative_control[0].error is None
    # Keys that were written only when they had something to say stay out when empty.
    assert "repairs" not in Synthesis(requests=2).model_dump(mode="json")
    assert "error" not in Verification.model_validate(OLD_VERIFICATION).model_dump()["negative_control"][0]


def test_a_test_state_from_before_the_evaluate_clock_gets_the_default_now():
    old = {**OLD_EVALUATION, "test_states": [{"purpose": "p", "state": {}}]}
    assert Evaluation.model_validate(old).test_states[0].now == "2024-06-01T09:00:00"


@pytest.mark.parametrize(
    ("model", "old", "change"),
    [
        (Evaluation, OLD_EVALUATION, {"score": "high"}),
        (Evaluation, OLD_EVALUATION, {"counts": {"judged": 2}}),  # counts missing
        (Evaluation, OLD_EVALUATION, {"calls": [{**OLD_EVALUATION["calls"][0], "verdict": "great"}]}),
        (Evaluation, OLD_EVALUATION, {"calls": [{**OLD_EVALUATION["calls"][0], "judge": "someone"}]}),
        (Evaluation, OLD_EVALUATION, {"calls": [{**OLD_EVALUATION["calls"][0], "arguments": [1, 2]}]}),
        (Evaluation, OLD_EVALUATION, {"surprise": 1}),  # extra keys are refused, at every level
        (Evaluation, OLD_EVALUATION, {"counts": {k: v for k, v in OLD_EVALUATION["counts"].items() if k != "pass"}}),
        (Synthesis, OLD_SYNTHESIS, {"repairs": [{"round": 1, "problems": {}, "requests": 1}]}),  # no `from`
        (Synthesis, OLD_SYNTHESIS, {"fixes": {"borrow": "stripped_fences"}}),
        (Verification, OLD_VERIFICATION, {"gold": ["transfer"]}),
        (Verification, OLD_VERIFICATION, {"negative_control": [{"removed": 1, "name": "transfer"}]}),
        (Verification, OLD_VERIFICATION, {"model_difficulty": "trivial"}),
        (Verification, OLD_VERIFICATION, {"checks_on_final": ["maybe"]}),
    ],
)
def test_malformed_evidence_is_a_validation_error(model, old, change):
    with pytest.raises(ValidationError):
        model.model_validate({**old, **change})


def test_a_scenario_needs_its_verification():
    gold = (Action(name="transfer", arguments={"amount": 3}),)
    fields = dict(
        provenance=PROVENANCE, env_id="env-1", mode="non_conversational", initial_state={}, task="t",
        checklist=("c",), checks=("def check(initial_state, final_state):\n    return True\n",),
        gold_actions=gold, difficulty="easy",
    )  # fmt: skip
    assert Scenario(**fields, verification=verification(gold, 1)).verification.gold[0].name == "transfer"
    for missing in ({}, {"verification": {}}, {"verification": None}):
        with pytest.raises(ValidationError):
            Scenario(**fields, **missing)
    with pytest.raises(ValidationError):  # a gold action's arguments are a JSON object
        Scenario(**{**fields, "gold_actions": ({"name": "transfer", "arguments": "amount=3"},)},
                 verification=verification(gold, 1))  # fmt: skip


# ----------------------------------------------------------------------------------------------- tools


def test_tools_are_always_decoded():
    env = environment("bank")
    schemas = list(env.tools)
    assert isinstance(env.tools, tuple) and env.tools[0]["type"] == "function"
    from_text = env.model_validate({**env.model_dump(exclude={"id"}), "tools": json.dumps(schemas)})
    assert from_text.tools == env.tools and from_text.id == env.id
    row = to_row(env)
    assert json.loads(row["tools"]) == schemas  # stored as one JSON string
    twice = {**row, "tools": json.dumps(json.dumps(schemas))}  # a row whose tools were encoded twice
    assert from_row(Environment, twice).tools == env.tools
    for bad in ("not json", json.dumps({"type": "function"}), json.dumps(["transfer"])):
        with pytest.raises(ValidationError):
            Environment.model_validate({**env.model_dump(exclude={"id"}), "tools": bad})
    with pytest.raises(ValidationError):
        from_row(Environment, {**row, "tools": json.dumps(json.dumps(["transfer"]))})


# ------------------------------------------------------------------------------------- rows written before


def _old_environment_rows(evaluated: Environment, candidate: Environment) -> pl.DataFrame:
    """The environments table as a builder before typed evidence wrote it: the same columns, the evidence as
    the JSON of plain dicts, and {} where there was none."""
    rows = []
    for env, evaluation, synthesis in ((evaluated, OLD_EVALUATION, OLD_SYNTHESIS), (candidate, {}, {})):
        row = to_row(env)
        rows.append({**row, "evaluation": json.dumps(evaluation), "synthesis": json.dumps(synthesis)})
    return pl.DataFrame(rows, schema=schema(Environment), orient="row")


def test_old_environment_rows_read_through_the_store_and_write_back_the_same_json(tmp_path):
    accepted = environment("bank")
    candidate = environment("library").model_copy(update={"status": "candidate"})
    store = Store(tmp_path / "store")
    store.root.mkdir(parents=True)
    _old_environment_rows(accepted, candidate).write_parquet(store.root / "environments.parquet")
    by_id = {env.id: env for env in store.environments()}
    old, new = by_id[accepted.id], by_id[candidate.id]
    assert old.evaluation.counts.judged == 2 and old.synthesis.repairs[0].to == "env-b"
    assert (new.evaluation, new.synthesis) == (None, None)  # {} was "no evidence yet"
    row = to_row(old)
    assert (row["evaluation"], row["synthesis"]) == (json.dumps(OLD_EVALUATION), json.dumps(OLD_SYNTHESIS))
    assert to_row(new)["evaluation"] is None
    store.upsert("environments", [old, new])  # and they write back and read again
    assert {env.id: env for env in Store(store.root).environments()} == by_id


def test_old_scenario_rows_read_through_the_store(tmp_path):
    gold = (Action(name="get_account", arguments={"account_id": "a"}),)
    scenario = Scenario(
        provenance=PROVENANCE, env_id="env-1", mode="non_conversational", initial_state={"accounts": {}},
        task="t", checklist=("c", "d"), checks=("def check(initial_state, final_state):\n    return True\n",) * 2,
        gold_actions=gold, difficulty="medium", verification=Verification.model_validate(OLD_VERIFICATION),
    )  # fmt: skip
    row = {**to_row(scenario), "verification": json.dumps(OLD_VERIFICATION)}
    assert to_row(scenario)["verification"] == row["verification"]  # the model writes what the dicts wrote
    store = Store(tmp_path / "store")
    store.root.mkdir(parents=True)
    pl.DataFrame([row], schema=schema(Scenario), orient="row").write_parquet(store.root / "scenarios.parquet")
    (back,) = store.scenarios()
    assert back == scenario and back.gold_actions[0].arguments == {"account_id": "a"}
    malformed = {**row, "verification": json.dumps({**OLD_VERIFICATION, "gold": "all good"})}
    with pytest.raises(ValidationError):
        from_row(Scenario, malformed)
