"""Conversational scenarios as trainer episodes (builder/envs/conversation.py and the TRL classes): the
simulated user opens, answers through `reply_to_user`, ends the episode, and voids it when it leaks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.config import SandboxConfig
from builder.envs.conversation import ENDED, REFUSED, Conversation, SimulatedUser, scenario_from_row
from builder.envs.trainer import trl_environment_factories, trl_prompt_row, trl_reward
from builder.errors import BuilderError
from builder.llm import LLMRequestError, ScriptedModel
from builder.records import Action
from builder.rollout.user_sim import STOP
from builder.sandbox.runtime import Sandbox
from tests.fixtures.scenarios import verification

BANK = (Path(__file__).parent / "fixtures" / "envs" / "bank.py").read_text()
ENVIRONMENT = {"env_id": "bank-v0", "code": BANK, "name": "bank", "domain": "finance", "description": "Accounts."}
STATE = {
    "accounts": {
        "acc-1": {"owner": "c1", "balance": 100, "kind": "checking", "frozen": False},
        "acc-2": {"owner": "c1", "balance": 0, "kind": "savings", "frozen": False},
    }
}
TALK = {
    "scenario_id": "scenario-talk", "env_id": "bank-v0", "mode": "conversational",
    "task": "Move 1.00 from acc-1 to acc-2.", "initial_state": json.dumps(STATE), "now": "2024-03-14T10:30:00",
    "user": {"profile": "Cleo, a busy customer.", "known_up_front": "Wants to move money between own accounts.",
             "reveal_when_asked": "From acc-1 to acc-2, 1.00.", "ending": "Stops once the money moved."},
    "checklist": ["The savings account acc-2 holds the moved money"], "difficulty": "easy",
    "checks": ["def check(initial_state, final_state):\n    return final_state['accounts']['acc-2']['balance'] == 100"],
    "gold_actions": [{"name": "transfer", "arguments": json.dumps({"source": "acc-1", "target": "acc-2",
                                                                   "amount": 100})}],
    # A published row carries its verification as JSON text, as export writes it.
    "verification": json.dumps(verification(
        [Action(name="transfer", arguments={"source": "acc-1", "target": "acc-2", "amount": 100})], 1
    ).model_dump(mode="json", by_alias=True)),
}  # fmt: skip
TASK = {**TALK, "scenario_id": "scenario-task", "mode": "non_conversational", "user": None}
FAST = SandboxConfig(call_timeout_s=2, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def user(*replies: str | BaseException) -> SimulatedUser:
    return SimulatedUser(ScriptedModel.sequence(replies), retries=1)


def test_a_conversational_row_is_one_episode_that_the_user_ends(sandbox):
    simulated = user("Hi, I need to move some money.", "From acc-1 to acc-2, 1.00 please.", STOP)
    factories = trl_environment_factories([ENVIRONMENT], [TASK, TALK], sandbox, user=simulated)
    assert sorted(factories) == ["bank-v0", "bank-v0/conversational"]
    assert "reply_to_user" not in vars(factories["bank-v0"])  # task rows never see the user tool

    row = trl_prompt_row(TALK, ENVIRONMENT)
    assert row["environment"] == "bank-v0/conversational"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"] == ""
    assert "reply_to_user" in row["prompt"][0]["content"]
    env = factories[row["environment"]]()
    assert env.reset(**{**TALK, **row}) == "Hi, I need to move some money."  # TRL appends it to the user turn
    assert env.reply_to_user(message="Which accounts, and how much?") == "From acc-1 to acc-2, 1.00 please."
    env.transfer(source="acc-1", target="acc-2", amount=100)
    assert env.reply_to_user(message="Done: 1.00 moved to acc-2.") == ENDED
    # After the user's stop the episode is over, as at `user_stop` in rollouts: nothing more runs.
    assert env.transfer(source="acc-1", target="acc-2", amount=1) == REFUSED
    assert env.reply_to_user(message="Anything else?") == REFUSED
    assert env._live.state()["accounts"]["acc-2"]["balance"] == 100
    completion = [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "reply_to_user", "arguments": {"message": "Done."}}}]}]
    assert trl_reward([completion], [env]) == [1.0]
    # The simulator saw the conversation role-inverted, without tool traffic: its last request ends with the
    # agent's confirmation as the "user" message.
    last = simulated.model.requests[-1].messages
    assert last[-1].role == "user" and last[-1].content == "Done: 1.00 moved to acc-2."
    assert all(message.role != "tool" for message in last)


def test_a_leaking_user_voids_the_episode(sandbox):
    leak = "Just call transfer(source='acc-1', target='acc-2', amount=100)."
    simulated = user("Hi, I need to move some money.", leak, leak)  # the first reply, then the re-ask, both leak
    cls = trl_environment_factories([ENVIRONMENT], [TALK], sandbox, user=simulated)["bank-v0/conversational"]
    env = cls()
    env.reset(**TALK)
    assert env.reply_to_user(message="How can I help?") == ENDED
    assert env._conversation.end_reason == "user_leak" and "transfer" in env._conversation.detail
    assert trl_reward([""], [env]) == [None]  # TRL leaves a None reward out, as pass rates leave out user_leak
    assert env.transfer(source="acc-1", target="acc-2", amount=100) == REFUSED


def test_a_failing_simulator_voids_the_episode_from_the_opening(sandbox):
    cls = trl_environment_factories([ENVIRONMENT], [TALK], sandbox, user=user(LLMRequestError("400: bad")))
    env = cls["bank-v0/conversational"]()
    assert env.reset(**TALK) == ""
    assert env._conversation.end_reason == "user_error" and trl_reward([""], [env]) == [None]
    assert env.reply_to_user(message="Hello?") == REFUSED


def test_conversational_rows_without_a_user_are_refused_with_the_fix():
    with pytest.raises(BuilderError, match="need a simulated user.*SimulatedUser.endpoint.*non_conversational"):
        trl_environment_factories([ENVIRONMENT], [TASK, TALK])
    assert sorted(trl_environment_factories([ENVIRONMENT], [TASK])) == ["bank-v0"]


def test_conversation_and_scenario_rows():
    scenario = scenario_from_row(TALK)
    assert scenario.user is not None and scenario.initial_state == STATE
    assert scenario.gold_actions[0].arguments == {"source": "acc-1", "target": "acc-2", "amount": 100}
    with pytest.raises(ValueError, match="no user script"):
        Conversation(user(), scenario_from_row(TASK), ["transfer"])
    conversation = Conversation(user("Hello there, I need help.", STOP), scenario, ["transfer"])
    assert conversation.open() == "Hello there, I need help." and not conversation.ended
    assert conversation.reply("What do you need?") == ENDED
    assert conversation.end_reason == "user_stop" and not conversation.void


def test_an_environment_tool_named_like_the_user_channel_is_refused():
    code = (
        "class Echo:\n    def __init__(self):\n        self.n = 0\n\n"
        "    def reply_to_user(self, message: str) -> dict:\n"
        '        """Echo a message.\n\n        Args:\n            message: the text\n\n'
        '        Returns:\n            The text.\n        """\n        return {"message": message}\n'
    )
    echo = {**ENVIRONMENT, "env_id": "echo-v0", "code": code}
    with pytest.raises(BuilderError, match="has a tool named reply_to_user"):
        trl_environment_factories([echo], [{**TALK, "env_id": "echo-v0"}], user=user())
