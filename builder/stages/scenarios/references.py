"""References in a gold sequence: an argument value that stands for part of what an earlier call returns.

A gold sequence is written in one reply, before any call runs, so a call that needs the id of a record an earlier
call creates (register a patient, then book for them) cannot spell it out. It writes a reference instead: the
whole argument value is the string `"$<call>.<path>"`, the call numbered from 1 in the sequence and the path
going into that call's result by keys and list indices:

    "$2.loan_id"   "$2.loan.loan_id"   "$1[0].book_id"   "$1.items.0.id"   "$2['loan id']"   "${2.loan.loan_id}"

A reference resolves to the value found there, of whatever JSON type (a number stays a number). The path names at
least one key, so a money amount such as "$5.00" stays a literal. A leading `result` is the result itself when the
result has no key `result` ("$2.result.loan_id", as a model may write it). A reference nested in a list or
dict argument resolves too; one inside a longer text does not (it is refused: a reference is a whole value).

The verifier resolves each call's references against the actual results of the calls before it, just before
the call runs; the resolved, concrete sequence is what is stored, published and replayed. Pure functions.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from builder.limits import RESULT_CHARS

_KEY = r"[A-Za-z_][\w\-]*"
_SEGMENT = rf"\.{_KEY}|\.\d+|\[-?\d+\]|\[\s*'[^']*'\s*\]|\[\s*\"[^\"]*\"\s*\]"
_PATH = rf"(?:{_SEGMENT})+"
_REFERENCE = re.compile(rf"\$(?:\{{(\d+)({_PATH})\}}|(\d+)({_PATH}))")
_PARTS = re.compile(rf"\.({_KEY})|\.(\d+)|\[(-?\d+)\]|\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]")


@dataclass(frozen=True)
class Reference:
    call: int  # 1-based number of the call in the sequence
    path: tuple[str | int, ...]  # keys (str) and list indices (int)
    text: str  # as written


@dataclass(frozen=True)
class Earlier:
    """What an earlier call of the sequence gave: its tool, whether it succeeded, and its JSON result (or
    error)."""

    name: str
    ok: bool
    result: Any


def parse(value: Any) -> Reference | None:
    """The reference `value` is, or None for a literal (any non-string, or a string of another form)."""
    if not isinstance(value, str):
        return None
    match = _REFERENCE.fullmatch(value.strip())
    if match is None:
        return None
    call, path = (match[1], match[2]) if match[1] is not None else (match[3], match[4])
    parts: list[str | int] = []
    for part in _PARTS.finditer(path):
        key, dotted, index, single, double = part.groups()
        if key is not None:
            parts.append(key)
        elif single is not None or double is not None:
            parts.append(single if single is not None else double)
        else:
            parts.append(int(dotted if dotted is not None else index))
    if all(isinstance(part, int) for part in parts):
        return None  # "$5.00", "$3.50": money, not a reference
    return Reference(call=int(call), path=tuple(parts), text=value)


def has_reference(value: Any) -> bool:
    """Whether `value` holds a reference anywhere (nested in lists and dicts)."""
    if isinstance(value, dict):
        return any(has_reference(item) for item in value.values())
    if isinstance(value, list):
        return any(has_reference(item) for item in value)
    return parse(value) is not None


def resolve(arguments: dict[str, Any], earlier: Sequence[Earlier], number: int) -> tuple[dict[str, Any], list[str]]:
    """`arguments` of call `number` (1-based) with every reference replaced by the value it names in `earlier`
    (the calls before it, in order), and why the references that cannot be resolved cannot (then the arguments
    are not to be used)."""
    problems: list[str] = []

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {key: walk(item, f"{where}.{key}") for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item, f"{where}[{i}]") for i, item in enumerate(value)]
        reference = parse(value)
        if reference is None:
            inside = [m[0] for m in _REFERENCE.finditer(value) if parse(m[0])] if isinstance(value, str) else []
            if inside:
                problems.append(
                    f"{where} = {value!r}: a reference must be the whole argument value ({json.dumps(inside[0])} "
                    "alone), not part of a text"
                )
            return value
        found, problem = _follow(reference, earlier, number)
        if problem:
            problems.append(f"{where} = {value!r} {problem}")
        return found

    resolved = {name: walk(value, name) for name, value in arguments.items()}
    return resolved, problems


def _follow(reference: Reference, earlier: Sequence[Earlier], number: int) -> tuple[Any, str]:
    """The value `reference` names, or why there is none."""
    call = reference.call
    if call < 1 or call >= number:
        return None, (
            f"refers to call {call}, which does not come before call {number}: a reference names an earlier call "
            "of this sequence by its number, counting from 1"
        )
    source = earlier[call - 1]
    if not source.ok:
        return None, f"refers to call {call} ({source.name}), which failed, so it returned nothing to use"
    value, path = source.result, list(reference.path)
    if path and path[0] == "result" and not (isinstance(value, dict) and "result" in value):
        path.pop(0)  # "$2.result.loan_id": the result itself
    for depth, part in enumerate(path):
        step = _step(value, part)
        if step is None:
            at = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path[:depth]) or " itself"
            shown = json.dumps(source.result, ensure_ascii=False)[:RESULT_CHARS]
            return None, (
                f"names a path call {call} ({source.name}) did not return: its result{at} has no "
                f"{'item' if isinstance(part, int) else 'key'} {part!r}. It returned: {shown}"
            )
        value = step[0]
    return value, ""


def _step(value: Any, part: str | int) -> tuple[Any] | None:
    """`value[part]` (in a 1-tuple), or None when it has no such key or item."""
    if isinstance(value, dict):
        key = str(part)
        return (value[key],) if key in value else None
    if isinstance(value, list) and isinstance(part, int) and -len(value) <= part < len(value):
        return (value[part],)
    return None
