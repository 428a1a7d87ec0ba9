"""The one re-ask loop (`builder.llm.reask`) and the stage helpers on it (`builder.stages._llm`): feedback,
bounded conversations, fresh samples per attempt, rejections, prompt shrinking, and the model protocol."""

from __future__ import annotations

import inspect
import json

import pytest
from pydantic import BaseModel

from builder.config import EvaluateConfig, load_config
from builder.llm import (
    ChatRequest,
    LLMClient,
    PromptTooLongError,
    ResponseCache,
    ScriptedModel,
    StageModel,
    text_reply,
)
from builder.llm.connect import client_for
from builder.llm.reask import NoUsableReply, Refusal, reask, reask_each
from builder.pipeline import LazyModel
from builder.records import ChatMessage, Sampling, Topic
from builder.run.stage import Rejected, StageContext
from builder.stages._llm import ask, repaired, shrinking, system_user
from builder.stages.evaluate.agents import Agents, InvalidReply
from builder.stats import StageStats

SEED = 7
SAMPLING = Sampling(temperature=0.7, max_tokens=512, seed=SEED)


class Schedule(BaseModel):
    name: str
    opens: str
    closes: str
    notes: list[str]


GOOD = {
    "name": "front desk",
    "opens": "08:00",
    "closes": "17:30",
    "notes": ["Closed on public holidays.", "Late returns go through the drop box by the main entrance."],
}
# What a capable model sends: its reasoning first, then pretty-printed JSON.
THINK = "<think>\nThe desk needs opening hours. Opening before closing, both HH:MM. Let me write it out.\n</think>\n\n"


def capable(value: dict) -> str:
    return THINK + json.dumps(value, indent=2)


def topic() -> Topic:
    return Topic(provenance={"config_hash": "h"}, name="desk", description="A front desk.", domain="office")


def context(tmp_path, model: ScriptedModel, *overrides: str, cache: bool = False, **client) -> StageContext:
    config = load_config(None, list(overrides))
    store = ResponseCache(tmp_path / "cache.sqlite") if cache else None
    llm = client_for(config.llm, model, model_id="m", cache=store, **client)
    return StageContext(config, "h", tmp_path, StageStats("plan"), llm=llm)


ASKED = system_user("You plan opening hours.", "Plan the front desk's hours.")


def hours_ask(ctx: StageContext):
    """A stage's `ask_once`: the schedule must open before it closes."""

    async def ask_once(conversation: list[ChatMessage], attempt: int) -> Schedule | Refusal:
        schedule = await ask(
            ctx, topic(), conversation, Schedule, sampling=SAMPLING, invalid_reason="hours_malformed", attempt=attempt
        )
        if schedule.opens < schedule.closes:
            return schedule
        problem = f"opens at {schedule.opens}, after it closes at {schedule.closes}"
        feedback = f"That schedule has a problem: {problem}. Answer again with the whole corrected JSON object."
        return Refusal("hours_invalid", problem, feedback, shown=schedule.model_dump_json())

    return ask_once


# ------------------------------------------------------------------------------------------------ the loop


async def test_a_refused_reply_then_a_good_one_is_accepted_on_attempt_two_as_fresh_samples(tmp_path):
    backwards = {**GOOD, "opens": "18:00"}
    model = ScriptedModel.sequence([capable(backwards), capable(GOOD)])
    ctx = context(tmp_path, model, "llm.structured_retries=2", cache=True)
    schedule = await repaired(ctx, topic(), ASKED, hours_ask(ctx), attempts=3)
    assert schedule == Schedule.model_validate(GOOD)
    first, second = model.requests
    # Attempt 1 of the stage's loop asks through `structured` (3 samples per attempt): sample 3, seed + 3.
    assert (first.sample_index, second.sample_index) == (0, 3)
    assert (first.sampling.seed, second.sampling.seed) == (SEED, SEED + 3)
    assert first.cache_key("m") != second.cache_key("m")
    # The re-ask is the prompt, the refused reply (as parsed: no reasoning) and the feedback.
    assert second.messages[:2] == first.messages == tuple(ASKED)
    assert second.messages[2] == ChatMessage(role="assistant", content=Schedule(**backwards).model_dump_json())
    assert "opens at 18:00, after it closes at 17:30" in second.messages[3].content
    assert "<think>" not in json.dumps([m.model_dump() for m in second.messages])


async def test_a_malformed_reply_then_a_good_one_is_repaired_inside_structured(tmp_path):
    cut = THINK + json.dumps(GOOD, indent=2)[:60]  # a reply cut off mid-JSON
    model = ScriptedModel.sequence([cut, capable(GOOD)])
    ctx = context(tmp_path, model, cache=True)
    assert await repaired(ctx, topic(), ASKED, hours_ask(ctx), attempts=2) == Schedule.model_validate(GOOD)
    first, second = model.requests
    assert [r.sample_index for r in model.requests] == [0, 1]
    assert [r.sampling.seed for r in model.requests] == [SEED, SEED + 1]
    assert first.cache_key("m") != second.cache_key("m")
    assert second.messages[2].content == json.dumps(GOOD, indent=2)[:60]
    assert "not valid" in second.messages[3].content


async def test_exhausted_attempts_are_a_rejection_with_the_last_raw_reply_and_no_growing_conversation(tmp_path):
    replies = [capable({**GOOD, "opens": f"2{hour}:00"}) for hour in range(3)]
    model = ScriptedModel.sequence(replies)
    ctx = context(tmp_path, model, cache=True)
    with pytest.raises(Rejected) as verdict:
        await repaired(ctx, topic(), ASKED, hours_ask(ctx), attempts=3)
    rejection = verdict.value.rejection
    assert (rejection.reason, rejection.subject_id) == ("hours_invalid", topic().id)
    assert rejection.detail == "opens at 22:00, after it closes at 17:30"
    assert json.loads(rejection.raw_output)["opens"] == "22:00"
    assert [len(r.messages) for r in model.requests] == [2, 4, 4]  # the prompt plus only the latest exchange
    assert '"21:00"' in model.requests[2].messages[2].content and "20:00" not in str(model.requests[2].messages)
    assert len({r.cache_key("m") for r in model.requests}) == 3


async def test_a_repeated_refused_reply_is_asked_again_not_answered_from_the_cache(tmp_path):
    backwards = capable({**GOOD, "opens": "18:00"})
    model = ScriptedModel.sequence([backwards, backwards, capable(GOOD)])
    ctx = context(tmp_path, model, cache=True)
    # The second and third requests have the same messages (the same refused reply shown back): only their
    # sample index and seed tell them apart.
    assert await repaired(ctx, topic(), ASKED, hours_ask(ctx), attempts=3) == Schedule.model_validate(GOOD)
    assert model.requests[1].messages == model.requests[2].messages
    assert len(model.requests) == 3


async def test_reask_passes_what_ask_once_raises_and_refuses_zero_attempts():
    async def broken(conversation, sample):
        raise RuntimeError("server said no")

    with pytest.raises(RuntimeError, match="server said no"):
        await reask(ASKED, broken, attempts=2)
    with pytest.raises(ValueError, match="at least 1"):
        await reask(ASKED, broken, attempts=0)


async def test_samples_nest_so_an_outer_attempt_never_reuses_an_inner_sample():
    seen = []

    async def refuse(conversation, sample):
        seen.append(sample)
        return Refusal("no", "no", "again")

    for outer in range(3):
        with pytest.raises(NoUsableReply):
            await reask(ASKED, refuse, attempts=2, attempt=outer)
    assert seen == [0, 1, 2, 3, 4, 5]


async def test_reask_each_asks_only_the_refused_prompts_and_lets_a_judge_refuse_them_together():
    asked = {"a": system_user("s", "write a"), "b": system_user("s", "write b")}
    calls = []
    versions = {"a": iter(["a1", "a2"]), "b": iter(["b1"])}

    async def write(key, conversation, sample):
        calls.append((key, len(conversation), sample))
        return next(versions[key])

    async def judge(answers):  # "a1" does not fit with "b1"
        return {"a": Refusal("clash", "a1 clashes with b1", "fix a", shown="a1")} if answers["a"] == "a1" else {}

    answers = await reask_each(asked, write, attempts=3, judge=judge)
    assert answers == {"a": "a2", "b": "b1"}
    assert calls == [("a", 2, 0), ("b", 2, 0), ("a", 4, 1)]

    calls.clear()
    versions["b"] = iter(["b2"])
    refused = {"b": Refusal("broken", "b1 raised", "fix b", shown="b1")}
    assert await reask_each(asked, write, attempts=2, attempt=1, refused=refused) == {"b": "b2"}
    assert calls == [("b", 4, 2)]  # only the refused piece, with its feedback, as repair 1's first sample


# --------------------------------------------------------------------------------------- prompt shrinking


def counting_model(answer) -> ScriptedModel:
    """A model whose prompt sizes the client measures: one token per 4 characters of the messages."""
    return ScriptedModel(answer, prompt_tokens=lambda request: sum(len(m.content or "") for m in request.messages) // 4)


def sized_ask(ctx: StageContext):
    """`ask` with a user message of `size` characters."""

    async def at(size: int) -> Schedule:
        messages = system_user("You plan opening hours.", "x" * size)
        return await ask(ctx, topic(), messages, Schedule, sampling=SAMPLING, invalid_reason="hours_malformed")

    return at


async def test_a_prompt_too_long_is_built_smaller_and_then_answered(tmp_path):
    model = counting_model(lambda request: capable(GOOD))
    ctx = context(tmp_path, model, "llm.max_model_len=2048")
    assert await shrinking(ctx, "desk_hours", [12000, 6000, 3000], sized_ask(ctx)) == Schedule.model_validate(GOOD)
    assert ctx.stats.report.to_json()["prompt_shrunk"] == {"desk_hours": 1}
    (sent,) = model.requests  # the prompt of 12000 characters was measured, never sent
    assert len(sent.messages[1].content) == 6000


async def test_a_prompt_too_long_at_the_smallest_size_is_a_prompt_too_long_rejection(tmp_path):
    model = counting_model(lambda request: capable(GOOD))
    ctx = context(tmp_path, model, "llm.max_model_len=512")
    with pytest.raises(Rejected) as verdict:
        await shrinking(ctx, "desk_hours", [12000, 6000, 3000], sized_ask(ctx))
    assert verdict.value.rejection.reason == "prompt_too_long" and "context tokens" in verdict.value.rejection.detail
    assert ctx.stats.report.to_json()["prompt_shrunk"] == {"desk_hours": 2}
    assert model.requests == []


async def test_shrinking_passes_other_rejections_and_raw_prompt_too_long_errors(tmp_path):
    ctx = context(tmp_path, ScriptedModel(lambda request: "unused"))
    sizes = []

    async def refused(size):
        sizes.append(size)
        raise Rejected(ctx.reject(topic(), "hours_invalid", "no"))

    with pytest.raises(Rejected, match="hours_invalid"):
        await shrinking(ctx, "desk_hours", [3, 2, 1], refused)
    assert sizes == [3] and "prompt_shrunk" not in ctx.stats.report

    async def too_long(size):
        raise PromptTooLongError("too long", prompt_tokens=9000, context_tokens=4096, min_completion=256)

    with pytest.raises(PromptTooLongError):
        await shrinking(ctx, "evaluate_state", [3, 2, 1], too_long)
    assert ctx.stats.report.to_json()["prompt_shrunk"] == {"evaluate_state": 2}


# ------------------------------------------------------------------------- evaluate's agents on the loop


def agents(model: ScriptedModel, retries: int) -> Agents:
    client = LLMClient(model, model_id="m")
    return Agents(client, EvaluateConfig(), retries=retries, seed=SEED)


async def test_ask_json_shows_only_the_latest_reply_and_asks_each_attempt_as_a_new_sample():
    # The bug this loop had: every failed reply stayed in the conversation, and all attempts shared one sample.
    model = ScriptedModel.sequence([capable({**GOOD, "opens": f"2{hour}:00"}) for hour in range(3)] + [capable(GOOD)])
    team = agents(model, retries=3)

    async def opens_first(schedule: Schedule) -> str | None:
        return None if schedule.opens < schedule.closes else f"opens at {schedule.opens}, after closing"

    messages = system_user("You write test states.", "Write test state 3.")
    schedule = await team.ask_json(messages, Schedule, "state", sample_index=2, accept=opens_first)
    assert schedule == Schedule.model_validate(GOOD)
    assert [len(r.messages) for r in model.requests] == [2, 4, 4, 4]
    assert [r.sample_index for r in model.requests] == [2, 3, 4, 5]
    assert [r.sampling.seed for r in model.requests] == [SEED, SEED + 1, SEED + 2, SEED + 3]
    last = model.requests[-1].messages
    assert last[:2] == tuple(messages) and '"22:00"' in last[2].content and "opens at 22:00" in last[3].content
    assert team.usage.calls == 4


async def test_ask_json_gives_up_with_the_last_raw_reply():
    model = ScriptedModel(lambda request: THINK + '{"name": "front desk", "opens": 8')
    with pytest.raises(InvalidReply) as caught:
        await agents(model, retries=1).ask_json(system_user("s", "u"), Schedule, "checker")
    assert caught.value.kind == "checker_invalid" and caught.value.raw == '{"name": "front desk", "opens": 8'
    assert len(model.requests) == 2


async def test_the_tester_is_re_asked_with_the_feedback_alone_as_fresh_samples():
    from builder.records import Environment
    from builder.stages.evaluate.agents import TesterCalls

    env = Environment(
        provenance={"config_hash": "h"}, plan_id="p", name="desk", class_name="DeskEnv", description="A desk.",
        domain="office", code='"""A desk."""\n', tools=[], state_schema={},
    )  # fmt: skip
    tools = [{"type": "function", "function": {"name": "open_desk", "parameters": {"type": "object"}}}]
    reply = '{"calls": [{"call": 1, "tool": "open_desk", "arguments": {}}]}'
    model = ScriptedModel.sequence([text_reply("I would open the desk."), text_reply(reply)])
    tester = agents(model, retries=2)
    proposed = await tester.ask_json(tester.tester_messages(env, tools, "facts"), TesterCalls, "tester")
    assert [(c.tool, c.arguments) for c in proposed.calls] == [("open_desk", {})]
    first, second = model.requests
    assert [r.sample_index for r in model.requests] == [0, 1] and second.sampling.seed == SEED + 1
    assert second.messages[:2] == first.messages and len(second.messages) == 4
    assert "cannot be used" in second.messages[3].content


# ------------------------------------------------------------------------------------------ the protocol


async def test_the_clients_stages_get_are_stage_models_and_forward_the_attempt(tmp_path):
    config = load_config(None, [])
    model = ScriptedModel.sequence(['{"name": "x"', capable(GOOD)])
    client = client_for(config.llm, model, model_id="m")
    lazy = LazyModel(config.llm, lambda on_call: client)
    assert isinstance(client, StageModel) and isinstance(lazy, StageModel)
    wanted = inspect.signature(StageModel.structured).parameters
    assert list(inspect.signature(LLMClient.structured).parameters) == list(wanted)
    schedule = await lazy.structured(ASKED, Schedule, sampling=SAMPLING, attempt=1)
    assert schedule == Schedule.model_validate(GOOD)
    stride = config.llm.structured_retries + 1
    assert [r.sample_index for r in model.requests] == [stride, stride + 1]


def test_resampled_moves_the_sample_index_and_a_set_seed_only():
    request = ChatRequest(messages=tuple(ASKED), sampling=SAMPLING, sample_index=2)
    assert request.resampled(0) == request
    again = request.resampled(3, ASKED[:1])
    assert (again.sample_index, again.sampling.seed, again.messages) == (5, SEED + 3, tuple(ASKED[:1]))
    unseeded = ChatRequest(messages=tuple(ASKED)).resampled(1)
    assert (unseeded.sample_index, unseeded.sampling.seed) == (1, None)
