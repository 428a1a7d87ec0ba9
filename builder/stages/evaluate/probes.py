"""Rule probes and consistency gates of the evaluate stage: every rule of the environment is tried, deterministically.

After the test states exist and before the dual-agent check, one structured-output request per environment
(prompt `evaluate_probe`) asks for a NEGATIVE probe per numbered rule of the module docstring (the plan's rules,
`views.code.policy_text`): a concrete tool call on a named test state, optionally after the smallest
`state_change` that lets the state show the rule, that a correct implementation must refuse. The same reply
lists `valid_calls`, one accepted call per state-changing tool, whose state diffs feed the consistency gates.

Each probe runs in a fresh sandbox session on its (changed) test state. Refused (`ToolResult.refused`, the one
refusal rule of scenario verification and the reward audit): the rule holds. Not refused: the checker agent
rules once whether the call really breaks the rule (a model-written probe can be wrong); a `fail` confirms it.
A call that raises, hangs or crashes needs no checker. A confirmed probe goes back to the code stage through the
gates' repair (`RepairTools`) with the rule, the call and its result as the problem; the same probes run again
on the repaired code, at most `evaluate.probe_repairs` times, then the environment is rejected
(`rule_not_enforced`).

Consistency gates, on the state diffs of the valid calls: one empty value per field (a tool writing `None` where
another writes `""`, or against the state schema's type) and new record ids in the format of the test state's
ids of the same collection (`D16` next to seeded `D-522`). Problems are repaired the same way; left unrepaired,
the rejection is `inconsistent_state`.

Unusable replies (not JSON, unknown tools, arguments off the schema, a state or rule that does not exist) are
dropped and counted (`invalid`), never judged: a probe request with no usable probe is re-asked with the error
(bounded); one that stays unusable leaves every rule unprobed, visibly, and the check goes on.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from builder.envs.lint import Contract
from builder.envs.schema import EnvInterface, inspect_source
from builder.envs.session import Session, SessionError, ToolResult, diff_states
from builder.evidence import GateRepair, ProbeOutcome, RuleProbing, Synthesis
from builder.json_values import record_pairs
from builder.limits import DETAIL_CHARS
from builder.prompts import prompt
from builder.records import ChatMessage, Environment, EnvPlan
from builder.reports import EvaluateReport
from builder.run.stage import Rejected, StageContext
from builder.stages._llm import shrinking
from builder.stages._repair import RepairTools, ToolProblemText
from builder.stages.evaluate.agents import Agents, CheckerVerdict, InvalidReply, shares_start
from builder.stages.evaluate.consistency import consistency_problems
from builder.stages.evaluate.exercise import EVIDENCE_CHARS, TESTER_ERRORS, TestState, _all, _checker_facts
from builder.stages.evaluate.facts import shows_whole_source
from builder.stages.evaluate.gates import passing_gates
from builder.stages.evaluate.probe_reply import Probe, ProbeDraft, usable
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import environment_text, now_text, policy_text
from builder.views.state import clip_json, state_text

# ---------------------------------------------------------------------------------------------- the rules


_NUMBERED = re.compile(r"^\s*(\d+)[.)]\s+(.*)$")


def numbered_rules(code: str) -> list[str]:
    """The environment's numbered rules, in order, from the module docstring's "Rules:" section (a line that does
    not start a new number continues the rule before it)."""
    rules: list[str] = []
    for line in policy_text(code).splitlines():
        found = _NUMBERED.match(line)
        if found:
            rules.append(found.group(2).strip())
        elif rules and line.strip():
            rules[-1] += " " + line.strip()
    return rules


# ------------------------------------------------------------------------------------------------ running


@dataclass(frozen=True)
class ProbeRun:
    result: ToolResult
    before: dict[str, Any] | None  # None: the (changed) state did not load
    after: dict[str, Any] | None  # None: the state after the call could not be read


def changed_state(state: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """`state` with `change` applied: records of a keyed collection added or replaced by key, any other
    attribute replaced whole."""
    result = copy.deepcopy(state)
    for name, value in change.items():
        current = result.get(name)
        if isinstance(current, dict) and isinstance(value, dict) and record_pairs(current) is not None:
            current.update(copy.deepcopy(value))
        else:
            result[name] = copy.deepcopy(value)
    return result


def run_probe(sandbox: Any, code: str, interface: EnvInterface, state: TestState, probe: Probe) -> ProbeRun:
    """One call in a fresh session on its test state (changed by `state_change`), with the states around it."""
    initial = changed_state(state.state, probe.state_change)
    try:
        with Session(sandbox, code, initial, interface=interface, now=state.now) as session:
            before = session.snapshot()
            result = session.call(probe.tool, probe.arguments)
            try:
                after = session.snapshot()
            except SessionError:
                after = None
    except SessionError as error:
        return ProbeRun(ToolResult(name=probe.tool, ok=False, error=str(error), error_kind="state_invalid"), None, None)
    return ProbeRun(result, before, after)


# ------------------------------------------------------------------------------------- the probe request


def probe_messages(
    env: Environment, interface: EnvInterface, rules: list[str], states: list[TestState], budget: PromptBudget
) -> list[ChatMessage]:
    tools = [
        {"name": t["function"]["name"], "description": t["function"].get("description", "")[:300],
         "parameters": t["function"]["parameters"]}
        for t in interface.tools
    ]  # fmt: skip
    shown = "\n\n".join(
        f"Test state {s.index + 1} ({s.purpose}); now: {now_text(s.now)}.\n{state_text(s.state, budget)}"
        for s in states
    )
    numbered = "\n".join(f"{n}. {rule}" for n, rule in enumerate(rules, 1))
    # The rules come from the docstring's "Rules:" part; shown once, numbered as the probes cite them.
    about = environment_text(env.description, env.code).partition("Rules:")[0].strip()
    user = (
        f"Environment `{env.class_name}`: {about}\n\n"
        f"Rules:\n{numbered}\n\nTools (JSON schemas):\n{json.dumps(tools, ensure_ascii=False)}\n\n{shown}\n\n"
        f"Write the probes for rules 1 to {len(rules)}, and the valid calls."
    )
    return [ChatMessage(role="system", content=prompt("evaluate_probe")), ChatMessage(role="user", content=user)]


async def write_probes(
    env: Environment, interface: EnvInterface, rules: list[str], states: list[TestState], ctx: StageContext,
    agents: Agents,
) -> tuple[list[Probe], dict[int, str], list[str]]:  # fmt: skip
    """The usable probes, the rules said to be unprobeable, and what could not be used (an unusable reply: one
    item). A reply with no usable probe is re-asked with why (bounded by `llm.structured_retries`)."""
    found: list[tuple[list[Probe], dict[int, str], list[str]]] = []

    async def accept(draft: ProbeDraft) -> str | None:
        probes, unprobed, dropped = usable(draft, rules, states, interface)
        if not any(p.rule is not None for p in probes) and len(unprobed) < len(rules):
            return "no probe could be used: " + ("; ".join(dropped) or "the reply has no probes")
        found.append((probes, unprobed, dropped))
        return None

    def ask(budget: PromptBudget) -> Awaitable[ProbeDraft]:
        messages = probe_messages(env, interface, rules, states, budget)
        return agents.ask_json(messages, ProbeDraft, "probe", accept=accept)

    try:
        await shrinking(ctx, "evaluate_probe", prompt_budgets(ctx.config.llm.max_state_chars), ask)
    except InvalidReply as invalid:
        return [], {}, [f"{invalid.kind}: {invalid.detail}"]
    return found[-1]


# ----------------------------------------------------------------------------------------- the verdicts


async def confirm(
    env: Environment, rules: list[str], state: TestState, probe: Probe, run: ProbeRun, ctx: StageContext,
    agents: Agents,
) -> tuple[str, str]:  # fmt: skip
    """The checker's ruling on an unrefused probe: (`fail` = the rule is broken, or pass/warning/unjudged, reason).
    An unusable checker reply leaves the probe unjudged (it neither rejects nor passes the environment)."""
    before = run.before or {}
    after = run.after if run.after is not None else before
    changes = diff_states(before, after)
    call = {"tool": probe.tool, "case": "negative", "arguments": probe.arguments}
    number = probe.rule or 0
    rule = f"\n\nThe tester wrote this call to break rule {number}: {rules[number - 1]}\nIts reasoning: {probe.why}"

    def ask(budget: PromptBudget) -> Awaitable[CheckerVerdict]:
        whole = shows_whole_source(ctx.config.evaluate.calls, len(env.tools))  # the exercise's layout: its prefix
        facts = _checker_facts(env, call, run.result, before, after, changes, budget, state.now, whole) + rule
        return agents.ask_json(agents.checker_messages(facts, shares_start(budget, whole)), CheckerVerdict, "checker")

    try:
        verdict = await shrinking(ctx, "evaluate_checker", prompt_budgets(ctx.config.llm.max_state_chars), ask)
    except InvalidReply as invalid:
        return "unjudged", f"{invalid.kind}: {invalid.detail}"
    return verdict.verdict, " ".join(verdict.reason.split())


def outcome(probe: Probe, run: ProbeRun, verdict: tuple[str, str] | None) -> ProbeOutcome:
    """The evidence of one probe on the current code."""
    result = run.result
    if result.error_kind in TESTER_ERRORS or result.error_kind == "state_invalid":
        status = "invalid"
    elif probe.rule is None:
        status = "accepted" if result.ok and not result.refused else "refused"
    elif result.ok and result.refused:
        status = "refused"
    elif not result.ok:
        status = "broken"  # raised, hung, crashed: no refusal, and no checker needed to say so
    else:
        status = {"fail": "confirmed", "unjudged": "unjudged"}.get(verdict[0] if verdict else "", "wrong_probe")
    return ProbeOutcome(
        rule=probe.rule,
        state=probe.state,
        state_change=probe.state_change or None,
        tool=probe.tool,
        arguments=probe.arguments,
        why=probe.why or None,
        status=status,
        result=clip_json(result.result, EVIDENCE_CHARS) if result.ok else None,
        error=(f"{result.error_kind}: {result.error}"[:EVIDENCE_CHARS] if not result.ok else None),
        reason=verdict[1][:EVIDENCE_CHARS] if verdict and probe.rule is not None and status != "refused" else None,
    )


def rule_problems(rules: list[str], outcomes: list[ProbeOutcome]) -> dict[str, list[ToolProblemText]]:
    """The broken rules as problems of the tools that let them be broken, each naming the call and its result."""
    errors: dict[str, list[ToolProblemText]] = {}
    for item in outcomes:
        if item.status not in ("confirmed", "broken") or item.rule is None:
            continue
        change = f" changed by {json.dumps(item.state_change)}" if item.state_change else ""
        on = f"test state {item.state + 1}{change}"
        got = item.result if item.status == "confirmed" else item.error
        message = (
            f"rule {item.rule} ({rules[item.rule - 1]}) is not enforced: {item.tool}("
            f"{json.dumps(item.arguments, ensure_ascii=False)}) on {on} breaks it ({item.why or 'see the rule'}) "
            f"and was not refused; it returned {got}. Fix: check the rule before changing anything and return "
            '{"success": False, "error": "..."} naming the rule, leaving the state unchanged.'
        )
        errors.setdefault(item.tool, []).append(ToolProblemText("rule_not_enforced", message[:DETAIL_CHARS]))
    return errors


# ------------------------------------------------------------------------------------------- the loop


async def enforce_rules(
    env: Environment, interface: EnvInterface, default_state: dict[str, Any], states: list[TestState],
    ctx: StageContext, agents: Agents, *, contract: Contract, repair: RepairTools | None,
    gate_state: dict[str, Any] | None, subject: Environment,
) -> tuple[Environment, EnvInterface, RuleProbing | None]:  # fmt: skip
    """`env` (or its repair) once its probes are refused and its written records consistent, with its interface
    and the probe evidence (None: probes are off, or the environment states no rules).

    Raises Rejected naming `subject` (the candidate evaluate was given): `rule_not_enforced`, or
    `inconsistent_state`, when `evaluate.probe_repairs` repairs did not fix what the probes found.
    """
    config = ctx.config.evaluate
    report: EvaluateReport = ctx.stats.report
    rules = numbered_rules(env.code)
    if not config.probes or not rules:
        if config.probes:
            report.rule_probes.no_rules += 1
        return env, interface, None
    probes, unprobed, dropped = await write_probes(env, interface, rules, states, ctx, agents)
    verdicts: dict[int, tuple[str, str]] = {}  # the checker's ruling per probe, asked once
    plan: EnvPlan | None = None
    rounds: list[GateRepair] = []
    while True:
        runs = [
            await asyncio.to_thread(run_probe, ctx.sandbox, env.code, interface, states[p.state], p) for p in probes
        ]
        unrefused = [
            i for i, (p, r) in enumerate(zip(probes, runs, strict=True))
            if p.rule is not None and r.result.ok and not r.result.refused and i not in verdicts
        ]  # fmt: skip
        judged = await _all(
            [confirm(env, rules, states[probes[i].state], probes[i], runs[i], ctx, agents) for i in unrefused]
        )
        verdicts.update(zip(unrefused, judged, strict=True))
        outcomes = [outcome(p, r, verdicts.get(i)) for i, (p, r) in enumerate(zip(probes, runs, strict=True))]
        broken = rule_problems(rules, outcomes)
        inconsistent = consistency_problems(env, states, probes, runs, default_state)
        errors = {tool: [*broken.get(tool, []), *inconsistent.get(tool, [])] for tool in {**broken, **inconsistent}}
        if not errors:
            break
        made = None
        if repair is not None and len(rounds) < config.probe_repairs:
            plan = plan or (ctx.earlier_record(EnvPlan, env.plan_id) if env.plan_id else None)
        if repair is not None and plan is not None and len(rounds) < config.probe_repairs:
            previous = len(env.synthesis.repairs) if env.synthesis else 0  # fresh samples after the gates' repairs
            made = await repair(ctx, env, plan, errors, previous + 1)
        if made is None or made.source is None:
            report.rule_probes.rejected += 1
            _count_consistency(report, errors)
            reason = "rule_not_enforced" if broken else "inconsistent_state"
            found = "; ".join(str(e) for tool in sorted(errors) for e in errors[tool])
            detail = f"{reason} after {len(rounds)} repair(s): {found}" if rounds else found
            evidence = _evidence(rules, probes, outcomes, unprobed, dropped, rounds)
            _count(report, evidence)
            raise Rejected(ctx.reject(subject, reason, detail[:DETAIL_CHARS], raw_output=evidence.model_dump_json()))
        report.rule_probes.repair_rounds += 1
        _count_consistency(report, errors)
        repaired = env.model_copy(update={"code": made.source, "tools": tuple(inspect_source(made.source).tools)})
        record = GateRepair(
            round=(len(env.synthesis.repairs) if env.synthesis else 0) + 1, from_=env.id, to=repaired.id,
            problems={tool: tuple(str(e) for e in found) for tool, found in sorted(errors.items())},
            requests=made.requests,
        )  # fmt: skip
        rounds.append(record)
        synthesis = (env.synthesis or Synthesis()).model_copy(
            update={"repairs": (*(env.synthesis.repairs if env.synthesis else ()), record)}
        )
        # The repaired methods must pass the gates again (no further gate repair: its rounds would renumber).
        try:
            env, interface, _ = await passing_gates(
                repaired.model_copy(update={"synthesis": synthesis}), ctx, contract, None, gate_state
            )
        except Rejected as failed:  # named for the candidate, like every rejection of this stage
            why = failed.rejection
            raise Rejected(ctx.reject(subject, why.reason, why.detail, raw_output=why.raw_output)) from None
    if rounds:
        report.rule_probes.repaired += 1
    evidence = _evidence(rules, probes, outcomes, unprobed, dropped, rounds)
    _count(report, evidence)
    return env, interface, evidence


def _evidence(
    rules: list[str], probes: list[Probe], outcomes: list[ProbeOutcome], unprobed: dict[int, str],
    dropped: list[str], rounds: list[GateRepair],
) -> RuleProbing:  # fmt: skip
    probed = sorted({o.rule for o in outcomes if o.rule is not None and o.status != "invalid"})
    missing = {n: unprobed.get(n, "no usable probe was written") for n in range(1, len(rules) + 1) if n not in probed}
    return RuleProbing(
        rules=tuple(rules),
        probed=tuple(probed),
        unprobed={str(n): why for n, why in missing.items()},
        probes=tuple(outcomes),
        invalid=tuple(d[:DETAIL_CHARS] for d in dropped),
        repairs=len(rounds),
    )


def _count(report: EvaluateReport, evidence: RuleProbing) -> None:
    counts = report.rule_probes
    statuses = Counter(o.status for o in evidence.probes if o.rule is not None)
    counts.rules += len(evidence.rules)
    counts.probed += len(evidence.probed)
    counts.unprobed += len(evidence.unprobed)
    counts.probes += sum(statuses.values())
    counts.refused += statuses["refused"]
    counts.wrong_probes += statuses["wrong_probe"]
    counts.unjudged += statuses["unjudged"]
    counts.invalid += statuses["invalid"] + len(evidence.invalid)


def _count_consistency(report: EvaluateReport, errors: dict[str, list[ToolProblemText]]) -> None:
    for found in errors.values():
        for problem in found:
            report.probe_problems[problem.code] = report.probe_problems.get(problem.code, 0) + 1
