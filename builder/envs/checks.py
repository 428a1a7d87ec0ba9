"""Check functions and the published reward: `check(initial_state, final_state) -> bool` run on JSON snapshots.

Checks run in a fresh sandbox worker that never loaded the environment, on state that went through JSON, so
environment code can neither patch the checker's modules nor hand it objects with a rigged `__eq__`. Anything
but a real `bool` (a truthy int, an exception, a timeout, a crash) is a failed check with the reason kept.
Checks run at the episode's `now` (a check may compare dates with today) and seed, like the environment.

The published reward (`published_reward`, the one every path grades with: rollouts, the trainer API, the
adapters, `python -m builder reward`), for a scenario's checks on (initial state, final state):

- solved = every check passes, the collateral guard (`builder.envs.guard`) included, there is a task check, and
  when the task asks something of the answer (`builder.envs.answer.answer_check`: facts to state, read from the
  tools, a decline), the agent's answer does;
- reward = 1.0 when solved; 0.0 when the guard fails or a check that already held on the initial state no
  longer holds (collateral damage either way); else the share of the *counted* items that pass, a counted item
  being a check that is false on the initial state or the answer check (no answer was given before the
  episode). Doing nothing therefore scores 0 (but for asking for a missing value, which is a missing_info task's
  one-shot answer), and partial credit never reaches 1.

`run_checks` alone scores the plain share of checks passed (used by `env replay --checks` and the scenario
verification, which look at each check, not at a reward).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.answer import NOTHING_ASKED, AnswerCheck
from builder.envs.guard import is_guard
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
    """All check results of one episode, the reward and the solved flag. With `published_reward`, `counted` says
    which checks the partial credit counts (false on the initial state), `guarded` whether the guard held
    (None: the scenario has no guard), `answered` whether the agent's answer stated every fact the task asks
    for (None: it asks for none) and `unstated` the facts it left out."""

    model_config = ConfigDict(frozen=True)

    checks: tuple[CheckResult, ...]
    reward: float
    solved: bool
    counted: tuple[bool, ...] = ()
    guarded: bool | None = None
    answered: bool | None = None
    unstated: tuple[str, ...] = ()


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
    """Run every check in a fresh worker (a new one after any check kills its worker) and score the plain share
    passed; the worker's clock reads `now` (raises ValueError if it is not an ISO 8601 naive date-time)."""
    parse_now(now)
    results = _run_jobs(sandbox, [(spec, initial_state, final_state) for spec in checks], now, seed)
    passed = sum(result.passed for result in results)
    reward = passed / len(results) if results else 0.0
    return Verdict(checks=tuple(results), reward=reward, solved=bool(results) and passed == len(results))


def published_reward(
    sandbox: Sandbox, checks: list[CheckSpec], initial_state: dict[str, Any], final_state: dict[str, Any],
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED, check: AnswerCheck = NOTHING_ASKED, answer: str = "",
    seen: str = "",
) -> Verdict:  # fmt: skip
    """The published reward of `final_state` (see the module docstring): every check on (initial, final), and the
    task checks on (initial, initial) too, to know which of them the partial credit counts; with an answer `check`
    (`builder.envs.answer.answer_check` of the scenario), whether `answer` (what the agent said,
    `builder.envs.answer.agent_answer`) passes it, `seen` being what the tools returned (`tool_text`)."""
    parse_now(now)
    guards = [is_guard(spec.source) for spec in checks]
    tasks = [spec for spec, guard in zip(checks, guards, strict=True) if not guard]
    jobs = [(spec, initial_state, final_state) for spec in checks] + [
        (spec, initial_state, initial_state) for spec in tasks
    ]
    results = _run_jobs(sandbox, jobs, now, seed)
    final, before = results[: len(checks)], results[len(checks) :]
    held_before = iter(result.passed for result in before)
    counted = tuple(False if guard else not next(held_before) for guard in guards)
    guarded = all(r.passed for r, guard in zip(final, guards, strict=True) if guard) if any(guards) else None
    broken = any(not r.passed for r, g, c in zip(final, guards, counted, strict=True) if not g and not c)
    answered, unstated = check.grade(answer, seen)
    solved = (bool(tasks) or bool(check)) and all(result.passed for result in final) and answered is not False
    passed = [r.passed for r, c in zip(final, counted, strict=True) if c]
    if answered is not None:
        passed.append(answered)
    if solved:
        reward = 1.0
    elif guarded is False or broken or not passed:
        reward = 0.0
    else:
        reward = sum(passed) / len(passed)
    return Verdict(
        checks=tuple(final), reward=reward, solved=solved, counted=counted, guarded=guarded, answered=answered,
        unstated=unstated,
    )  # fmt: skip


def _run_jobs(
    sandbox: Sandbox, jobs: list[tuple[CheckSpec, dict[str, Any], dict[str, Any]]], now: str, seed: int
) -> list[CheckResult]:
    """Each (check, initial, final) in one worker (a new one after a check kills its worker)."""
    world = {"now": now, "seed": int(seed)}
    dumped: dict[int, str] = {}

    def as_json(state: dict[str, Any]) -> str:
        return dumped.setdefault(id(state), json.dumps(state, ensure_ascii=False))

    results: list[CheckResult] = []
    worker: Worker | None = None
    try:
        for spec, initial, final in jobs:
            if worker is None or not worker.alive:
                worker = sandbox.open_worker()
            results.append(_run_one(worker, spec, as_json(initial), as_json(final), world))
    finally:
        if worker is not None:
            worker.kill()
    return results


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
