"""Check functions and reward: `check(initial_state, final_state) -> bool` run on JSON snapshots.

Checks run in a fresh sandbox worker that never loaded the environment, on state that went through JSON, so
environment code can neither patch the checker's modules nor hand it objects with a rigged `__eq__`. Anything
but a real `bool` (a truthy int, an exception, a timeout, a crash) is a failed check with the reason kept.
Reward = fraction of checks passed; solved = every check passed (and there is at least one). Checks run at the
episode's `now` (a check may compare dates with today) and seed, like the environment.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.pyast import parse
from builder.sandbox.runtime import Sandbox, Worker, WorkerFailure
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED, parse_now


class CheckSpec(BaseModel):
    """One check: its `source` module and the `function` in it to call."""

    model_config = ConfigDict(frozen=True)

    name: str
    source: str
    function: str = "check"


class CheckResult(BaseModel):
    """The verdict of one check; `error` says why a check that did not pass failed, if not by returning False."""

    model_config = ConfigDict(frozen=True)

    name: str
    passed: bool
    error: str | None = None


class Verdict(BaseModel):
    """All check results of one episode, the reward and the solved flag."""

    model_config = ConfigDict(frozen=True)

    checks: tuple[CheckResult, ...]
    reward: float
    solved: bool


def checks_from_file(source: str) -> list[CheckSpec]:
    """Every top-level `check_*` function of a checks file, in order (found by parsing, not running, it)."""
    names = [
        node.name for node in parse(source).body if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")
    ]
    return [CheckSpec(name=name, source=source, function=name) for name in names]


def checks_from_scenario(checks: tuple[str, ...] | list[str]) -> list[CheckSpec]:
    """A scenario's check sources (each defines `check`) as specs named check_0, check_1, ..."""
    return [CheckSpec(name=f"check_{i}", source=source) for i, source in enumerate(checks)]


def run_checks(
    sandbox: Sandbox, checks: list[CheckSpec], initial_state: dict[str, Any], final_state: dict[str, Any],
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED,
) -> Verdict:  # fmt: skip
    """Run every check in a fresh worker (a new one after any check kills its worker) and score them; the
    worker's clock reads `now` (raises ValueError if it is not an ISO 8601 naive date-time)."""
    parse_now(now)
    world = {"now": now, "seed": int(seed)}
    initial_json = json.dumps(initial_state, ensure_ascii=False)
    final_json = json.dumps(final_state, ensure_ascii=False)
    results: list[CheckResult] = []
    worker: Worker | None = None
    try:
        for spec in checks:
            if worker is None or not worker.alive:
                worker = sandbox.open_worker()
            results.append(_run_one(worker, spec, initial_json, final_json, world))
    finally:
        if worker is not None:
            worker.kill()
    passed = sum(result.passed for result in results)
    reward = passed / len(results) if results else 0.0
    return Verdict(checks=tuple(results), reward=reward, solved=bool(results) and passed == len(results))


def _run_one(worker: Worker, spec: CheckSpec, initial_json: str, final_json: str, world: dict[str, Any]) -> CheckResult:
    request = {
        "op": "check", "source": spec.source, "function": spec.function,
        "initial_json": initial_json, "final_json": final_json, **world,
    }  # fmt: skip
    try:
        reply = worker.request(request)
    except WorkerFailure as failure:
        return CheckResult(name=spec.name, passed=False, error=f"{failure.kind}: {failure}")
    if reply.get("ok") and type(reply.get("passed")) is bool:
        return CheckResult(name=spec.name, passed=reply["passed"])
    return CheckResult(name=spec.name, passed=False, error=f"{reply.get('kind')}: {reply.get('error')}")
