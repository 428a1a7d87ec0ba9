"""The family gates that read a verified slot's evidence, and what a family's one-shot row is graded by when it
is not the conversational task (docs/scenarios.md §9).

- `missing_info`: its one-shot row grades "change nothing, say what is missing", so the withheld value must block
  every change the task asks for. `doable_without` finds the state-changing gold calls that do not need it: a
  call needs it when one of its arguments is the value, or a value that only a call needing it returned (the slot
  found on the withheld date); a value the user says, or a call not needing it returned, carries nothing. Such a
  call fails the slot as `doable_without_withheld` (a new task is written).
- `policy_trap`: the one-shot text asks for the forbidden thing and states no alternative, so, as tau-bench's
  policy has it (no consequential change without the user's explicit yes), the one-shot agent changes nothing and
  declines, saying why: the row's answer facts are the draft's `refusal_facts`, its gold the look-ups before the
  gold's first change, which must return them (`answer_not_read` otherwise).
"""

from __future__ import annotations

import json
import re
from typing import Any

from builder.envs.answer import is_number, states
from builder.json_values import leaves
from builder.stages.scenarios.emitted import Declined
from builder.stages.scenarios.families import MissingInfoDraft, PolicyTrapDraft
from builder.stages.scenarios.requests import TaskDraft
from builder.stages.scenarios.verify import Evidence

_TOKEN = re.compile(r"[\w.@:+-]+")


def family_problem(task: TaskDraft, evidence: Evidence) -> Evidence | None:
    """The evidence of a verified slot failed by its family's own gate, or None when it holds."""
    if isinstance(task, MissingInfoDraft):
        doable = doable_without(task.withheld, evidence, task.task)
        if doable:
            detail = (f"{', '.join(doable)} can be done without the withheld {task.withheld_as!r}; in the one-shot "
                      "task nothing may be doable without it")  # fmt: skip
            return evidence.model_copy(update={"reason": "doable_without_withheld", "detail": detail,
                                               "gold_problems": (detail,)})  # fmt: skip
    if isinstance(task, PolicyTrapDraft):
        read = "\n".join(result.result for result in _look_ups(evidence))
        unread = [f"refusal fact {fact!r}: no look-up before the first change returns it" for fact in task.refusal_facts
                  if not states(read, fact)]  # fmt: skip
        unread += [f"refusal fact {fact!r}: the user already says it" for fact in task.refusal_facts
                   if not is_number(fact) and states(task.task, fact)]  # fmt: skip
        if unread:
            detail = " | ".join(unread)
            return evidence.model_copy(update={"reason": "answer_not_read", "detail": detail,
                                               "gold_problems": tuple(unread)})  # fmt: skip
    return None


def one_shot_decline(task: TaskDraft, evidence: Evidence, withheld_as: str) -> Declined | None:
    """What a missing_info or policy_trap slot's non-conversational row is graded by (None: as its task)."""
    if isinstance(task, MissingInfoDraft):
        return Declined((withheld_as,))
    if isinstance(task, PolicyTrapDraft):
        return Declined(tuple(task.refusal_facts), evidence.actions[: len(_look_ups(evidence))])
    return None


def _look_ups(evidence: Evidence) -> list[Any]:
    first = min(evidence.state_changing_calls, default=len(evidence.gold))
    return list(evidence.gold[:first])


def doable_without(value: str, evidence: Evidence, said: str) -> list[str]:
    """The state-changing gold calls ("call 3 book_appointment") that do not need `value` (module docstring)."""
    wanted = _fold(value)
    told = {_fold(token) for token in _TOKEN.findall(said)}
    carriers: set[str] = set()  # values only calls that need `value` returned
    plain: set[str] = set()  # values a call that does not need it returned
    doable = []
    for number, (action, result) in enumerate(zip(evidence.actions, evidence.gold, strict=True), 1):
        arguments = {_fold(leaf) for leaf in leaves(action.arguments) if not isinstance(leaf, bool | None)}
        needs = wanted in arguments or bool(arguments & carriers)
        returned = _returned(result.result)
        if needs:
            carriers |= returned - plain - told
        else:
            plain |= returned
            carriers -= returned
            if result.state_changed:
                doable.append(f"call {number} {action.name}")
    return doable


def _returned(text: str) -> set[str]:
    try:
        return {_fold(leaf) for leaf in leaves(json.loads(text)) if not isinstance(leaf, bool | None)}
    except ValueError:  # a clipped result: its words
        return {_fold(token) for token in _TOKEN.findall(text)}


def _fold(value: Any) -> str:
    return str(value).strip().casefold()
