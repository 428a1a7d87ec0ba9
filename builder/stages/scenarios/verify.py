"""Proving a scenario in the sandbox: the initial state loads and answers every tool, the check functions are
clean, the gold action sequence runs and satisfies every check, the initial state does not, and every
state-changing gold call is needed by some check (negative control).

Everything here blocks on the sandbox; call it with `asyncio.to_thread`. Generated code (the environment and
the checks) only ever runs in sandbox workers; this module parses checks but never executes them.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from builder.envs.answer import is_number, states
from builder.envs.checks import CheckResult, checks_from_scenario, run_checks
from builder.envs.lint import Contract, lint
from builder.envs.probe import generate_arguments
from builder.envs.session import Session, SessionError, ToolResult
from builder.envs.signatures import tool_defaults
from builder.evidence import Ablation, GoldResult
from builder.frozen import Frozen
from builder.limits import DETAIL_CHARS, RESULT_CHARS
from builder.pyast import parse
from builder.records import Action
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED
from builder.stages.scenarios.references import Earlier, resolve
from builder.stages.scenarios.sufficiency import problem_value, unsupported_arguments

# Tool failures that say the state (or the code) is broken, as opposed to an answered domain error.
CRASH_KINDS = frozenset({"raised", "timeout", "crashed", "memory", "not_json", "too_large", "protocol"})


class Evidence(Frozen):
    """What verification observed. `reason` is None when the scenario passed every gate.

    `check_problems` maps a check's index to what is wrong with it (lint, raised, not a bool, timed out);
    `gold_problems` lists failing gold calls (and references that cannot be resolved); both feed the repair
    prompts. `underspecified` maps a mode to the gold argument values its text does not give (the
    task_underspecified gate). `actions` is the gold as it ran, its references resolved: the gold a kept scenario
    stores; what it stores of the rest is its `Verification`.
    """

    reason: str | None = None
    detail: str = ""
    check_problems: dict[int, str] = {}
    gold_problems: tuple[str, ...] = ()
    actions: tuple[Action, ...] = ()
    underspecified: dict[str, tuple[str, ...]] = {}
    gold: tuple[GoldResult, ...] = ()
    state_changing_calls: tuple[int, ...] = ()
    checks_on_initial: tuple[bool, ...] = ()
    checks_on_final: tuple[bool, ...] = ()
    negative_control: tuple[Ablation, ...] = ()
    vacuous_checks: tuple[int, ...] = ()
    final_state: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------------- initial state


def default_state(sandbox: Sandbox, code: str, contract: Contract = "strict") -> dict[str, Any]:
    """The state the class's `__init__` builds. Raises SessionError (or ContractError) if it does not load."""
    with Session(sandbox, code, {}, contract=contract) as session:
        return session.snapshot()


def load_state(
    sandbox: Sandbox, code: str, state: dict[str, Any], *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED,
    contract: Contract = "strict",
) -> tuple[dict[str, Any] | None, list[str]]:  # fmt: skip
    """Load `state` at the scenario's `now` and `seed`, read it back, and call every tool once with arguments
    taken from it.

    Returns:
        (the full initial state as the environment holds it, problems); the state is None when it did not load.
        A tool that raises, hangs, crashes or returns non-JSON on this state is a problem; a tool that answers
        with a domain error (`{"success": false, ...}`) is not.
    """
    try:
        with Session(sandbox, code, state, now=now, seed=seed, contract=contract) as session:
            loaded = session.snapshot()
            problems = []
            for tool in session.tools:
                name = tool["function"]["name"]
                arguments = generate_arguments(tool["function"]["parameters"], loaded)
                result = session.call(name, arguments)
                if not result.ok and result.error_kind in CRASH_KINDS:
                    problems.append(f"{name}({json.dumps(arguments)}) failed on this state: {result.error}")
            session.snapshot()  # tools must leave a JSON state behind, too
    except SessionError as error:
        return None, [str(error)]
    return loaded, problems


# ------------------------------------------------------------------------------------------------- checks


def lint_check(source: str) -> list[str]:
    """Problems of one check module: the environment lint's code rules, plus exactly one function
    `check(initial_state, final_state)` at the top level and no classes."""
    found = [p for p in lint(source) if p.code not in ("no_env_class", "multiple_env_classes", "no_tools")]
    problems = [str(p) for p in found]
    if any(p.code == "syntax" for p in found):
        return problems
    tree = parse(source)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "check"]
    if any(isinstance(node, ast.ClassDef) for node in tree.body):
        problems.append("define no classes; write one function `check`")
    if len(functions) != 1:
        problems.append("define exactly one top-level function `def check(initial_state, final_state) -> bool`")
    elif [arg.arg for arg in functions[0].args.args] != ["initial_state", "final_state"]:
        problems.append("the signature must be exactly `def check(initial_state: dict, final_state: dict) -> bool`")
    return problems


def _check_errors(results: tuple[CheckResult, ...], on: str) -> dict[int, str]:
    return {i: f"on the {on} state: {r.error}" for i, r in enumerate(results) if r.error is not None}


# --------------------------------------------------------------------------------------------------- gold


def run_actions(
    sandbox: Sandbox, code: str, state: dict[str, Any], actions: Sequence[Action],
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED, contract: Contract = "strict",
) -> tuple[list[tuple[ToolResult, bool]], dict[str, Any]]:  # fmt: skip
    """Execute `actions` in a fresh session from `state` at `now` with `seed`: each result with whether it changed
    the state, and the final state."""
    outcomes = []
    with Session(sandbox, code, state, now=now, seed=seed, contract=contract) as session:
        before = session.snapshot()
        for action in actions:
            result = session.call(action.name, action.arguments)
            after = session.snapshot()
            outcomes.append((result, after != before))
            before = after
        return outcomes, before


@dataclass(frozen=True)
class GoldRun:
    """A gold sequence as it ran: the calls with their references resolved, each result with whether it changed
    the state, the final state, and why the references of the next call cannot be resolved (that call and the
    ones after it did not run; empty when every call ran)."""

    actions: tuple[Action, ...]
    outcomes: tuple[tuple[ToolResult, bool], ...]
    final_state: dict[str, Any]
    problems: tuple[str, ...] = ()


def run_gold(
    sandbox: Sandbox, code: str, state: dict[str, Any], actions: Sequence[Action],
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED, contract: Contract = "strict",
) -> GoldRun:  # fmt: skip
    """`run_actions` for a gold sequence as the model wrote it: each call's references to earlier results
    (`builder.stages.scenarios.references`) are resolved against the actual results just before it runs."""
    ran: list[Action] = []
    outcomes: list[tuple[ToolResult, bool]] = []
    earlier: list[Earlier] = []
    with Session(sandbox, code, state, now=now, seed=seed, contract=contract) as session:
        before = session.snapshot()
        for number, action in enumerate(actions, 1):
            arguments, problems = resolve(action.arguments, earlier, number)
            if problems:
                stopped = tuple(f"call {number} {action.name}: {problem}" for problem in problems)
                return GoldRun(tuple(ran), tuple(outcomes), before, stopped)
            concrete = Action(name=action.name, arguments=arguments)
            result = session.call(concrete.name, concrete.arguments)
            after = session.snapshot()
            ran.append(concrete)
            outcomes.append((result, after != before))
            ok = result.ok and not result.refused
            earlier.append(Earlier(name=action.name, ok=ok, result=result.result if result.ok else result.error))
            before = after
        return GoldRun(tuple(ran), tuple(outcomes), before)


def _describe_call(index: int, action: Action, result: ToolResult) -> str:
    answer = result.error if not result.ok else json.dumps(result.result, ensure_ascii=False)
    return f"call {index + 1} {action.name}({json.dumps(action.arguments, ensure_ascii=False)}) -> {answer}"[:600]


# ----------------------------------------------------------------------------------------------- verify


def verify(
    sandbox: Sandbox,
    code: str,
    initial_state: dict[str, Any],
    actions: Sequence[Action],
    checks: list[str],
    *,
    min_gold_calls: int = 1,
    texts: Mapping[str, str] | None = None,
    tools: Sequence[dict[str, Any]] = (),
    now: str = DEFAULT_NOW,
    seed: int = DEFAULT_SEED,
    contract: Contract = "strict",
    facts: Sequence[str] = (),
    refused: Action | None = None,
    expect_change: bool = True,
    withheld: tuple[str, str] | None = None,
) -> Evidence:
    """Run every gate in order and stop at the first that fails (its reason code and the evidence so far). Every
    session and check run is at the scenario's `now` with its `seed`.

    `texts` maps each mode to what the user says in it (the task, or the user script); every literal gold
    argument must come from each of them, an earlier gold result or the `tools` schemas
    (`builder.stages.scenarios.sufficiency`). `actions` may hold references to earlier results
    (`builder.stages.scenarios.references`); they are resolved as the gold runs (`run_gold`), every later gate
    runs the resolved calls, and the evidence's `actions` are those. `facts` are what the task asks to be told
    (`answer_facts`): each must be in what a gold call returned and not already in what the user says.
    Task families (`builder.stages.scenarios.families`): `refused` is a call the environment must refuse (or
    answer with an error) on the initial state; with `expect_change` False the gold must change nothing (and
    the checks may be none); `withheld` is (value, text): a value the gold needs that `text` (what the user says
    in the mode that leaves it out) must not give.

    Reason codes: check_broken (lint, raises, non-bool, timeout), gold_call_failed (a call failed or was
    refused, or a reference names a later or failed call or a path its call did not return), answer_not_read
    (an answer fact no gold call returns, or one the user already says), not_refused (the refused call was
    not), state_changed (a gold that must change nothing did), nothing_withheld, task_underspecified,
    too_few_calls, no_state_change, gold_nondeterministic, already_solved, gold_fails_checks,
    negative_control_failed.
    """
    linted = {i: "; ".join(problems) for i, source in enumerate(checks) if (problems := lint_check(source))}
    if linted:
        return Evidence(reason="check_broken", detail=_join(linted), check_problems=linted)
    try:
        run = run_gold(sandbox, code, initial_state, actions, now=now, seed=seed, contract=contract)
    except SessionError as error:
        return Evidence(reason="gold_call_failed", detail=str(error), gold_problems=(str(error),))
    written, actions, outcomes, final_state = actions, list(run.actions), run.outcomes, run.final_state
    gold = tuple(
        GoldResult(name=a.name, ok=r.ok and not r.refused, state_changed=changed, result=r.content()[:RESULT_CHARS])
        for a, (r, changed) in zip(actions, outcomes, strict=True)
    )
    changing = tuple(i for i, (_, changed) in enumerate(outcomes) if changed)
    seen: dict[str, Any] = {
        "gold": gold, "state_changing_calls": changing, "final_state": final_state, "actions": run.actions
    }  # fmt: skip
    failed = tuple(
        _describe_call(i, a, r)
        for i, (a, (r, _)) in enumerate(zip(actions, outcomes, strict=True))
        if not r.ok or r.refused
    ) + tuple(problem[:600] for problem in run.problems)
    if failed:
        return Evidence(reason="gold_call_failed", detail=" | ".join(failed), gold_problems=failed, **seen)
    unread = answer_problems(facts, [result for result, _ in outcomes], texts or {})
    if unread:
        return Evidence(reason="answer_not_read", detail=" | ".join(unread)[:DETAIL_CHARS], gold_problems=unread,
                        **seen)  # fmt: skip
    if refused is not None and (accepted := _accepts(sandbox, code, initial_state, refused, now, seed, contract)):
        return Evidence(reason="not_refused", detail=accepted, gold_problems=(accepted,), **seen)
    if not expect_change and changing:
        calls = ", ".join(f"call {i + 1} {actions[i].name}" for i in changing)
        detail = f"{calls} changed the state; the rules forbid this request, so nothing may change"
        return Evidence(reason="state_changed", detail=detail, gold_problems=(detail,), **seen)
    # Checked on the actual results, before the other gates: its repair is a new task, which replaces the rest.
    # On the calls as written: a reference is grounded by construction (it resolved against an earlier result).
    results = [result.result for result, _ in outcomes]
    defaults = tool_defaults(code)
    underspecified = {
        mode: tuple(problems)
        for mode, text in (texts or {}).items()
        if (problems := unsupported_arguments(written, results, text, tools, now, defaults))
    }
    if withheld is not None:
        value, text = withheld
        lacking = unsupported_arguments(written, results, text, tools, now, defaults)
        if not any(_same_value(problem_value(problem), value) for problem in lacking):
            detail = (
                f"withheld {value!r}: the request gives it or lets the assistant find it"
                if any(_same_value(v, value) for action in written for v in action.arguments.values())
                else f"withheld {value!r}: no call of the solution uses it, so nothing the calls need is missing"
            )
            return Evidence(reason="nothing_withheld", detail=detail, gold_problems=(detail,), **seen)
    if underspecified:
        detail = " | ".join(f"{mode}: {'; '.join(problems)}" for mode, problems in underspecified.items())
        return Evidence(
            reason="task_underspecified", detail=detail[:DETAIL_CHARS], underspecified=underspecified, **seen
        )
    if len(actions) < min_gold_calls:
        detail = f"the gold sequence has {len(actions)} calls; the task must need at least {min_gold_calls}"
        return Evidence(reason="too_few_calls", detail=detail, gold_problems=(detail,), **seen)
    if not changing and expect_change:
        detail = "no gold call changed the state; the task must require at least one change"
        return Evidence(reason="no_state_change", detail=detail, gold_problems=(detail,), **seen)
    # The stored gold must reproduce: rollouts and the negative control replay it in fresh sessions.
    try:
        replayed = run_actions(sandbox, code, initial_state, actions, now=now, seed=seed, contract=contract)[1]
    except SessionError as error:
        replayed = {"error": str(error)}
    if replayed != final_state:
        detail = "replaying the gold sequence from the initial state gave a different final state"
        return Evidence(reason="gold_nondeterministic", detail=detail, gold_problems=(detail,), **seen)

    specs = checks_from_scenario(checks)
    on_initial = run_checks(sandbox, specs, initial_state, initial_state, now=now, seed=seed).checks
    on_final = run_checks(sandbox, specs, initial_state, final_state, now=now, seed=seed).checks
    seen |= {
        "checks_on_initial": tuple(r.passed for r in on_initial),
        "checks_on_final": tuple(r.passed for r in on_final),
    }
    errors = _check_errors(on_initial, "initial") | _check_errors(on_final, "final")
    if errors:
        return Evidence(reason="check_broken", detail=_join(errors), check_problems=errors, **seen)
    if specs and all(r.passed for r in on_initial):
        detail = "every check already passes on the initial state: the task asks for nothing that is not done"
        return Evidence(reason="already_solved", detail=detail, **seen)
    false = {i: "returned False on the state after the gold sequence" for i, r in enumerate(on_final) if not r.passed}
    if false:
        return Evidence(reason="gold_fails_checks", detail=_join(false), check_problems=false, **seen)

    ablations, never_failed = [], {i for i, r in enumerate(on_initial) if r.passed}
    for removed in changing:
        kept = [a for i, a in enumerate(actions) if i != removed]
        name = actions[removed].name
        try:
            _, ablated_state = run_actions(sandbox, code, initial_state, kept, now=now, seed=seed, contract=contract)
        except SessionError as error:  # the episode broke without this call: that is noticed, by every check
            failing, broke = tuple(range(len(specs))), str(error)[:300]
        else:
            results = run_checks(sandbox, specs, initial_state, ablated_state, now=now, seed=seed).checks
            failing, broke = tuple(i for i, r in enumerate(results) if not r.passed), None
            never_failed -= set(failing)
        ablations.append(Ablation(removed=removed, name=name, failing_checks=failing, error=broke))
    seen |= {"negative_control": tuple(ablations), "vacuous_checks": tuple(sorted(never_failed))}
    unnoticed = [a for a in ablations if not a.failing_checks]
    if unnoticed:
        detail = "; ".join(f"without call {a.removed + 1} ({a.name}) every check still passes" for a in unnoticed)
        return Evidence(reason="negative_control_failed", detail=detail, gold_problems=(detail,), **seen)
    return Evidence(**seen)


def _accepts(
    sandbox: Sandbox, code: str, state: dict[str, Any], call: Action, now: str, seed: int, contract: Contract
) -> str | None:
    """Why `call` is not refused on `state` (None: it is refused, or answered with a domain error)."""
    try:
        with Session(sandbox, code, state, now=now, seed=seed, contract=contract) as session:
            result = session.call(call.name, call.arguments)
    except SessionError as error:
        return f"the state does not load: {error}"[:600]
    if result.ok and result.refused or not result.ok and result.error_kind not in CRASH_KINDS:
        return None
    said = json.dumps(result.result, ensure_ascii=False) if result.ok else result.error
    how = "accepted it" if result.ok else "crashed on it"
    return f"refused_call {call.name}({json.dumps(call.arguments, ensure_ascii=False)}): the environment {how}: {said}"[
        :600
    ]


def _same_value(argument: Any, value: str) -> bool:
    return str(argument).strip().casefold() == value.strip().casefold()


def answer_problems(facts: Sequence[str], results: Sequence[ToolResult], texts: Mapping[str, str]) -> tuple[str, ...]:
    """Why answer facts cannot be graded: a fact no successful gold call returned (the agent could not know it), or
    one the user already says in some mode (stating it proves nothing)."""
    returned = "\n".join(json.dumps(r.result, ensure_ascii=False) for r in results if r.ok and not r.refused)
    problems = [f"answer fact {fact!r}: no call of the solution returns it" for fact in facts
                if not states(returned, fact)]  # fmt: skip
    problems += [
        f"answer fact {fact!r}: the user already says it ({mode}); the answer must state what the tools tell"
        for fact in facts for mode, text in texts.items() if not is_number(fact) and states(text, fact)
    ]  # fmt: skip
    return tuple(problems)


def _join(problems: dict[int, str]) -> str:
    return " | ".join(f"check {i + 1}: {text}" for i, text in sorted(problems.items()))[:DETAIL_CHARS]
