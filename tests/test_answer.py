"""The answer check (`builder.envs.answer`): a task that asks to be told something is graded over what the agent
said, with values matched regardless of format; the published reward counts it the same through every path; the
audit and the scenario gate (`answer_not_read`) hold it to the gold's reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import SandboxConfig
from builder.envs.answer import (
    AnswerCheck,
    agent_answer,
    answer_check,
    claims_success,
    declines,
    natural_answer,
    states,
    tool_text,
)
from builder.envs.audit import audit_reward
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.schema import inspect_source
from builder.envs.session import Session
from builder.envs.trainer import LiveEnvironment, trl_environment_factories, trl_reward
from builder.records import Action
from builder.rollout.reward import gold_paths, grade, with_guard
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.verify import verify
from tests.fixtures.scenarios import BANK_CHECKS, BANK_STATE, bank_scenario, environment

pytestmark = pytest.mark.usefixtures("restore_logging")

BANK = Path(__file__).parent / "fixtures" / "envs" / "bank.py"
# "Move 300 cents from acc-1 to acc-2 and tell me acc-2's balance": the gold reads it after the transfer.
GOLD = (
    Action(name="transfer", arguments={"source": "acc-1", "target": "acc-2", "amount": 300}),
    Action(name="get_account", arguments={"account_id": "acc-2"}),
)
TASK = "Move 300 cents from my checking account acc-1 to my savings account acc-2, then tell me acc-2's balance."
FACTS = ("800",)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(call_timeout_s=5.0, kill_grace_s=1.0, memory_mb=256)) as runtime:
        yield runtime


@pytest.mark.parametrize(
    ("answer", "fact", "stated"),
    [
        ("Your booking is on March 14, 2025 at 9:20 AM.", "2025-03-14T09:20:00", True),
        ("Booked: 2025-03-14 09:20", "2025-03-14T09:20", True),
        ("Booked for the 14th of March at 09:20.", "2025-03-14T09:20:00", True),
        ("At 3pm on 3/14/2025.", "2025-03-14T15:00:00", True),
        ("Booked for March 15 at 09:20.", "2025-03-14T09:20:00", False),  # another day
        ("Booked for March 14 at 10:20.", "2025-03-14T09:20:00", False),  # another time
        ("Due March 14, 2024.", "2025-03-14", False),  # another year next to it
        ("The total is $1,250.00.", "1250", True),
        ("The total is 1250.5.", "1250", False),  # numbers compare by value, not by digits
        ("Tags: dual monitor, standing desk.", "dual_monitor", True),
        ("Desk D-522 is free.", "D-522", True),
        ("Riders: María López and Tom.", "Maria Lopez", True),
        ("Riders: Maria and Tom Lopez.", "Maria Lopez", False),  # words must be adjacent, in order
        ("The lot is QUARANTINED.", "quarantined", True),
        ("", "quarantined", False),
    ],
)
def test_a_fact_is_stated_whatever_its_format(answer, fact, stated):
    assert states(answer, fact) is stated


def test_the_answer_is_what_the_agent_said_in_text_or_to_the_user():
    messages = [
        {"role": "user", "content": "What is the balance of acc-2? It is 999, I think."},  # the user's words: not it
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "get_account", "arguments": '{"account_id": "a"}'}}]},
        {"role": "tool", "content": '{"balance": 800}'},  # what the tool said: not it either
        {"role": "assistant", "content": None, "tool_calls": [  # TRL's completions hold arguments as objects
            {"type": "function", "function": {"name": "reply_to_user", "arguments": {"message": "It holds 8.00."}}}]},
        {"role": "assistant", "content": "Anything else?", "tool_calls": [  # verifiers' calls name the tool at the top
            {"id": "2", "name": "reply_to_user", "arguments": '{"message": "Balance: 800 cents."}'}]},
    ]  # fmt: skip
    assert agent_answer(messages) == "It holds 8.00.\nAnything else?\nBalance: 800 cents."


def test_the_answer_counts_beside_the_checks_in_the_published_reward(sandbox):
    checks = checks_from_scenario(with_guard(BANK_CHECKS, gold_paths(sandbox, BANK.read_text(), BANK_STATE, GOLD)))
    done, read = run(sandbox, GOLD)
    ask = AnswerCheck(FACTS)

    def reward(final, answer, seen=read, check=ask):
        return published_reward(sandbox, checks, BANK_STATE, final, check=check, answer=answer, seen=seen)

    assert reward(BANK_STATE, "", "").reward == 0.0  # nothing done, nothing said
    assert reward(done, "acc-2 now holds 800 cents.").solved
    unsaid = reward(done, "Done.")
    assert (unsaid.reward, unsaid.solved, unsaid.answered, unsaid.unstated) == (2 / 3, False, False, ("800",))
    # The right value unread is a guess: it earns nothing, read it is partial credit without the writes.
    assert reward(BANK_STATE, "It holds 800.", seen="").reward == 0.0
    assert reward(BANK_STATE, "It holds 800.", seen='{"balance": 800}').reward == 1 / 3
    # A task that only asks (no check but the guard): the answer decides.
    only_guard = checks[-1:]
    for answer, expected in (("800", 1.0), ("", 0.0)):
        verdict = published_reward(sandbox, only_guard, BANK_STATE, BANK_STATE, check=ask, answer=answer, seen=read)
        assert verdict.reward == expected
    # An infeasible task's answer must decline: a claim of success over an unchanged state earns nothing.
    infeasible = AnswerCheck(("500",), declines=True)
    for answer, expected in (("Done! Moved it; acc-2 had 500.", 0.0), ("I can't: acc-2 holds only 500.", 1.0)):
        verdict = published_reward(sandbox, only_guard, BANK_STATE, BANK_STATE, check=infeasible, answer=answer,
                                   seen='{"balance": 500}')  # fmt: skip
        assert verdict.reward == expected, answer


def test_the_answer_check_is_read_off_the_scenario():
    assert answer_check({"answer_facts": ["800"], "family": "plain", "mode": "conversational"}) == AnswerCheck(
        ("800",)
    )
    assert answer_check({"answer_facts": '["500"]', "family": "infeasible"}).declines
    named = answer_check({"answer_facts": ["amount"], "family": "missing_info", "mode": "non_conversational"})
    assert named == AnswerCheck(("amount",), grounded=False, named=True)  # what the user left out: no tool says it


def test_a_missing_value_is_named_by_its_name_or_its_head_word():
    # teacher-12's one-shot agents: both answers were right and earned 0 when the whole name had to appear
    end_date = answer_check({"answer_facts": ["new end date"], "family": "missing_info", "mode": "non_conversational"})
    said = "I haven't changed it: I need the new last rental day (a date after 2025-07-15) before I can extend it."
    assert end_date.grade(said, seen="") == (True, ())
    months = answer_check({"answer_facts": ["extra months"], "family": "missing_info", "mode": "non_conversational"})
    assert months.grade("Extensions are in whole months; how many more would you like?", seen="")[0]
    assert months.grade("I need the number of month(s) to add.", seen="")[0]
    # naming something else, or only the generic word of the name, is not naming it
    assert not end_date.grade("I need to know the amount you want to pay.", seen="")[0]
    assert not end_date.grade("What new arrangement would you like?", seen="")[0]
    # values to state keep the exact rule: a head word is not the value
    assert not answer_check({"answer_facts": ["new end date"], "family": "plain"}).grade("the date", "new end date")[0]
    assert not answer_check({"family": "plain"}) and answer_check({}).grade("anything", "") == (None, ())
    assert tool_text([{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}]) == "a"


def test_the_same_episode_gets_the_same_reward_through_every_path(sandbox, tmp_path, capsys):
    """Rollout grading, the trainer API, TRL's reward function, OpenEnv, verifiers and the CLI, with and without
    the answer."""
    from builder.adapters.openenv import BuilderEnvironment, MessageAction
    from builder.adapters.verifiers import ScenarioData
    from builder.adapters.verifiers import grade as verifiers_grade

    env = environment("bank")
    checks = with_guard(BANK_CHECKS, gold_paths(sandbox, env.code, BANK_STATE, GOLD))
    scenario = bank_scenario().model_copy(
        update={"task": TASK, "checks": tuple(checks), "answer_facts": FACTS, "gold_actions": GOLD}
    )
    row = json.loads(scenario.model_dump_json()) | {"scenario_id": scenario.id}
    for calls, answer, expected, stated in (
        (GOLD, "Done: acc-2 holds 800 cents now.", 1.0, True), (GOLD, "Done.", 2 / 3, False), ([], "", 0.0, False),
        (GOLD[:1], "Moved; it should be 8.00 dollars, i.e. 800.", 2 / 3, False),  # 800 guessed, never read
    ):  # fmt: skip
        final, seen = run(sandbox, calls)
        rollout = grade(sandbox, checks, BANK_STATE, final, None, now=scenario.now, seed=scenario.seed,
                        check=answer_check(scenario), answer=answer, seen=seen).reward  # fmt: skip

        live = LiveEnvironment(env.model_dump(), row, sandbox)
        live.reset()
        for call in calls:
            live.call(call.name, call.arguments)
        trainer = live.reward(answer)
        live.close()

        trl_env = trl_environment_factories([env.model_dump() | {"env_id": env.id}], [row], sandbox)[env.id]()
        trl_env.reset(scenario_id=scenario.id)
        for call in calls:
            getattr(trl_env, call.name)(**call.arguments)
        completion = [{"role": "assistant", "content": answer}]
        (trl,) = trl_reward([completion], [trl_env])

        openenv = BuilderEnvironment(env.model_dump() | {"env_id": env.id}, [row], sandbox)
        openenv.reset(scenario_id=scenario.id)
        for call in calls:
            openenv.live.call(call.name, call.arguments)
        ended = openenv.step(MessageAction(content=answer))
        assert ended.done

        data = ScenarioData(
            scenario_id=scenario.id, env_id=env.id, code=env.code, initial_state=BANK_STATE, checks=checks,
            answer_facts=list(FACTS), now=scenario.now,
        )  # fmt: skip
        verifiers = verifiers_grade(data, final, answer, seen)

        (tmp_path / "s.json").write_text(scenario.model_dump_json())
        (tmp_path / "c.json").write_text(json.dumps([call.model_dump() for call in calls]))
        capsys.readouterr()
        code = main(["reward", str(BANK), "--scenario", str(tmp_path / "s.json"), "--calls", str(tmp_path / "c.json"),
                     "--answer", answer, "--json", "--profile", "none"])  # fmt: skip
        cli = json.loads(capsys.readouterr().out)
        assert code == 0 and cli["answer"]["passed"] is stated
        got = (rollout, trainer, trl, ended.reward, verifiers, cli["reward"])
        assert got == (expected,) * 6, (calls, answer, got)


def test_the_audit_grades_the_gold_with_its_answer_said_plainly_and_in_words(sandbox):
    tools = inspect_source(BANK.read_text()).tools
    guarded = with_guard(BANK_CHECKS, gold_paths(sandbox, BANK.read_text(), BANK_STATE, GOLD))
    audit = audit_reward(sandbox, BANK.read_text(), BANK_STATE, guarded, GOLD, tools,
                         check=AnswerCheck(("800", "acc-2")))  # fmt: skip
    assert audit.reason is None, audit
    assert audit.outcomes["spelling"] == "pass" and audit.rewards["spelling"] == 1.0  # said as "800", "acc 2"
    assert natural_answer(["2025-03-14T09:20:00", "1250", "dual_monitor"]) == (
        "All set: March 14, 2025 at 9:20 AM; 1,250; dual monitor"
    )


def test_a_fact_no_gold_call_returns_or_the_user_says_is_refused(sandbox):
    code = BANK.read_text()
    texts = {"non_conversational": TASK}

    def reason(facts, actions=GOLD):
        evidence = verify(sandbox, code, BANK_STATE, actions, list(BANK_CHECKS), texts=texts, facts=facts)
        return evidence.reason, evidence.gold_problems

    assert reason(FACTS)[0] is None
    unread, problems = reason(FACTS, GOLD[:1])  # the transfer alone never shows the balance
    assert unread == "answer_not_read" and "'800'" in problems[0] and "no call of the solution" in problems[0]
    said, problems = reason(("acc-2",))  # the user names the account: stating it proves nothing
    assert said == "answer_not_read" and "the user already says it" in problems[0]
    assert reason(("999",))[0] == "answer_not_read"  # a value the environment never returned


def run(sandbox, calls) -> tuple[dict, str]:
    """The final state and what the calls returned."""
    with Session(sandbox, BANK.read_text(), BANK_STATE) as session:
        seen = [session.call(call.name, call.arguments).content() for call in calls]
        return session.snapshot(), "\n".join(seen)


def test_a_decline_must_rest_on_what_was_read_not_on_repeating_it():
    # teacher-12's review: a right refusal without the start date earned 0; one made up around the number got 1.0
    infeasible = answer_check({"answer_facts": ["2025-06-02"], "family": "infeasible", "mode": "non_conversational"})
    read = '{"rental_id": "R-3", "start_date": "2025-06-02", "status": "active"}'
    assert infeasible.grade("Sorry, I can't cancel it: the rental has already started.", seen=read) == (True, ())
    assert not infeasible.grade("Sorry, I can't cancel it: the rental has already started.", seen="")[0]  # no look
    assert not infeasible.grade("Done, it is cancelled.", seen=read)[0]  # claims success


def test_cents_are_stated_as_a_currency_amount():
    total = answer_check({"answer_facts": ["70600"], "family": "plain", "mode": "conversational"})
    seen = '{"total_cents": 70600}'
    for said in ("The new total is $706.00.", "That comes to 706 dollars.", "Total: 70,600 cents", "€706"):
        assert total.grade(said, seen)[0], said
    assert not total.grade("The new total is 706.", seen)[0]  # a bare number is not money
    assert not answer_check({"answer_facts": ["12"]}).grade("$0.12", "12")[0]  # small numbers are not cents


def test_asking_for_the_kind_of_value_names_it():
    def asked(fact: str, said: str) -> bool:
        return answer_check({"answer_facts": [fact], "family": "missing_info", "mode": "non_conversational"}).grade(
            said, seen=""
        )[0]

    assert asked("new date", "Which day should we move it to?")
    assert asked("extra months", "How long would you like to keep it?")
    assert asked("payment amount", "How much would you like to pay?")
    # teacher-13: offering the open dates to choose from asks for the date
    assert asked("date", "The centre has two open slots: Tuesday, 18 February at 16:00 and 4 March. Which one?")
    assert asked("date", "Open slots: 2025-02-18 16:00 and 2025-03-04 09:00. Which would you like?")
    assert not asked("new date", "How much would you like to pay?")
    assert not asked("extra months", "Which day should we move it to?")
    assert not asked("date", "You may want to check back later.")  # "may" is no month here


def test_an_answer_that_must_decline_or_ask_must_not_claim_success():
    # teacher-13's review: no calls and "Done! I have updated the email" named the missing value and earned 1.0
    email = answer_check({"answer_facts": ["new email"], "family": "missing_info", "mode": "non_conversational"})
    assert not email.grade("Done! I have updated the email on your guest profile.", seen="")[0]
    assert email.grade("Which address should I switch it to? Nothing has been changed yet.", seen="")[0]
    infeasible = answer_check({"answer_facts": ["2008-03-01"], "family": "infeasible", "mode": "non_conversational"})
    read = '{"birth_date": "2008-03-01"}'
    assert not infeasible.grade("You are booked for Feb 18 at 4pm. I can't send a reminder though.", read)[0]
    assert infeasible.grade("Sorry, you are not eligible yet: donors must be 17. I haven't booked anything.", read)[0]
    assert infeasible.grade("That class is full, so I haven't changed your booking.", read)[0]  # a full class
    assert not claims_success("No changes have been made and nothing has been updated.")
    assert declines("Unfortunately that slot is gone.") and claims_success("All set.")  # a cue opening the answer
    assert claims_success("All set: your city has been updated to Melbourne.")
