"""The rule-probe request's reply (`builder.stages.evaluate.probes`): what the model answers, and the probes of it
that can be used (a known state, tool and rule, arguments on the tool's schema)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from builder.envs.schema import EnvInterface
from builder.envs.validate import argument_error
from builder.stages.evaluate.exercise import TestState


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


@dataclass(frozen=True)
class Probe:
    """A usable call of the reply: negative (`rule` set) or valid (`rule` None); `state` is 0-based."""

    rule: int | None
    state: int
    tool: str
    arguments: dict[str, Any]
    state_change: dict[str, Any]
    why: str = ""


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
