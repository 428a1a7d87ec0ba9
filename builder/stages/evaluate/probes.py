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

from pydantic import BaseModel, Field

from builder.envs.lint import Contract
from builder.envs.schema import EnvInterface, inspect_source
from builder.envs.session import Session, SessionError, ToolResult, diff_states
from builder.envs.state_schema import generated_state_schema, record_schema
from builder.envs.validate import argument_error
from builder.evidence import GateRepair, ProbeOutcome, RuleProbing, Synthesis
from builder.json_values import record_pairs
from builder.limits import DETAIL_CHARS
from builder.prompts import prompt
from builder.records import ChatMessage, Environment, EnvPlan
from builder.reports import EvaluateReport
from builder.run.stage import Rejected, StageContext
from builder.stages._llm import shrinking
from builder.stages._repair import RepairTools, ToolProblemText
from builder.stages.evaluate.agents import Agents, CheckerVerdict, InvalidReply
from builder.stages.evaluate.exercise import EVIDENCE_CHARS, TESTER_ERRORS, TestState, _all, _checker_facts
from builder.stages.evaluate.gates import passing_gates
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import environment_text, now_text, policy_text
from builder.views.state import clip_json, state_text

# ------------------------------------------------------------------------------------------ the model's reply


class RuleProbe(BaseModel):
    rule: int = Field(description="Number of the rule the call breaks.")
    why: str = Field(description="One sentence: how the call breaks the rule on that state.", max_length=400)
    state: int = Field(description="Number of the test state the call runs on.")
    state_change: dict[str, Any] = Field(
        description="Usually {}. Only when no test state can show the rule: attributes changed before the call "
        "(a collection keyed by id: records to add or replace, by key; another attribute: its new value)."
    )
    tool: str
    arguments: dict[str, Any]


class UnprobedRule(BaseModel):
    rule: int
    reason: str = Field(description="Why no tool call can break this rule.", max_length=400)


class ValidCall(BaseModel):
    state: int = Field(description="Number of the test state the call runs on.")
    tool: str
    arguments: dict[str, Any]


class ProbeDraft(BaseModel):
    """Negative probes per rule, the rules no call can break, and one accepted call per state-changing tool."""

    probes: list[RuleProbe]
    unprobed: list[UnprobedRule]
    valid_calls: list[ValidCall]


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
class Probe:
    """A usable call of the reply: negative (`rule` set) or valid (`rule` None); `state` is 0-based."""

    rule: int | None
    state: int
    tool: str
    arguments: dict[str, Any]
    state_change: dict[str, Any]
    why: str = ""


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
    user = (
        f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
        f"Rules:\n{numbered}\n\nTools (JSON schemas):\n{json.dumps(tools, ensure_ascii=False)}\n\n{shown}\n\n"
        f"Write the probes for rules 1 to {len(rules)}, and the valid calls."
    )
    return [ChatMessage(role="system", content=prompt("evaluate_probe")), ChatMessage(role="user", content=user)]


def usable(
    draft: ProbeDraft, rules: list[str], states: list[TestState], interface: EnvInterface
) -> tuple[list[Probe], dict[int, str], list[str]]:
    """The reply's usable probes (negative first, then valid calls), the rules it says no call can break (by
    number), and why each dropped item could not be used."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in interface.tools}
    probes: list[Probe] = []
    dropped: list[str] = []

    def check(label: str, state: int, tool: str, arguments: dict[str, Any], change: dict[str, Any]) -> bool:
        problem = None
        if not 1 <= state <= len(states):
            problem = f"state {state} does not exist (states 1 to {len(states)})"
        elif tool not in schemas:
            problem = f"unknown tool {tool!r}"
        elif unknown := sorted(set(change) - set(states[state - 1].state)):
            problem = f"state_change names no state attribute: {', '.join(unknown)}"
        else:
            problem = argument_error(schemas[tool], arguments)
        if problem:
            dropped.append(f"{label}: {problem}")
        return not problem

    for item in draft.probes:
        if not 1 <= item.rule <= len(rules):
            dropped.append(f"probe of rule {item.rule}: no such rule (rules 1 to {len(rules)})")
        elif check(f"probe of rule {item.rule}", item.state, item.tool, item.arguments, item.state_change):
            why = " ".join(item.why.split())
            probes.append(Probe(item.rule, item.state - 1, item.tool, item.arguments, item.state_change, why))
    for call in draft.valid_calls:
        if check(f"valid call of {call.tool}", call.state, call.tool, call.arguments, {}):
            probes.append(Probe(None, call.state - 1, call.tool, call.arguments, {}))
    unprobed = {u.rule: " ".join(u.reason.split()) for u in draft.unprobed if 1 <= u.rule <= len(rules)}
    return probes, unprobed, dropped


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
        facts = _checker_facts(env, call, run.result, before, after, changes, budget, state.now) + rule
        return agents.ask_json(agents.checker_messages(facts), CheckerVerdict, "checker")

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


# ------------------------------------------------------------------------------------ consistency gates


def consistency_problems(
    env: Environment, states: list[TestState], probes: list[Probe], runs: list[ProbeRun], default_state: dict[str, Any]
) -> dict[str, list[ToolProblemText]]:
    """Problems of the records the accepted valid calls wrote: a field whose empty value is `None` in one tool
    and `""` in another (or against the state schema), and new ids whose format is not the seeded ids'."""
    schema = generated_state_schema(env.state_schema, default_state).get("properties", {})
    empties: dict[tuple[str, str], dict[str, set[str]]] = {}  # (collection, field) -> empty kind -> tools
    errors: dict[str, list[ToolProblemText]] = {}
    for probe, run in zip(probes, runs, strict=True):
        if probe.rule is not None or run.before is None or run.after is None:
            continue
        if not run.result.ok or run.result.refused:
            continue
        for collection, key, record, created in written_records(run.before, run.after):
            for field, value in record.items():
                if value is None or value == "":
                    kind = "None" if value is None else '""'
                    empties.setdefault((collection, field), {}).setdefault(kind, set()).add(probe.tool)
            if created:
                problem = id_problem(collection, key, states[probe.state].state.get(collection))
                if problem:
                    message = f"{probe.tool}({json.dumps(probe.arguments, ensure_ascii=False)}) {problem}"
                    errors.setdefault(probe.tool, []).append(ToolProblemText("id_format", message))
    for (collection, field), kinds in sorted(empties.items()):
        convention = schema_empty(schema.get(collection), field)
        if convention is None and len(kinds) < 2:
            continue
        if convention is None:  # two tools disagree and the schema does not say: the more common one wins
            convention = max(sorted(kinds), key=lambda k: (len(kinds[k]), k == "None"))
        for kind, tools in kinds.items():
            if kind == convention:
                continue
            others = sorted(kinds.get(convention, set()))
            said = f"the other tools ({', '.join(others)}) write {convention}" if others else "the state schema says"
            message = (
                f"it writes {kind} for an empty `{field}` of a {collection} record, but {said}: an empty "
                f"`{field}` is {convention} everywhere in this environment. Write {convention}."
            )
            for tool in sorted(tools):
                errors.setdefault(tool, []).append(ToolProblemText("empty_value_mixed", message))
    return errors


def written_records(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any], bool]]:
    """(collection, key, record, created) of every record a call added or changed (the changed fields only)."""
    found = []
    for collection, value in after.items():
        pairs = record_pairs(value)
        if pairs is None:
            continue
        old = before.get(collection)
        if isinstance(value, dict):
            old_records = old if isinstance(old, dict) else {}
            for key, record in pairs:
                if key not in old_records:
                    found.append((collection, key, record, True))
                elif record != old_records[key]:
                    changed = {f: v for f, v in record.items() if old_records[key].get(f, object()) != v}
                    found.append((collection, key, changed, False))
        else:
            old_items = old if isinstance(old, list) else []
            for index, record in pairs:
                if index >= len(old_items):
                    found.append((collection, _list_id(record), record, True))
    return found


def _list_id(record: dict[str, Any]) -> Any:
    first = next(iter(record), None)
    return record.get("id", record.get(first) if first is not None and str(first).endswith("id") else None)


def id_shape(value: str) -> str:
    """An id's format: its text with every run of digits as `9` (`D-522` -> `D-9`, `D16` -> `D9`)."""
    return re.sub(r"\d+", "9", value)


def id_problem(collection: str, key: Any, seeded: Any) -> str | None:
    """Why a new id of `collection` breaks the format of its seeded ids (None: it keeps it, or the seeded ids do
    not share one format, or fewer than two exist)."""
    if not isinstance(key, str):
        return None
    pairs = record_pairs(seeded) or []
    ids = [k if isinstance(seeded, dict) else _list_id(r) for k, r in pairs]
    shapes = {id_shape(i) for i in ids if isinstance(i, str)}
    if len(ids) < 2 or len(shapes) != 1 or id_shape(key) in shapes:
        return None
    examples = ", ".join(map(str, ids[:3]))
    return (
        f"created the {collection} record {key!r}, but the existing {collection} ids look like {examples}: "
        f"make new ids in the same format (the next free number after the largest existing one)"
    )


def schema_empty(collection: Any, field: str) -> str | None:
    """The empty value the state schema gives a record field: `None` when it is nullable and not a string,
    `""` when it is a string and not nullable; None when it does not say."""
    record = record_schema(collection)
    prop = (record or {}).get("properties", {}).get(field) if record else None
    if not isinstance(prop, dict):
        return None
    options = prop.get("anyOf", [prop])
    types = set()
    for option in options:
        kind = option.get("type") if isinstance(option, dict) else None
        types.update(kind if isinstance(kind, list) else [kind])
    if "null" in types and "string" not in types:
        return "None"
    if "string" in types and "null" not in types:
        return '""'
    return None


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
