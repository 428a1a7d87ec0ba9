"""What a sampled chain's user asks to be told, and the values the answer must then state (`answer_facts`).

A read whose result no later call of the chain takes is no look-up the assistant needs: it is there because the
user wants to hear what it returns (a **reported** read). Its answer facts are one or two distinctive values the
read returned: text with a digit, a capital or a space (an id, a date, a time, a name), else a number of at least
10 (a balance, an amount; a small count would match any digit), never a bare word of the domain (`active`), a long
description (a paraphrase would miss it), a value the user gives a call, nor a value the chain changes or creates
(the agent may read it before or after the change) unless the read comes after every change (a balance after the
transfer: the final state's). From a list, the first and the last item each give one.
`builder.envs.answer` grades them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from builder.json_values import leaves
from builder.stages.scenarios.chain import ChainCall

FACTS_PER_READ = 2
MAX_FACTS = 4  # per chain: an answer stating more is a recitation
MAX_FACT_CHARS = 40
STAMPS = ("timestamp", "created", "updated", "modified", "recorded", "logged")  # bookkeeping times: asked last
_DISTINCT = re.compile(r"[\dA-Z ]")


def reported(calls: Sequence[ChainCall]) -> list[int]:
    """The indices of the reads (calls that changed nothing) whose results no later call takes."""
    fed = {source.split()[1] for call in calls for source in call.sources.values() if source.startswith("result ")}
    return [i for i, call in enumerate(calls) if not call.changed and str(i + 1) not in fed]


def read_facts(call: ChainCall, calls: Sequence[ChainCall], initial: Any, final: Any) -> list[str]:
    """Up to FACTS_PER_READ distinctive values of `call`'s result (the module docstring's rule), names and dates
    first."""
    said = {_text(v) for c in calls for v in leaves(c.arguments)}
    last_change = max((i for i, c in enumerate(calls) if c.changed), default=-1)
    stable = _strings(final) if calls.index(call) > last_change else _strings(initial) & _strings(final)
    items = call.result
    if isinstance(items, dict):
        lists = [v for v in items.values() if isinstance(v, list) and v]
        items = lists[0] if len(lists) == 1 else items
    groups = [items[0], items[-1]] if isinstance(items, list) and len(items) > 1 else [items]
    facts: list[str] = []
    for group in groups:
        options = [v for v in _ranked(group) if v not in said and v in stable and v not in facts]
        if options:
            facts.append(options[0])
    if len(facts) < FACTS_PER_READ and len(groups) == 1:
        more = [v for v in _ranked(groups[0]) if v not in said and v in stable and v not in facts]
        facts += more[: FACTS_PER_READ - len(facts)]
    return facts[:FACTS_PER_READ]


def _ranked(value: Any) -> list[str]:
    """The distinctive values of a result: those of name-like fields, then dates, then the rest (ids, phones),
    then bookkeeping times (`booked_at`, `created`: no user asks for them), then numbers."""
    found: list[tuple[int, str]] = []

    def walk(item: Any, field: str) -> None:
        if isinstance(item, dict):
            for key, inner in item.items():
                walk(inner, str(key))
        elif isinstance(item, list):
            for inner in item:
                walk(inner, field)
        elif isinstance(item, str) and _distinctive(item):
            name = field.casefold()
            stamp = name.endswith("_at") or any(word in name for word in STAMPS)
            dated = re.search(r"\d{4}-\d\d-\d\d", item) is not None
            rank = 0 if "name" in name or "title" in name else 3 if stamp else 1 if dated else 2
            found.append((rank, item))
        elif isinstance(item, int | float) and not isinstance(item, bool) and abs(item) >= 10:
            found.append((4, _text(item)))

    walk(value, "")
    return [text for _, text in sorted(found, key=lambda pair: pair[0])]


def _distinctive(text: str) -> bool:
    text = text.strip()
    return 3 <= len(text) <= MAX_FACT_CHARS and bool(_DISTINCT.search(text)) and "_" not in text


def _text(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def _strings(value: Any) -> set[str]:
    """The strings, record keys and numbers (as text) of a JSON value."""
    if isinstance(value, dict):
        return set().union(*map(_strings, value.values())) | {k for k in value if isinstance(k, str)}
    if isinstance(value, list):
        return set().union(*map(_strings, value))
    return {_text(value)} if isinstance(value, str | int | float) and not isinstance(value, bool) else set()


def without(calls: list[ChainCall], dropped: list[int]) -> list[ChainCall]:
    """`calls` without the calls at `dropped` (reads no later call takes), later `result N` sources renumbered."""
    if not dropped:
        return calls

    def renumbered(source: str) -> str:
        if not source.startswith("result "):
            return source
        _, number, *rest = source.split(" ", 2)
        shifted = int(number) - sum(1 for i in dropped if i + 1 < int(number))
        return " ".join(["result", str(shifted), *rest])

    return [
        call.model_copy(update={"sources": {p: renumbered(s) for p, s in call.sources.items()}})
        for i, call in enumerate(calls) if i not in dropped
    ]  # fmt: skip
