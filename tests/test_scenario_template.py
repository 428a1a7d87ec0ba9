"""The graph method's template wording (`scenarios.wording`): the template's words pass the leak and sufficiency
gates on the fixture environments, model_then_template falls back once every model reply was refused, and
template mode (and the CLI's --wording template) never asks or starts a model. Real sandbox throughout."""

import json
import re

import pytest

from builder.cli import main
from builder.config import load_config
from builder.envs.graph import extract_graph
from builder.envs.signatures import tool_defaults
from builder.llm import ChatRequest, ScriptedModel
from builder.publish.export import build_tables
from builder.records import Rejection, Scenario
from builder.stages.scenarios import scenarios
from builder.stages.scenarios.chains import sample_chains
from builder.stages.scenarios.template import template_request
from builder.stages.scenarios.verbalise import created_values, refusal
from builder.stages.scenarios.verify import default_state
from builder.store import Store
from tests.test_cli_scenarios import BANK, state_file
from tests.test_scenarios_graph import context, evaluated, sandbox  # noqa: F401 - sandbox: a fixture
from tests.test_stage_scenarios import BANK_STATE, NOW, environment

MODES = ("non_conversational", "conversational")
ORDER = {"order_id": "ORD-1", "customer": "Ada Palmer", "item": "green tea", "quantity": 2, "status": "closed"}
STATES = {"bank": None, "library": None, "orders": {"orders": {"ORD-1": ORDER}, "audit": []}}

pytestmark = pytest.mark.usefixtures("restore_logging")  # `main` adds handlers to the builder logger


def copies_the_example() -> ScriptedModel:
    """The 135M smoke model's habit: it answers every wording request with the prompt's example."""

    def answer(request: ChatRequest) -> str:
        return re.findall(r"```json\n(.*?)\n```", request.messages[0].content, re.DOTALL)[-1]

    return ScriptedModel(answer)


def no_model() -> ScriptedModel:
    def answer(request: ChatRequest) -> str:
        raise AssertionError("template wording asked the model")

    return ScriptedModel(answer)


@pytest.mark.parametrize("name", sorted(STATES))
def test_the_template_passes_the_gates_on_many_seeded_chains(sandbox, name):  # noqa: F811
    env = environment(name)
    state = STATES[name] or default_state(sandbox, env.code)
    graph = extract_graph(sandbox, env.code, state, now=NOW, seed=1)
    tools = [tool["function"]["name"] for tool in env.tools]
    parameters = {p for tool in env.tools for p in tool["function"]["parameters"].get("properties", {})}
    chains = [
        chain
        for seed in range(4)
        for chain in sample_chains(sandbox, env.code, graph, state, 4, seed=seed, min_calls=1, now=NOW).chains
    ]
    assert len(chains) >= 8
    for chain in chains:
        created = created_values(chain, NOW)
        said = template_request(env, chain, created, "medium")
        assert refusal(said, created, tools, chain, MODES, env.tools, NOW, tool_defaults(env.code)) is None
        text = " ".join([said.task, said.known_up_front, said.reveal_when_asked, said.user_profile, said.ending])
        assert "_" not in text.replace(env.name, "")  # no tool or parameter identifier
        assert not [name for name in tools + sorted(parameters) if "_" in name and name in text]
        assert not [value for value in created if re.search(rf"(?<![\w-]){re.escape(value)}(?![\w-])", text)]
        for call in chain.calls:  # every value the user must give is stated exactly as the call uses it
            for parameter, value in call.arguments.items():
                if call.sources[parameter] in ("state", "constant") and not isinstance(value, bool):
                    assert str(value) in said.task and str(value) in said.reveal_when_asked
    if name == "orders":
        assert any(created_values(chain, NOW) for chain in chains)  # the case the leak gate is for was tried


def test_the_template_names_each_change_in_words(sandbox):  # noqa: F811
    env = environment("bank")
    state = default_state(sandbox, env.code)
    graph = extract_graph(sandbox, env.code, state, now=NOW, seed=1)
    chain = next(
        c
        for seed in range(10)
        for c in sample_chains(sandbox, env.code, graph, state, 4, seed=seed, min_calls=1, now=NOW).chains
        if any(call.changed and call.name == "transfer" for call in c.calls)
    )
    said = template_request(env, chain, created_values(chain, NOW), "easy")
    transfer = next(call for call in chain.calls if call.changed and call.name == "transfer")
    source, target = transfer.arguments["source"], transfer.arguments["target"]
    assert f"transfer: source {source}, target {target}, amount {transfer.arguments['amount']}" in said.task
    assert said.task.startswith("Hello. Please ") and "move money between two accounts" in said.known_up_front
    assert "amount" not in said.known_up_front  # the goal in general words; the values come when asked
    assert said.difficulty == "easy"


async def test_model_then_template_words_the_slot_once_every_reply_was_refused(tmp_path, sandbox):  # noqa: F811
    model = copies_the_example()
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=2", 'scenarios.wording="model_then_template"',
                  "scenarios.repair_attempts=1", "llm.structured_retries=0")  # fmt: skip
    # three customers: chains stay on one customer's records; the default bank's one would near-duplicate (§11)
    results = await scenarios(evaluated(environment("bank"), [(BANK_STATE, NOW)]), ctx)
    assert [type(r) for r in results] == [Scenario] * 4 and {r.wording for r in results} == {"template"}
    assert len(model.requests) == 4  # two refused replies per slot, then the template
    for record in results:
        assert record.verification.verified and record.verification.negative_control
        assert set(record.verification.repairs) <= {"request_leaks", "task_underspecified", "request_invalid"}
        assert len(record.verification.repairs) == 2
        assert record.provenance.model is None and record.provenance.prompt_version == "template@2"
        assert "acc-1" not in record.task or "Ada" not in record.task  # not the prompt's example
    graph = ctx.stats.report.to_json()["methods"]["graph"]
    assert (graph["verified"], graph["template_worded"], graph["calls"]) == (2, 2, 4)


async def test_model_wording_still_rejects_the_slot_whose_replies_were_refused(tmp_path, sandbox):  # noqa: F811
    ctx = context(tmp_path, copies_the_example(), sandbox, "scenarios.per_environment=1", "scenarios.repair_attempts=0",
                  "llm.structured_retries=0")  # fmt: skip
    (rejection,) = await scenarios(environment("bank"), ctx)
    assert isinstance(rejection, Rejection) and rejection.reason in ("request_leaks", "task_underspecified")
    assert ctx.stats.report.to_json()["methods"]["graph"]["template_worded"] == 0


async def test_template_wording_makes_no_model_call(tmp_path, sandbox):  # noqa: F811
    model = no_model()
    # two customers' orders: chains stay on one customer's records, so one order would give near-duplicate tasks
    other = ORDER | {"order_id": "ORD-2", "customer": "Bo Lindqvist", "item": "oolong", "quantity": 5}
    state = {"orders": {"ORD-1": ORDER, "ORD-2": other}, "audit": []}
    env = evaluated(environment("orders"), [(state, NOW)])
    ctx = context(tmp_path, model, sandbox, "scenarios.per_environment=2", 'scenarios.wording="template"',
                  "scenarios.min_gold_calls=1")  # fmt: skip
    results = await scenarios(env, ctx)
    assert model.requests == [] and ctx.stats.usage.calls == 0
    assert [type(r) for r in results] == [Scenario] * 4 and {r.wording for r in results} == {"template"}
    assert all(r.verification.repairs == () and r.provenance.sampling is None for r in results)
    talk = next(r for r in results if r.mode == "conversational")
    assert talk.user is not None and talk.user.known_up_front.startswith("I would like to ")
    graph = ctx.stats.report.to_json()["methods"]["graph"]
    assert (graph["template_worded"], graph["calls"], graph["prompt_tokens"]) == (2, 0, 0)
    # The wording is stored and published.
    store = Store(tmp_path / "store")
    store.upsert("environments", [env])
    store.upsert("scenarios", results)
    frames = [store.read_frame(name) for name in ("environments", "scenarios", "trajectories", "selections")]
    published = build_tables(*frames, rl_fraction=0)["scenarios"]
    rows = [row for split in published.values() for row in split.to_dicts()]
    assert rows and {row["wording"] for row in rows} == {"template"}
    assert {s.wording for s in store.scenarios()} == {"template"}


def test_the_cli_words_by_template_with_no_model_server(tmp_path, capsys, monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the model was started")

    monkeypatch.setattr("builder.llm.connect.open_llm", started)
    args = ["scenarios", str(BANK), "--state", str(state_file(tmp_path)), "--out", str(tmp_path / "out")]
    assert main([*args, "--profile", "none", "-n", "2", "--wording", "template"]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in (tmp_path / "out" / "scenarios.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {(row["method"], row["wording"]) for row in rows} == {("graph", "template")}
    assert "bank: 2 slots (2 graph)" in captured.err
    assert "graph: 2/2 slots verified, 0.0 model calls" in captured.out and "2 worded by the template" in captured.out


def test_the_cli_refuses_template_wording_with_a_method_that_needs_the_model(tmp_path, capsys):
    args = ["scenarios", str(BANK), "--state", str(state_file(tmp_path)), "--out", str(tmp_path / "out")]
    assert main([*args, "--profile", "none", "--wording", "template", "--method", "both"]) != 0
    assert "the both method needs the model" in capsys.readouterr().err


def test_the_cpu_profile_falls_back_to_the_template_and_the_default_does_not():
    assert load_config(profile="cpu").scenarios.wording == "model_then_template"
    assert load_config().scenarios.wording == load_config(profile="gpu").scenarios.wording == "model"
