"""The agent loop, the user simulator, rewards and the rollout stage, with scripted models over fixture envs."""

import json

import pytest
from llm_stub import StubServer, completion

from builder.config import SandboxConfig, load_config
from builder.envs.guard import collateral
from builder.llm import ChatRequest, LLMRequestError, ScriptedModel, tool_reply
from builder.llm.connect import client_for
from builder.records import Action, Environment, Rejection, Sampling, Trajectory
from builder.reports import RolloutReport
from builder.rollout.episode import Limits, run_episode
from builder.rollout.user_sim import STOP, UserSimulator, leak_problem
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.rollout import rollout
from builder.stats import StageStats
from tests.fixtures.run_tables import write_stage
from tests.fixtures.scenarios import bank_scenario, environment, library_scenario

FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)
TRANSFER = ("transfer", {"source": "acc-1", "target": "acc-2", "amount": 300})


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def is_user_request(request: ChatRequest) -> bool:
    return not request.tools


def tool_results(request: ChatRequest) -> list[str]:
    return [m.content for m in request.messages if m.role == "tool"]


def agent(plan, user=None):
    """A scripted agent: `plan[i]` answers its i-th call after the last user message (a reply or a string)."""

    def answer(request: ChatRequest):
        if is_user_request(request):
            return user(request) if user else AssertionError("no user expected")
        last_user = max(i for i, m in enumerate(request.messages) if m.role == "user")
        step = sum(1 for m in request.messages[last_user:] if m.role == "assistant")
        return plan[min(step, len(plan) - 1)]

    return ScriptedModel(answer)


def context(tmp_path, sandbox, model, *overrides):
    config = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'store'))}", *overrides])
    write_stage(tmp_path, "evaluate", [environment("bank"), environment("library")])
    llm = client_for(config.llm, model, model_id="agent")
    return StageContext(
        config, "hash", tmp_path, StageStats("rollout", report=RolloutReport()), llm=llm, open_sandbox=lambda: sandbox,
        needs={Environment: "evaluate"},
    )  # fmt: skip


async def run(tmp_path, sandbox, model, scenario=None, *overrides):
    ctx = context(tmp_path, sandbox, model, "rollout.samples_per_scenario=1", *overrides)
    (trajectory,) = await rollout(scenario or bank_scenario(), ctx)
    return trajectory


def assert_well_formed(trajectory: Trajectory):
    """Every tool call has exactly one tool answer, in order, right after its assistant message."""
    pending: list[str] = []
    for message in trajectory.messages:
        if message.role == "tool":
            assert pending and message.tool_call_id == pending.pop(0)
        else:
            assert not pending, "a tool call went unanswered"
            pending = [call.id for call in message.tool_calls or ()]
    assert not pending


async def test_solved_episode_is_graded(tmp_path, sandbox):
    model = agent([tool_reply(TRANSFER), "Done: moved 300 cents."])
    trajectory = await run(tmp_path, sandbox, model)
    assert (trajectory.solved, trajectory.reward, trajectory.end_reason) == (True, 1.0, "agent_done")
    assert trajectory.checks_passed == (True, True, True)  # the task's two checks and the guard
    assert (trajectory.num_turns, trajectory.num_tool_calls, trajectory.tool_errors) == (2, 1, 0)
    assert trajectory.flags == () and trajectory.collateral == ()
    assert [m.role for m in trajectory.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[1].content == bank_scenario().task
    assert json.loads(trajectory.messages[3].content) == {"success": True, "transfer_id": "t1"}
    assert trajectory.usage.calls == 2 and trajectory.usage.prompt_tokens > 0
    assert trajectory.provenance.parent_ids[0] == bank_scenario().id
    request = model.requests[0]
    assert (request.tool_choice, request.parallel_tool_calls) == ("auto", True)
    assert {t["function"]["name"] for t in request.tools} >= {"transfer", "get_account"}
    assert_well_formed(trajectory)


async def test_unsolved_episode_gets_partial_or_zero_reward(tmp_path, sandbox):
    wrong_amount = ("transfer", {"source": "acc-1", "target": "acc-2", "amount": 200})
    trajectory = await run(tmp_path, sandbox, agent([tool_reply(wrong_amount), "Done."]))
    assert (trajectory.solved, trajectory.reward, trajectory.checks_passed) == (False, 0.0, (False, False, True))
    nothing = await run(tmp_path, sandbox, agent(["I cannot help with that."]))
    assert (nothing.solved, nothing.reward, nothing.num_tool_calls, nothing.end_reason) == (False, 0, 0, "agent_done")


async def test_malformed_and_unknown_tool_calls_get_error_messages_and_flags(tmp_path, sandbox):
    plan = [
        tool_reply(("transfer", '{"source": "acc-1", "target": ')),
        tool_reply(("teleport_money", {"amount": 300})),
        tool_reply(("transfer", {"source": "acc-1", "target": "acc-2", "amount": "300"})),
        tool_reply(TRANSFER),
        "Done.",
    ]
    trajectory = await run(tmp_path, sandbox, agent(plan))
    tools = [m.content for m in trajectory.messages if m.role == "tool"]
    assert tools[0].startswith("Error: ") and "not valid JSON" in tools[0]
    assert "unknown tool 'teleport_money'" in tools[1]
    assert tools[2].startswith("Error: ") and "amount" in tools[2]
    assert trajectory.solved and trajectory.tool_errors == 3
    assert set(trajectory.flags) == {"malformed_call", "unknown_tool"}
    assert_well_formed(trajectory)


async def test_parallel_calls_each_get_their_answer(tmp_path, sandbox):
    both = tool_reply(("get_account", {"account_id": "acc-1"}), TRANSFER)
    trajectory = await run(tmp_path, sandbox, agent([both, "Done."]))
    assert trajectory.solved and trajectory.num_tool_calls == 2
    assert [m.tool_call_id for m in trajectory.messages if m.role == "tool"] == ["call_0", "call_1"]
    assert_well_formed(trajectory)


async def test_endless_tool_loop_is_cut_by_the_limits(tmp_path, sandbox):
    loop = agent([tool_reply(("get_account", {"account_id": "acc-1"}), ("get_account", {"account_id": "acc-2"}))])
    cut = await run(tmp_path, sandbox, loop, None, "rollout.max_tool_calls=5", "rollout.max_turns=50")
    assert (cut.end_reason, cut.num_tool_calls, cut.solved) == ("max_tool_calls", 5, False)
    assert cut.messages[-1].content.startswith("Error: the tool-call limit")  # the 6th call is answered, not run
    assert_well_formed(cut)
    turns = await run(tmp_path, sandbox, loop, None, "rollout.max_turns=3")
    assert (turns.end_reason, turns.num_turns) == ("max_turns", 3)
    tokens = await run(tmp_path, sandbox, loop, None, "rollout.max_tokens=60", "rollout.max_turns=50")
    assert tokens.end_reason == "max_tokens" and tokens.num_turns < 50


async def test_collateral_writes_are_flagged_and_zero_the_reward(tmp_path, sandbox):
    # The fixture scenario predates the guard: rollout derives it from the gold, as `python -m builder reward` does.
    plan = [tool_reply(TRANSFER, ("freeze_account", {"account_id": "acc-3"})), "Done."]
    zeroed = await run(tmp_path, sandbox, agent(plan))
    assert zeroed.collateral == ("accounts.acc-3.frozen",) and "collateral" in zeroed.flags
    assert (zeroed.reward, zeroed.solved, zeroed.checks_passed) == (0.0, False, (True, True, False))
    assert zeroed.check_fraction == pytest.approx(2 / 3)


def test_collateral_paths_cover_parents_and_children():
    allowed = ["accounts.acc-1.balance", "transfers"]
    before = {"accounts": {"acc-1": {"balance": 1}, "acc-2": {"balance": 1}, "acc-10": {"balance": 1}},
              "transfers": [{"memo": ""}]}  # fmt: skip
    after = {"accounts": {"acc-1": {"balance": 0, "note": "x"}, "acc-2": {"balance": 2}, "acc-10": {"balance": 0}},
             "transfers": [{"memo": "rent"}]}  # fmt: skip
    # A field added to a record the gold only changed the balance of is collateral too; a memo of a new transfer is not.
    expected = ["accounts.acc-1.note", "accounts.acc-10.balance", "accounts.acc-2.balance"]
    assert collateral(before, after, allowed) == expected


async def test_k_samples_with_distinct_ids_and_seeds(tmp_path, sandbox):
    model = agent([tool_reply(TRANSFER), "Done."])
    ctx = context(tmp_path, sandbox, model, "rollout.samples_per_scenario=3")
    trajectories = await rollout(library_scenario(), ctx)
    assert len({t.id for t in trajectories}) == 3
    assert sorted(t.sample_index for t in trajectories) == [0, 1, 2]
    assert len({t.sampling.seed for t in trajectories}) == 3
    assert {r.sample_index for r in model.requests} == {0, 1, 2}  # distinct cache keys per sample


async def test_missing_environment_rejects_the_scenario(tmp_path, sandbox):
    ctx = context(tmp_path, sandbox, agent(["x"]))
    scenario = bank_scenario().model_copy(update={"env_id": "env-0000000000000000"})
    with pytest.raises(Rejected) as verdict:
        await rollout(scenario, ctx)
    assert isinstance(verdict.value.rejection, Rejection) and verdict.value.rejection.reason == "env_missing"


async def test_refused_agent_request_ends_the_episode_as_llm_error(tmp_path, sandbox):
    trajectory = await run(tmp_path, sandbox, agent([LLMRequestError("context too long", status_code=400)]))
    assert trajectory.end_reason == "llm_error" and not trajectory.solved


# ------------------------------------------------------------------------------------------ conversations


def user_says(*lines):
    """A scripted user: the i-th simulator call answers lines[i] (the last one repeats)."""
    calls = []

    def answer(request: ChatRequest):
        calls.append(request)
        return lines[min(len(calls) - 1, len(lines) - 1)]

    answer.calls = calls
    return answer


async def test_conversation_user_opens_answers_and_stops(tmp_path, sandbox):
    user = user_says("I want to move money to my savings.", "From acc-1 to acc-2, 300 cents.", STOP)
    plan = {0: "Which accounts and how much?", 1: tool_reply(TRANSFER), 2: "Done, the transfer went through."}

    def agent_answer(request):
        if is_user_request(request):
            return user(request)
        step = sum(1 for m in request.messages if m.role == "assistant")
        return plan[min(step, 2)]

    trajectory = await run(tmp_path, sandbox, ScriptedModel(agent_answer), bank_scenario("conversational"))
    assert (trajectory.end_reason, trajectory.solved, trajectory.mode) == ("user_stop", True, "conversational")
    roles = [m.role for m in trajectory.messages]
    assert roles == ["system", "user", "assistant", "user", "assistant", "tool", "assistant"]
    assert trajectory.messages[1].content == "I want to move money to my savings."
    # The simulator sees the conversation role-inverted, with the tool traffic hidden.
    last = user.calls[-1]
    assert last.messages[0].content.startswith("You play a human user")
    assert [m.role for m in last.messages[1:]] == ["user", "assistant", "user", "assistant", "user"] * 1
    assert all(m.content != "" and "transfer_id" not in (m.content or "") for m in last.messages)
    assert not last.tools


async def test_user_that_stops_early_ends_the_episode_unsolved(tmp_path, sandbox):
    user = user_says("I need help with my account.", STOP)

    def answer(request):
        return user(request) if is_user_request(request) else "What would you like to do?"

    trajectory = await run(tmp_path, sandbox, ScriptedModel(answer), bank_scenario("conversational"))
    assert (trajectory.end_reason, trajectory.solved, trajectory.num_turns) == ("user_stop", False, 1)


async def test_leaking_user_simulator_is_re_asked_then_voids_the_episode(tmp_path, sandbox):
    scenario = bank_scenario("conversational")
    leak = "Has acc-2 balance increased by 300 cents. Has acc-1 balance decreased by 300 cents."
    recovered = user_says(leak, "Please move money from my checking to my savings.", STOP)

    def answer(request):
        return recovered(request) if is_user_request(request) else "Done."

    ok = await run(tmp_path, sandbox, ScriptedModel(answer), scenario)
    assert ok.end_reason == "user_stop" and ok.messages[1].content.startswith("Please move money")
    assert "recites the hidden checklist" in recovered.calls[1].messages[-1].content  # the problem fed back
    # The re-ask is a fresh sample (a new sample index, and seed if any), showing only the latest refused reply.
    first, again = recovered.calls[0], recovered.calls[1]
    assert again.sample_index == first.sample_index + 1
    assert first.sampling.seed is None or again.sampling.seed == first.sampling.seed + 1
    assert [m.role for m in again.messages] == [*(m.role for m in first.messages), "assistant", "user"]
    stubborn = user_says(leak)

    def answer2(request):
        return stubborn(request) if is_user_request(request) else "Done."

    void = await run(tmp_path / "b", sandbox, ScriptedModel(answer2), scenario)
    assert void.end_reason == "user_leak" and void.num_turns == 0


def test_leak_guard_cases():
    scenario = bank_scenario("conversational")
    tools = ["get_account", "list_accounts", "transfer", "freeze_account"]
    assert leak_problem("Hi, I want to put some money in savings.", scenario, tools, opening=True) is None
    assert "tool" in leak_problem("Please call freeze_account on acc-3", scenario, tools, opening=False)
    assert "tool" in leak_problem("just run transfer(acc-1, acc-2)", scenario, tools, opening=False)
    assert leak_problem("I'd like to transfer money", scenario, tools, opening=False) is None
    assert "check code" in leak_problem("final_state['accounts']", scenario, tools, opening=False)
    details = "Checking account acc-1 to savings account acc-2, the amount is 300 cents."
    assert "opening" in leak_problem(details, scenario, tools, opening=True)
    assert leak_problem(details, scenario, tools, opening=False) is None  # fine once asked


async def test_user_simulator_failure_is_user_error():
    scenario = bank_scenario("conversational")
    model = ScriptedModel(lambda request: LLMRequestError("bad request", status_code=400))
    sim = UserSimulator(model, scenario, ["transfer"], sampling=Sampling(), retries=0)
    turn = await sim.reply([])
    assert turn.failure == "user_error"


async def test_run_episode_needs_a_task_without_a_user():
    with pytest.raises(ValueError, match="opening"):
        await run_episode(
            ScriptedModel(lambda r: "x"), [], None, system="s", opening=None, limits=Limits(1, 1, 1),
            sampling=Sampling(),
        )  # fmt: skip


async def test_bench_rollout_runs_graded_episodes(sandbox):
    from builder.rollout.bench import _SlowScripted, run_rollouts

    figures = await run_rollouts(_SlowScripted(0.0), sandbox, episodes=6, in_flight=3, config=load_config(None, []))
    assert (figures["episodes"], figures["solved"]) == (6, 6)
    assert figures["episodes_per_s"] > 0 and 0 <= figures["share_outside_model"] <= 1
    assert 0 < figures["steady_s"] < figures["wall_s"] and figures["steady_tok_s"] is not None
    drained = await run_rollouts(_SlowScripted(0.0), sandbox, episodes=3, in_flight=3, config=load_config(None, []))
    assert drained["steady_s"] == 0 and drained["steady_tok_s"] is None  # all start at once: no steady phase


async def test_bench_rollout_replays_exactly_the_requests_the_rollouts_sent(sandbox):
    from builder.llm.connect import client_for
    from builder.rollout.bench import RecordingBackend, _SlowScripted, replay, run_rollouts

    config = load_config(None, [])
    recording = RecordingBackend(_SlowScripted(0.002))  # replies suspend, so concurrent sums would race
    client = client_for(config.llm, recording, model_id="m", cache=None)
    figures = await run_rollouts(client, sandbox, episodes=5, in_flight=2, config=config)
    assert figures["solved"] == 5 and len(recording.requests) == 5 * 4  # three increments and the answer each
    replayed = _SlowScripted(0.002)
    baseline = await replay(client_for(config.llm, replayed, model_id="m", cache=None), recording.requests)
    assert baseline["replay_requests"] == 20 and baseline["replay_tok_s"] > 0
    assert baseline["replay_tokens"] == figures["completion_tokens"] > 0  # the same work, every token counted
    sent = replayed.model.requests
    assert sorted(r.messages for r in sent) == sorted(r.messages for r in recording.requests)


def counter_agent_over_http(body: dict) -> tuple[int, dict]:
    """What `bench._counter_agent` answers, as an OpenAI chat server would: three increments, then done."""
    if sum(message["role"] == "tool" for message in body["messages"]) < 3:
        call = {"id": "c1", "type": "function", "function": {"name": "increment", "arguments": '{"by": 1}'}}
        return 200, completion(None, tool_calls=[call], finish_reason="tool_calls", completion_tokens=7)
    return 200, completion("Done: the counter went up by 3.", completion_tokens=9)


def test_bench_rollout_real_goes_through_the_pool_of_llm_urls(tmp_path):
    from builder.rollout.bench import bench_rollout, to_text

    with StubServer(counter_agent_over_http, 0.01) as a, StubServer(counter_agent_over_http, 0.01) as b:
        config = load_config(None, [
            f'llm.urls=["{a.url}", "{b.url}"]', "llm.max_concurrency=2", "llm.adaptive_concurrency=false",
            "rollout.episodes_in_flight=4", "sandbox.call_timeout_s=2.0", "sandbox.memory_mb=256",
        ])  # fmt: skip
        figures = bench_rollout(config, tmp_path, episodes=6, real=True)
    sent = 6 * 4  # three increments and the answer per episode
    assert (figures["episodes"], figures["solved"]) == (6, 6)
    assert len(a.requests) > 0 and len(b.requests) > 0  # both servers played, and both answered the replay
    assert len(a.requests) + len(b.requests) == 2 * sent  # the rollouts, then each of their requests once more
    servers = figures["servers"]
    assert [s["url"] for s in servers] == [a.url, b.url] and sum(s["answered"] for s in servers) == sent
    assert all(s["in_flight_limit"] == 2 for s in servers)  # each server kept to its own limit
    assert figures["replay_requests"] == sent and figures["replay_tokens"] == figures["completion_tokens"] == 6 * 30
    assert figures["rollout_tok_s"] > 0 and figures["replay_tok_s"] > 0 and 0 < figures["ratio"]
    assert figures["steady_s"] > 0 and figures["steady_ratio"] is not None and figures["steady_ratio"] > 0
    assert f"server {a.url}: answered" in to_text(figures)


def test_bench_rollout_judges_the_target_on_the_steady_phase():
    from builder.rollout.bench import to_text

    tail_heavy = {"ratio": 0.69, "steady_ratio": 0.93}
    assert to_text(tail_heavy).endswith("ok")
    assert "BELOW TARGET" in to_text({"ratio": 0.95, "steady_ratio": 0.8})
    assert "no steady phase" in to_text({"ratio": 0.69, "steady_ratio": None})


def test_user_model_needs_a_server_url_and_comes_from_the_pipelines_resources(tmp_path, sandbox):
    from contextlib import ExitStack

    from builder.errors import ConfigError, RunError
    from builder.pipeline import open_resources
    from builder.stages.rollout import user_model

    with pytest.raises(ConfigError, match="llm.url"), ExitStack() as stack:
        open_resources(load_config(None, ["rollout.user_model=judge"]), tmp_path, stack)
    ctx = context(tmp_path, sandbox, agent(["x"]), "rollout.user_model=judge", "llm.url=http://127.0.0.1:9/v1")
    with pytest.raises(RunError, match="no user model"):
        user_model(ctx)  # a pipeline that gave the stage no client for it
    config = load_config(None, ["rollout.user_model=judge", "llm.url=http://127.0.0.1:9/v1"])
    with ExitStack() as stack:
        resources = open_resources(config, tmp_path, stack)
        stats = StageStats("rollout", report=RolloutReport())
        made = resources.context(config, "hash", tmp_path, stats, {Environment: "evaluate"})
        assert user_model(made) is made.user_model and made.user_model.model_id == "judge"
    assert user_model(context(tmp_path, sandbox, agent(["x"]))).model_id == "agent"


async def test_truncated_and_empty_replies_are_flagged(tmp_path, sandbox):
    from builder.llm import text_reply

    cut = await run(tmp_path, sandbox, agent([tool_reply(TRANSFER), text_reply("Done, I mo", finish_reason="length")]))
    assert cut.solved and cut.flags == ("truncated_reply",)
    empty = await run(tmp_path / "b", sandbox, agent([tool_reply(TRANSFER), ""]))
    assert empty.flags == ("empty_reply",) and empty.end_reason == "agent_done"


async def test_conversational_scenario_without_user_script_is_rejected(tmp_path, sandbox):
    scenario = bank_scenario("conversational").model_copy(update={"user": None})
    with pytest.raises(Rejected) as verdict:
        await rollout(scenario, context(tmp_path, sandbox, agent(["x"])))
    assert verdict.value.rejection.reason == "no_user_script"


async def test_samples_run_concurrently_and_pass_counts_are_reported(tmp_path, sandbox):
    import asyncio

    class Slow:
        def __init__(self):
            self.active = self.peak = 0
            self.inner = agent([tool_reply(TRANSFER), "Done."])

        async def chat(self, request):
            self.active += 1
            self.peak = max(self.peak, self.active)
            await asyncio.sleep(0.05)
            self.active -= 1
            return await self.inner.chat(request)

    model = Slow()
    ctx = context(tmp_path, sandbox, model, "rollout.samples_per_scenario=4")
    trajectories = await rollout(bank_scenario(), ctx)
    assert len(trajectories) == 4 and model.peak >= 2
    assert ctx.stats.report.to_json()["pass_counts"] == {"4/4": 1}


def test_pipeline_ends_with_rollout_then_select():
    from builder.pipeline import STAGES

    names = [stage.name for stage in STAGES]
    assert names[-2:] == ["rollout", "select"]
    for before, after in zip(STAGES, STAGES[1:], strict=False):
        assert after.input is None or after.input is before.output, (before.name, after.name)


async def test_episodes_run_at_the_scenarios_now_and_share_the_golds_ids(tmp_path, sandbox):
    # The gold places an order keyed by a uuid4 id; the agent's same call draws the same id (one seed per
    # scenario), so its write lands on the gold's path: no collateral. The clock and the prompt say `now`.
    orders = environment("orders")
    place = ("place_order", {"customer": "ada", "item": "kettle"})
    check = (
        "import datetime\n\ndef check(initial_state, final_state):\n"
        "    today = datetime.date.today().isoformat()\n"
        "    return any(o['placed_at'].startswith(today) and o['item'] == 'kettle'\n"
        "               for o in final_state['orders'].values())\n"
    )
    scenario = bank_scenario().model_copy(
        update={
            "env_id": orders.id, "initial_state": {"orders": {}, "audit": []}, "now": "2024-03-14T10:30:00",
            "task": "Order a kettle for ada.", "checks": (check,), "checklist": ("Has a kettle been ordered today?",),
            "gold_actions": (Action(name=place[0], arguments=place[1]),),
        }
    )  # fmt: skip
    model = agent([tool_reply(place), "Done."])
    ctx = context(tmp_path, sandbox, model, "rollout.samples_per_scenario=2")
    write_stage(tmp_path, "evaluate", [orders])
    first, second = await rollout(scenario, ctx)
    assert first.solved and second.solved and first.collateral == () and first.reward == 1.0
    placed = [json.loads(t.messages[3].content)["order"] for t in (first, second)]
    assert placed[0]["placed_at"] == "2024-03-14T10:30:00" and placed[0]["order_id"] == placed[1]["order_id"]
    assert "2024-03-14T10:30:00 (Thursday)" in first.messages[0].content


async def test_the_agent_is_shown_the_environments_policy(tmp_path, sandbox):
    """The rules the environment enforces (the module docstring's numbered rules, as the code stage writes them)
    are in the agent's system prompt, in rollouts and in the trainer API alike."""
    from builder.envs.trainer import agent_prompt, trl_prompt_row

    bank = environment("bank")
    rules = "Rules:\n1. A frozen account can neither send nor receive money.\n2. Transfers stay within the daily limit."
    code = bank.code.replace('transfers with an overdraft rule and a daily limit."""', f'transfers.\n\n{rules}\n"""')
    ruled = bank.model_copy(update={"code": code})
    ctx = context(tmp_path, sandbox, agent([tool_reply(TRANSFER), "Done."]), "rollout.samples_per_scenario=1")
    write_stage(tmp_path, "evaluate", [ruled])
    (trajectory,) = await rollout(bank_scenario().model_copy(update={"env_id": ruled.id}), ctx)
    system = trajectory.messages[0].content
    assert "Policy: the rules the system enforces." in system
    assert "1. A frozen account can neither send nor receive money." in system and "2. Transfers stay" in system
    row = json.loads(bank_scenario().model_copy(update={"env_id": ruled.id}).model_dump_json())
    assert agent_prompt("rollout_task", row, ruled.model_dump()) == system  # the trainer API: the same prompt
    assert trl_prompt_row(row, ruled.model_dump())["prompt"][0]["content"] == system


async def test_a_sample_whose_session_breaks_is_a_failed_sample_not_a_lost_scenario(tmp_path, sandbox, monkeypatch):
    import builder.stages.rollout as stage
    from builder.envs.session import Session, SessionError

    opened = []

    def session(*args, **kwargs):
        opened.append(1)
        if len(opened) == 2:
            raise SessionError("load_failed", "the worker died while loading")
        return Session(*args, **kwargs)

    monkeypatch.setattr(stage, "Session", session)
    ctx = context(tmp_path, sandbox, agent([tool_reply(TRANSFER), "Done."]), "rollout.samples_per_scenario=3")
    trajectories = await rollout(bank_scenario(), ctx)
    assert len(trajectories) == 3
    failed = [t for t in trajectories if t.end_reason == "env_error"]
    assert len(failed) == 1 and failed[0].flags == ("sample_failed",) and not failed[0].solved
    assert sum(t.solved for t in trajectories) == 2


async def test_a_sample_whose_requests_keep_getting_non_json_bodies_fails_alone(tmp_path, sandbox):
    """A gateway's error page instead of a completion, on every try of one sample's second turn: that episode
    ends `llm_error` after the client's retries, and the scenario's other samples are kept as they are."""
    from builder.llm import TransientLLMError

    def answer(request):
        turns = sum(message.role == "assistant" for message in request.messages)
        if request.sample_index == 1 and turns == 1:
            return TransientLLMError("the body is not a chat completion: <html>502 Bad Gateway</html>")
        return tool_reply(TRANSFER) if turns == 0 else "Done."

    ctx = context(tmp_path, sandbox, ScriptedModel(answer), "rollout.samples_per_scenario=3", "llm.max_retries=1")
    trajectories = sorted(await rollout(bank_scenario(), ctx), key=lambda t: t.sample_index)
    assert [t.end_reason for t in trajectories] == ["agent_done", "llm_error", "agent_done"]
    # The failed episode is graded on the state it left (its transfer ran) but counts in no pass rate.
    assert ctx.stats.report.by_model["agent"]["train"].graded == 2
