"""The OpenEnv adapter (builder/adapters/openenv.py) against the real `openenv` package: one episode per mode
of a release's `rl` split, tools through MCP actions, over `step` in process and over OpenEnv's HTTP server."""

from __future__ import annotations

import json
import time

import pytest

from builder.adapters.openenv import BuilderEnvironment, BuilderObservation, MessageAction
from builder.envs.conversation import REFUSED, SimulatedUser
from builder.errors import BuilderError
from builder.llm import ScriptedModel
from builder.sandbox.runtime import Sandbox
from tests.fixtures.e2e_release import DUE, OPENING, REVEAL, build_release, load_split
from tests.fixtures.teacher import GOLD, teacher

openenv = pytest.importorskip("openenv")
from openenv.core.env_server import CallToolAction, ListToolsAction, create_fastapi_app  # noqa: E402


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("release"))


@pytest.fixture(scope="module")
def rows(release, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf")
    (environment,) = load_split(release, "environments", "rl", cache)
    scenarios = {row["mode"]: row for row in load_split(release, "scenarios", "rl", cache)}
    return environment, scenarios


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox() as runtime:
        yield runtime


def call(env, name, arguments):
    observation = env.step(CallToolAction(tool_name=name, arguments=arguments))
    assert observation.error is None and not observation.done
    return observation.result.content[0].text


def test_one_episode_per_mode(rows, sandbox):
    environment, scenarios = rows
    env = BuilderEnvironment(environment, scenarios.values(), sandbox, user=SimulatedUser(ScriptedModel(teacher)))
    started = time.monotonic()

    # The tools over MCP carry the published schemas.
    listed = env.step(ListToolsAction())
    published = {tool["function"]["name"]: tool["function"] for tool in json.loads(environment["tools"])}
    assert {tool.name: tool.input_schema for tool in listed.tools} == {
        name: function["parameters"] for name, function in published.items()
    }

    task = scenarios["non_conversational"]
    first = env.reset(scenario_id=task["scenario_id"])
    assert isinstance(first, BuilderObservation) and not first.done
    assert [m["role"] for m in first.messages] == ["system", "user"] and first.messages[1]["content"] == task["task"]
    assert [t["function"]["name"] for t in first.tools] == list(published)
    for action in GOLD:
        assert "Error" not in call(env, action["name"], action["arguments"])
    assert env.state.scenario_id == task["scenario_id"] and env.state.step_count == 3
    last = env.step(MessageAction(content="Done: b3 is lent to m2."))
    assert (last.done, last.reward, last.metadata["end_reason"]) == (True, 1.0, "agent_done")
    assert call(env, "get_book", {"book_id": "b3"}) == REFUSED  # the episode is over

    talk = scenarios["conversational"]
    first = env.reset(scenario_id=talk["scenario_id"])
    assert first.messages[1] == {"role": "user", "content": OPENING} and "plain text" in first.messages[0]["content"]
    answer = env.step(MessageAction(content="Could you give me your member id, the book and the return date?"))
    assert answer.messages == [{"role": "user", "content": REVEAL}] and not answer.done
    for action in GOLD:
        call(env, action["name"], action["arguments"])
    last = env.step(MessageAction(content=f"Done: book b3 is lent to you until {DUE}."))
    assert (last.done, last.reward, last.metadata["end_reason"]) == (True, 1.0, "user_stop")
    assert env.state.end_reason == "user_stop"
    env.close()
    print(f"two OpenEnv episodes: {time.monotonic() - started:.1f} s")


def test_a_wrong_due_date_scores_half_and_reset_picks_scenarios(rows, sandbox):
    environment, scenarios = rows
    task = scenarios["non_conversational"]
    env = BuilderEnvironment(environment, [task], sandbox)
    assert env.reset(seed=7).messages[1]["content"] == task["task"]  # seed picks among the scenarios
    for action in GOLD[:2]:
        call(env, action["name"], action["arguments"])
    call(env, "borrow_book", {**GOLD[2]["arguments"], "due": "2024-07-30"})
    assert env.step(MessageAction(content="Done.")).reward == 0.5
    with pytest.raises(BuilderError, match="unknown scenario"):
        env.reset(scenario_id="scenario-nope")
    with pytest.raises(BuilderError, match="need a simulated user"):
        BuilderEnvironment(environment, scenarios.values(), sandbox)
    with pytest.raises(BuilderError, match="at least one scenario"):
        BuilderEnvironment(environment, [], sandbox)


def test_served_by_openenv_over_a_websocket_session(rows, sandbox):
    """OpenEnv's own FastAPI server runs the environment: one episode over its `/ws` session protocol."""
    from fastapi.testclient import TestClient

    environment, scenarios = rows
    task = scenarios["non_conversational"]
    app = create_fastapi_app(lambda: BuilderEnvironment(environment, [task], sandbox), MessageAction,
                             BuilderObservation)  # fmt: skip
    with TestClient(app) as client, client.websocket_connect("/ws") as ws:
        ws.send_text(json.dumps({"type": "reset", "data": {"scenario_id": task["scenario_id"]}}))
        reset = json.loads(ws.receive_text())
        assert reset["type"] == "observation", reset
        assert reset["data"]["observation"]["messages"][1]["content"] == task["task"]
        ws.send_text(json.dumps({"type": "step", "data": {"content": "I cannot help with that."}}))
        last = json.loads(ws.receive_text())["data"]
        assert (last["done"], last["reward"]) == (True, 0.0)  # nothing was lent: no check passes
