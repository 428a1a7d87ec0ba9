"""`python -m builder reward ENV.py --scenario SCENARIO.json --calls CALLS.json`: the published reward
(`builder.envs.checks.published_reward`) of a call sequence on one scenario, run in the sandbox at the scenario's
`now` and seed — what a trainer's reward function gives the same calls.

The scenario is a line of the `scenarios.jsonl` that `python -m builder scenarios` writes (a `Scenario` record)
or a row of a release's `scenarios` config (JSON-string columns decoded). A scenario made before the collateral
guard existed gets one derived from its gold (`builder.rollout.reward.with_guard`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from builder.config import SandboxConfig
from builder.envs.answer import answer_check
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.commands import read_file, read_json
from builder.envs.guard import is_guard
from builder.envs.lint import Contract, ContractError
from builder.envs.schema import inspect_source
from builder.envs.session import Session, SessionError
from builder.envs.trainer import column, scenario_world
from builder.errors import BuilderError
from builder.records import Action
from builder.rollout.reward import gold_paths, with_guard
from builder.sandbox.runtime import Sandbox


def reward_report(
    path: Path, scenario_path: Path, calls_path: Path, *, as_json: bool = False, config: SandboxConfig | None = None,
    contract: Contract = "strict", out: TextIO | None = None, answer: str = "",
) -> int:  # fmt: skip
    """Print the published reward of the calls on the scenario, `answer` being what the agent said; exit 0
    (whatever the reward).

    Raises:
        BuilderError: a file cannot be read or is not what it should be, the environment breaks its contract or
            does not load the scenario's state, a call names a tool the environment lacks, or the scenario is of
            another environment (its gold calls tools this one lacks, or its state attributes this one lacks).
    """
    out = out or sys.stdout
    code = read_file(path)
    try:
        interface = inspect_source(code, contract)
    except ContractError as error:
        raise BuilderError(f"{path} breaks the environment contract:\n{error}") from None
    scenario = _read_scenario(scenario_path)
    calls = _read_calls(calls_path)
    tools = set(interface.tool_names)
    state, checks, gold = scenario["initial_state"], scenario["checks"], scenario["gold"]
    foreign = sorted({action.name for action in gold} - tools)
    if foreign:
        raise BuilderError(f"{scenario_path} is a scenario of another environment: its gold calls {foreign}, "
                           f"which {path.name} lacks")  # fmt: skip
    unknown = sorted({call.name for call in calls} - tools)
    if unknown:
        raise BuilderError(f"{calls_path} calls {unknown}, not tools of {path.name} ({', '.join(sorted(tools))})")
    now, seed = scenario_world(scenario["row"])
    with Sandbox(config) as sandbox:
        try:
            with Session(sandbox, code, state, now=now, seed=seed, contract=contract, interface=interface) as session:
                initial = session.snapshot()
                extra = sorted(set(state) - set(initial))
                if extra:
                    raise BuilderError(f"{scenario_path} is a scenario of another environment: its state has "
                                       f"{extra}, which {path.name} does not")  # fmt: skip
                results = [session.call(call.name, call.arguments) for call in calls]
                final = session.snapshot()
            allowed = None
            if gold and not any(is_guard(source) for source in checks):
                allowed = gold_paths(sandbox, code, state, gold, now=now, seed=seed, contract=contract)
        except SessionError as error:
            raise BuilderError(f"{path.name} does not run the scenario's state: {error}") from None
        guarded = with_guard(checks, allowed)
        asked = answer_check(scenario["row"])
        seen = "\n".join(result.content() for result in results)
        verdict = published_reward(sandbox, checks_from_scenario(guarded), initial, final, now=now, seed=seed,
                                   check=asked, answer=answer, seen=seen)  # fmt: skip
        facts = list(asked.facts)
    items = [
        scenario["checklist"][i] if i < len(scenario["checklist"])
        else "(collateral guard derived from the gold)" if i >= len(checks) else f"check {i}"
        for i in range(len(guarded))
    ]  # fmt: skip
    report = {
        "reward": verdict.reward,
        "solved": verdict.solved,
        "now": now,
        "checks": [
            {
                "item": item,
                "guard": is_guard(source),
                "counted": counted,
                "passed": result.passed,
                "error": result.error,
            }
            for item, source, counted, result in zip(items, guarded, verdict.counted, verdict.checks, strict=True)
        ],  # fmt: skip
        "calls": [{"name": r.name, **({"result": r.result} if r.ok else {"error": r.error})} for r in results],
    }
    if asked:
        report["answer"] = {"facts": facts, "declines": asked.declines, "passed": verdict.answered,
                            "unstated": list(verdict.unstated)}  # fmt: skip
    if as_json:
        print(json.dumps(report, indent=2, ensure_ascii=False), file=out)
        return 0
    for check in report["checks"]:
        kind = "guard" if check["guard"] else ("counted" if check["counted"] else "held before")
        mark = "pass" if check["passed"] else "FAIL"
        error = f" ({check['error']})" if check["error"] else ""
        print(f"{mark:4}  [{kind}] {check['item']}{error}", file=out)
    if asked:
        unstated = f" (missing: {'; '.join(verdict.unstated)})" if verdict.unstated else ""
        wanted = "; ".join([*facts, *(["a decline"] if asked.declines else [])])
        print(f"{'pass' if verdict.answered else 'FAIL':4}  [answer] states {wanted}{unstated}", file=out)
    print(f"reward {verdict.reward:.3f} ({'solved' if verdict.solved else 'not solved'}) at {now}", file=out)
    return 0


def _read_scenario(path: Path) -> dict[str, Any]:
    row = read_json(path)
    if not isinstance(row, dict):
        raise BuilderError(f"{path}: expected one scenario as a JSON object (a line of scenarios.jsonl)")
    try:
        state = column(row, "initial_state", "initial_state_json")
        checks = list(column(row, "checks", "checks_json"))
        checklist = list(row.get("checklist") or [f"check {i}" for i in range(len(checks))])
        gold = [Action(name=a["name"], arguments=_decoded(a["arguments"])) for a in row.get("gold_actions") or []]
    except (BuilderError, KeyError, TypeError, ValueError) as error:
        raise BuilderError(
            f"{path} is not a scenario (a line of scenarios.jsonl or a published row): {error}"
        ) from None
    if not isinstance(state, dict) or not checks:
        raise BuilderError(f"{path} is not a scenario: it needs an initial_state object and checks")
    facts = row.get("answer_facts") or []
    facts = json.loads(facts) if isinstance(facts, str) else facts
    if not isinstance(facts, list) or not all(isinstance(fact, str) for fact in facts):
        raise BuilderError(f"{path} is not a scenario: answer_facts must be a list of strings")
    return {"row": row, "initial_state": state, "checks": checks, "checklist": checklist, "gold": gold,
            "answer_facts": facts}  # fmt: skip


def _decoded(arguments: Any) -> Any:
    return json.loads(arguments) if isinstance(arguments, str) else arguments  # a release stores them as JSON text


def _read_calls(path: Path) -> list[Action]:
    calls = read_json(path)
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise BuilderError(f'{path}: expected a JSON list of {{"name": ..., "arguments": {{...}}}}')
    try:
        return [Action(name=c["name"], arguments=c.get("arguments") or {}) for c in calls]
    except ValueError as error:
        raise BuilderError(f"{path}: a call's arguments are not a JSON object: {error}") from None
