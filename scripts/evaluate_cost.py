"""Prompt tokens of the dual-agent check per environment at `evaluate.calls` calls, and the keep / reject decisions,
on a fixture set of good and broken environments, offline: a real sandbox and a scripted model.

The set is the bank of tests/fixtures/envs/bank.py and variants of it with bugs put in. The scripted tester fills each
slot with arguments fit for its tool and case; the scripted checker rules from the facts each call's section shows,
as a careful reviewer would: a NEGATIVE case passes when it was refused with the state unchanged, a POSITIVE case
when it was not refused. It answers both the batched requests (`TesterCalls`, `CheckerVerdicts`) and the single
requests builder made before them (a forced tool call; one `CheckerVerdict`), so the same script measures a checkout
before and after (issue 29):

    python -m scripts.evaluate_cost [--calls 100] [--json]                   # this checkout
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/this/scripts/evaluate_cost.py   # another one

Tokens are prompt characters / 4 (the scripted model's own count, `builder/llm/scripted.py`), by request kind;
"not a prefix" is the part of them no earlier request of the environment sent as a prefix (`builder/llm/prefix.py`,
one server): what a server with a prefix cache still computes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from builder.config import load_config
from builder.llm import ChatRequest, ScriptedModel, tool_reply
from builder.llm.connect import client_for
from builder.llm.prefix import PrefixIndex, prompt_text
from builder.records import Environment
from builder.reports import EvaluateReport
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stats import StageStats

BANK = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "envs" / "bank.py").read_text()
AMOUNT_CHECK = "if amount <= 0 or amount > self.daily_limit:"
FREEZE_CHECK = (
    "if account_id not in self.accounts:\n"
    '            return {"success": False, "error": f"no account {account_id}"}\n'
    '        self.accounts[account_id]["frozen"]'
)
LOOKUP = 'return {"success": True, "account": dict(account, account_id=account_id)}'
# name -> (code, the decision a correct check reaches)
FIXTURE_SET = {
    "bank": (BANK, "accept"),
    # Accepts a zero or negative amount: its negative transfers fail (1 call in 8), a pass share of about 0.88.
    "bank_amount_unchecked": (BANK.replace(AMOUNT_CHECK, "if amount > self.daily_limit:"), "accept"),
    # Also freezes accounts that do not exist (a crash) and reports found accounts as missing: 3 calls in 8 fail.
    "bank_three_bugs": (
        BANK.replace(AMOUNT_CHECK, "if amount > self.daily_limit:")
        .replace(FREEZE_CHECK, 'self.accounts[account_id]["frozen"]')
        .replace(LOOKUP, 'return {"success": False, "error": "not found"}'),
        "reject",
    ),
    # Transfers refuse everything: every positive transfer fails (1 call in 8) and look-ups report missing (1 in 8).
    "bank_refuses": (
        BANK.replace('if self.accounts[source]["balance"] < amount:', "if True:").replace(
            LOOKUP, 'return {"success": False, "error": "not found"}'
        ),
        "reject",
    ),
}
STATE = {
    "customers": {"c7": {"name": "Grace Hopper", "tier": "silver"}, "c8": {"name": "Alan Turing", "tier": "gold"}},
    "accounts": {
        "acc-7": {"owner": "c7", "balance": 250000, "kind": "checking", "frozen": False},
        "acc-8": {"owner": "c8", "balance": 90000, "kind": "savings", "frozen": False},
        "acc-9": {"owner": "c8", "balance": 0, "kind": "checking", "frozen": True},
    },
    "transfers": [],
    "daily_limit": 40000,
}
ARGUMENTS = {
    "positive": {
        "get_account": {"account_id": "acc-7"},
        "list_accounts": {"owner": "c7"},
        "transfer": {"source": "acc-7", "target": "acc-8", "amount": 100},
        "freeze_account": {"account_id": "acc-9", "frozen": True},
    },
    "negative": {
        "get_account": {"account_id": "acc-404"},
        "list_accounts": {"owner": "c404"},
        "transfer": {"source": "acc-7", "target": "acc-8", "amount": -5},
        "freeze_account": {"account_id": "acc-404"},
    },
}
SLOT = re.compile(r"^(\d+)\. `(\w+)` with a (POSITIVE|NEGATIVE) case", re.MULTILINE)
PASS = {"analysis": "as the rules require", "verdict": "pass", "reason": "correct"}
FAIL = {"analysis": "not what the rules require", "verdict": "fail", "reason": "wrong"}


def ruling(section: str) -> dict[str, str]:
    """The verdict on one call's facts: a negative case must be refused with the state unchanged, a positive one
    must not be refused (a listing that finds nothing counts as refused)."""
    result = next((line for line in section.splitlines() if line.startswith("Result:")), "").replace(" ", "")
    refused = '"success":false' in result or result == "Result:[]"  # an error value, or nothing found
    if "a NEGATIVE case" in section:
        return PASS if refused and "Changes: none" in section else FAIL
    return FAIL if refused else PASS


def answer(request: ChatRequest) -> Any:
    schema = request.response_format["json_schema"]["name"] if request.response_format else ""
    text = request.messages[-1].content or ""
    if schema == "TestState":
        return json.dumps({"purpose": "a busy branch", "state": STATE})
    if schema == "TesterCalls":
        slots = [(int(n), tool, case.lower()) for n, tool, case in SLOT.findall(text)]
        made = [{"call": n, "tool": tool, "arguments": ARGUMENTS[case][tool]} for n, tool, case in slots]
        return json.dumps({"calls": made})
    if request.tools:  # before batches: one forced tool call a request
        case = "negative" if "with a NEGATIVE case" in text else "positive"
        return tool_reply((request.tool_choice, ARGUMENTS[case][request.tool_choice]))
    if schema == "CheckerVerdicts":
        sections = text.split("## Call ")[1:]
        return json.dumps({"verdicts": [{"call": int(s.split("\n", 1)[0]), **ruling(s)} for s in sections]})
    if schema == "CheckerVerdict":
        return json.dumps(ruling(text.split("## Call ", 1)[-1]))
    raise AssertionError(f"unexpected request {schema!r}")


def kind(request: ChatRequest) -> str:
    schema = request.response_format["json_schema"]["name"] if request.response_format else ""
    if request.tools or schema == "TesterCalls":
        return "tester"
    return {"CheckerVerdict": "checker", "CheckerVerdicts": "checker", "TestState": "state"}.get(schema, schema)


async def measure(name: str, code: str, calls: int, sandbox: Sandbox, folder: Path, *overrides: str) -> dict[str, Any]:
    from builder.envs.schema import inspect_source
    from builder.stages.evaluate import evaluate

    model = ScriptedModel(answer)
    settings = [f"store.path={folder / 'store'}", f"evaluate.calls={calls}", "evaluate.probes=false", *overrides]
    config = load_config(None, settings, profile="none")
    llm = client_for(config.llm, model, model_id="scripted")
    stats = StageStats("evaluate", report=EvaluateReport())
    ctx = StageContext(config, "hash", folder, stats, llm=llm, open_sandbox=lambda: sandbox)
    env = Environment(
        provenance={"config_hash": "h", "parent_ids": ["plan-1"]}, plan_id="plan-1", name=name, class_name="Bank",
        description="A retail bank.", domain="banking", code=code, tools=list(inspect_source(code).tools),
        state_schema={},
    )  # fmt: skip
    try:
        (accepted,) = await evaluate(env, ctx)
        decision, judged, score = "accept", accepted.evaluation.counts.judged, accepted.evaluation.score
    except Rejected as rejected:
        decision, judged, score = "reject", None, None
        found = re.search(r"score ([\d.]+) < [\d.]+ over (\d+) judged", rejected.rejection.detail or "")
        if found:
            score, judged = float(found.group(1)), int(found.group(2))
    tokens, requests, fresh, index = Counter(), Counter(), Counter(), PrefixIndex()
    for request in model.requests:
        text = prompt_text(request)
        reused, chars = index.observe(text)
        tokens[kind(request)] += max(1, len(text) // 4)
        requests[kind(request)] += 1
        fresh[kind(request)] += (chars - reused) // 4
    return {
        "decision": decision, "judged": judged, "score": score, "requests": dict(requests),
        "prompt_tokens": dict(tokens), "check_prompt_tokens": tokens["tester"] + tokens["checker"],
        # of those, what no earlier request of the environment sent as a prefix (by kind, and the check's sum)
        "fresh_tokens": dict(fresh), "check_fresh_tokens": fresh["tester"] + fresh["checker"],
    }  # fmt: skip


async def measure_all(calls: int) -> dict[str, dict[str, Any]]:
    from builder.config import SandboxConfig

    figures = {}
    with Sandbox(SandboxConfig(call_timeout_s=2.0, kill_grace_s=0.5, memory_mb=256)) as sandbox:
        with tempfile.TemporaryDirectory() as folder:
            for name, (code, expected) in FIXTURE_SET.items():
                figures[name] = {"expected": expected, **await measure(name, code, calls, sandbox, Path(folder) / name)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="evaluate.calls per environment")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    figures = asyncio.run(measure_all(options.calls))
    if options.json:
        print(json.dumps(figures, indent=1))
        return
    print(
        f"{'environment':<24}{'decision':>9}{'expected':>9}{'judged':>7}{'score':>7}{'requests':>9}{'check tokens':>13}"
    )
    for name, row in figures.items():
        start = f"{name:<24}{row['decision']:>9}{row['expected']:>9}{row['judged'] or '-':>7}{row['score'] or '-':>7}"
        tokens = f"{row['check_prompt_tokens']:>13}{row['check_fresh_tokens']:>13}"
        print(f"{start}{sum(row['requests'].values()):>9}{tokens}")
    mean = sum(row["check_prompt_tokens"] for row in figures.values()) / len(figures)
    fresh = sum(row["check_fresh_tokens"] for row in figures.values()) / len(figures)
    print(f"mean tester + checker prompt tokens per environment: {mean:.0f} ({fresh:.0f} not a prefix sent before)")


if __name__ == "__main__":
    sys.exit(main())
