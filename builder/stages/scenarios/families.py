"""Task families: the kinds of task a scenario teaches, each with its own generation path and checks.

Agent benchmarks test more than fully specified instructions (BFCL multi-turn: missing parameters, long context;
tau-bench: policy-bound refusals). Each llm-method slot gets a family (`slot_families`, from the weights of
`scenarios.families`); the graph method's slots are `plain`.

- `plain`: a fully specified multi-step request; checks on the final state (and the answer, if it asks).
- `missing_info`: the user leaves out one value the calls need (`withheld`), which a real user would know. In
  conversational mode the user gives it only when asked: the agent must ask, then do the task (the plain checks).
  In non-conversational mode nothing can be done: success is no change and an answer that names what is
  missing (`answer_facts` = `withheld_as`, e.g. "amount", `asked_for`); so every change the task asks for must
  need the value (`family_gates.doable_without`).
- `infeasible`: the request breaks a rule in this state; the call that would carry it out (`refused_call`) must be
  refused by the environment. Success is no change and an answer that declines and states why (`answer_facts`:
  the values from the state that show it, read during the episode); the gold is the look-ups that find them.
- `policy_trap`: the user asks for something the rules forbid (`refused_call`, refused). In conversation, told it
  is not possible, they accept an alternative (`reveal_when_asked`): success is the alternative done (its
  checks), the forbidden change never made (the guard). The one-shot request states no alternative, and no
  change is made without the user's yes (tau-bench's rule): success is no change and an answer that declines
  and states why (`refusal_facts`, read by the gold's look-ups; `family_gates`).
- `error_recovery`: the user gives a stale or wrong detail a real user would, so the natural first call
  (`refused_call`) fails; the agent must find the right record by another detail. The gold is the corrected course.
- `long_context`: a plain task whose initial state is enlarged with distractor records (`long_context`), so the
  records the task names are found only by search.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated

from pydantic import Field

from builder.prompts import prompt
from builder.records import Action, Family
from builder.stages.scenarios.requests import GoldAction, TaskDraft

FAMILIES: tuple[Family, ...] = ("plain", "missing_info", "infeasible", "policy_trap", "error_recovery", "long_context")
REFUSING = frozenset({"infeasible", "policy_trap", "error_recovery"})  # families with a call that must fail
NO_CHANGE = frozenset({"infeasible"})  # families whose gold changes nothing, in every mode
WRITTEN = frozenset(FAMILIES) - {"long_context"}  # families the task writer is told about (long_context is plain)


def slot_families(count: int, weights: Mapping[str, float]) -> list[Family]:
    """The family of each of `count` slots: a deterministic interleaving in proportion to `weights` (smooth
    weighted round robin: the first slot gets the heaviest family, and every prefix of slots is as close to the
    weights as whole slots allow)."""
    active = [(family, float(weights.get(family, 0.0))) for family in FAMILIES if weights.get(family, 0.0) > 0]
    total = sum(weight for _, weight in active)
    credit = dict.fromkeys((family for family, _ in active), 0.0)
    chosen: list[Family] = []
    for _ in range(count):
        for family, weight in active:
            credit[family] += weight
        best = max(credit, key=lambda family: credit[family])  # ties: the earlier family in FAMILIES
        credit[best] -= total
        chosen.append(best)  # type: ignore[arg-type]
    return chosen


class MissingInfoDraft(TaskDraft):
    withheld: str = Field(
        description="The value the task leaves out, exactly as the call needs it.", max_length=200
    )
    withheld_as: str = Field(
        description="The name of the missing value, 1-2 words, as the assistant would ask for it (e.g. 'amount').",
        max_length=60,
    )


class RefusingDraft(TaskDraft):
    refused_call: GoldAction = Field(description="The call the environment must refuse or answer with an error.")


class PolicyTrapDraft(RefusingDraft):
    refusal_facts: list[Annotated[str, Field(max_length=200)]] = Field(
        min_length=1, max_length=6,
        description="Values from the state, exactly as a look-up returns them, that show why the request is "
        "forbidden (a slot's status, a referral's expiry date); an answer that declines must state them.",
    )  # fmt: skip


class InfeasibleDraft(RefusingDraft):
    checklist: list[Annotated[str, Field(max_length=300)]] = Field(default_factory=list, max_length=0)
    answer_facts: list[Annotated[str, Field(max_length=200)]] = Field(min_length=1, max_length=6)


def task_model(family: str) -> type[TaskDraft]:
    """The task writer's structured output for a family."""
    if family == "missing_info":
        return MissingInfoDraft
    if family == "infeasible":
        return InfeasibleDraft
    if family == "policy_trap":
        return PolicyTrapDraft
    if family in REFUSING:
        return RefusingDraft
    return TaskDraft


def family_note(family: str) -> str:
    """What the task writer is told about its family ('' for plain and long_context)."""
    return prompt(f"scenario_family_{family}") if family in WRITTEN and family != "plain" else ""


def family_texts(family: str, task: TaskDraft, modes: Sequence[str]) -> dict[str, str]:
    """What the user says in each mode, for the sufficiency gate: the task, or the user script. A missing_info
    task lacks a value by design in its task, a policy_trap task the alternative; only the conversational script
    must hold everything."""
    said = {"non_conversational": task.task, "conversational": f"{task.known_up_front}\n{task.reveal_when_asked}"}
    graded = ("conversational",) if family in ("missing_info", "policy_trap") else modes
    return {mode: said[mode] for mode in modes if mode in graded}


def refused_call(task: TaskDraft) -> Action | None:
    """The call a refusing family's environment must refuse (None for the other families)."""
    if not isinstance(task, RefusingDraft):
        return None
    return Action(name=task.refused_call.name, arguments=task.refused_call.arguments)


ARTICLES = ("the ", "a ", "an ", "your ", "my ", "his ", "her ", "their ")


def asked_for(withheld_as: str) -> str:
    """What a missing_info answer must name: `withheld_as` without a leading article or possessive ("the star
    rating" -> "star rating"), so "which star rating?" states it as well as "the star rating"."""
    text = " ".join(withheld_as.split())
    while (lowered := text.casefold()).startswith(ARTICLES):
        text = text[len(next(a for a in ARTICLES if lowered.startswith(a))) :]
    return text or withheld_as


def withheld(task: TaskDraft) -> tuple[str, str] | None:
    """A missing_info task's (withheld value, the request that must lack it); None for the other families."""
    return (task.withheld, task.task) if isinstance(task, MissingInfoDraft) else None


def gold_note(family: str, task: TaskDraft) -> str:
    """What the gold writer is told of a family's task ('' for plain and long_context)."""
    if isinstance(task, MissingInfoDraft):
        return f"When asked, the user also says: {task.reveal_when_asked}"
    if not isinstance(task, RefusingDraft):
        return ""
    call = f"{task.refused_call.name}({json.dumps(task.refused_call.arguments, ensure_ascii=False)})"
    notes = {
        "infeasible": f"The rules forbid this request ({call} is refused): write only the look-ups that show why, "
        "and no call that changes the state.",
        "policy_trap": f"What the user asks is forbidden ({call} is refused). Told so, the user says: "
        f"{task.reveal_when_asked} Solve it that way.",
        "error_recovery": f"{call} fails (a detail the user gives is stale): do not make it; find the right record "
        "by the other detail.",
    }
    return notes.get(family, "")


def family_prompts(family: str) -> tuple[str, ...]:
    """The prompt names a family's scenarios are written with (for provenance)."""
    return (f"scenario_family_{family}",) if family_note(family) else ()

