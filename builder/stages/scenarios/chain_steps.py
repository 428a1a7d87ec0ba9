"""What a step of a sampled chain must not be (`builder.stages.scenarios.chains`): the rules that keep a chain one
user's plausible request rather than calls stitched together because the tools accept them.

- **No-op writes** (`noop_write`): a call of a state-changing tool whose own diff is empty, or an argument that sets
  a field of the record the call names to the value it already has ("re-save her email as it is on file") or had
  before the chain (freezing then unfreezing: a change the chain undoes, which the negative control refuses). An
  optional such argument is left out; a call whose every value argument is such is not made.
- **Free text** (`free_text_unfit`): a string parameter of a write with no enum, no id, reference, date, email
  or name, whose name says it is prose (a reason, a note, a description: FREE_TEXT) takes only the value the record the
  call names already holds in that field, never an id of any collection nor text of another record; an optional
  one with no such value is left out, a required one makes the step skipped.
- **Empty reads** (`empty_read`): a read that returned nothing (an empty list, not found) is no step of a
  request; it is left out of the chain.
- **Undone writes** (`undoes_write`): a write that sets back to its initial value what an earlier step of the
  chain changed (book a slot, then cancel that booking) drops the attempt: one user asks for one or the other.
- **Duplicate records** (`duplicate_record`): a create whose identifying value (a name, an email, a title) equals
  that of an existing record of the same collection is not sampled (a second "Daniel Okafor").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from builder.json_values import added_records
from builder.stages.scenarios.anchors import World, collection_of, described_choices, is_date
from builder.stages.scenarios.chain_values import first_values, schema_kind

# Parameter words of free text: prose a person writes about one record, which no other record's value fits.
FREE_TEXT = (
    "reason", "note", "notes", "description", "comment", "comments", "message", "details", "summary", "remarks",
    "memo", "instructions", "explanation", "feedback", "text", "body", "content", "symptoms", "complaint",
    "justification", "resolution", "narrative",
)  # fmt: skip
# Fields whose equal value makes a new record a duplicate of an existing one of the same collection.
IDENTIFYING = (
    "name", "full_name", "title", "email", "username", "phone", "phone_number", "sku", "plate", "file_name", "filename",
)  # fmt: skip


def is_free_text(parameter: str) -> bool:
    """Whether a string parameter (already known to be no enum, no listed choice, no date and no record key) holds
    free text: its name's last word is one of FREE_TEXT (`reason`, `denial_reason`, `note`, `description`); an
    id, a reference, a name, an email, a code or a filter is not."""
    words = [word for word in re.split(r"[_\W]+", parameter.casefold()) if word]
    return bool(words) and words[-1] in FREE_TEXT


def field_of(record: dict[str, Any], parameter: str) -> str | None:
    """The field of `record` a parameter sets: the same name, else the one field whose name contains it or that
    it ends with (`accepting` -> `accepting_new_patients`, `new_status` -> `status`)."""
    if parameter in record:
        return parameter
    close = [
        f for f in record
        if f.startswith(parameter + "_") or f.endswith("_" + parameter) or parameter.endswith("_" + f)
    ]  # fmt: skip
    return close[0] if len(close) == 1 else None


def records_named(state: dict[str, Any], value: Any) -> list[tuple[str, dict[str, Any]]]:
    """(collection, record) of every record of `state` (a map of records) whose key is `value`."""
    if not isinstance(value, str):
        return []
    return [
        (collection, records[value])
        for collection, records in state.items()
        if isinstance(records, dict) and isinstance(records.get(value), dict)
    ]


def targets(state: dict[str, Any], arguments: dict[str, Any], collection: str | None) -> list[dict[str, Any]]:
    """The records of `collection` (the one the tool's name names: `update_patient_contact` -> patients) that the
    call names by key, in `state` (the state before the call); none for a tool that names no collection."""
    if collection is None:
        return []
    return [record for value in arguments.values() for c, record in records_named(state, value) if c == collection]


def unchanged_arguments(arguments: dict[str, Any], state: dict[str, Any], written: list[dict[str, Any]]) -> set[str]:
    """The arguments that set a field of a `written` record to the value that field already holds."""
    same = set()
    for parameter, value in arguments.items():
        if records_named(state, value):
            continue  # a key naming a record, not a value set on it
        for record in written:
            field = field_of(record, parameter)
            if field is not None and record[field] == value:
                same.add(parameter)
    return same


def without_noop(
    arguments: dict[str, Any], state: dict[str, Any], written: list[dict[str, Any]], required: set[str]
) -> dict[str, Any] | None:
    """`arguments` without the optional ones that set a value a `written` record already has; None when every
    value argument left (at least one) does so: the call would change nothing."""
    same = unchanged_arguments(arguments, state, written)
    if not same:
        return arguments
    values = [p for p, v in arguments.items() if not records_named(state, v)]
    if all(p in same for p in values):
        return None  # it names a record and sets nothing new on it
    return {p: v for p, v in arguments.items() if p not in same or p in required}


def free_text_values(parameter: str, state: dict[str, Any], written: list[dict[str, Any]]) -> list[str]:
    """The values a free-text parameter may take: what the `written` records hold in that field, when that is
    text and no record's key."""
    found = []
    for record in written:
        field = field_of(record, parameter)
        held = record.get(field) if field is not None else None
        if isinstance(held, str) and held.strip() and not records_named(state, held):
            found.append(held)
    return list(dict.fromkeys(found))


def duplicate_values(collection: str | None, parameter: str, state: dict[str, Any]) -> set[Any]:
    """The values of an identifying field (a name, an email) the records of `collection` already hold: a create
    of that collection must not take them."""
    if collection is None or parameter.casefold() not in IDENTIFYING:
        return set()
    records = state.get(collection)
    if not isinstance(records, dict):
        return set()
    return {r[parameter] for r in records.values() if isinstance(r, dict) and isinstance(r.get(parameter), str)}


def duplicates(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The records `after` adds (to a map of records) whose identifying value equals an existing record's in the
    same collection, as `collection/key (field=value)`."""
    found = []
    for collection, key, record in added_records(before, after):
        existing = [r for r in before[collection].values() if isinstance(r, dict)]
        for field in IDENTIFYING:
            value = record.get(field)
            if isinstance(value, str) and value and any(r.get(field) == value for r in existing):
                found.append(f"{collection}/{key} ({field}={value!r})")
    return found


_ABSENT = object()  # a path the initial state does not have


def undone(initial: Any, before: Any, after: Any, path: str = "") -> list[str]:
    """The paths an earlier step of the chain changed (`before` differs from `initial` there) that this step sets
    back to their initial value: booking a slot then cancelling that booking, freezing then unfreezing. A user asks
    for one or the other, and the negative control cannot tell such a step from no step."""
    if isinstance(before, dict) and isinstance(after, dict):
        start = initial if isinstance(initial, dict) else {}
        inner = [(key, f"{path}.{key}".lstrip(".")) for key in before.keys() & after.keys()]
        return [found for key, at in inner for found in undone(start.get(key, _ABSENT), before[key], after[key], at)]
    return [path] if before != initial and after == initial and before != after else []


def is_empty(result: Any) -> bool:
    """Whether a read's result holds nothing: no value, an empty list or map, or a map whose every value is
    nothing, a zero count or a false flag with an empty list among them or a false `found` (`{"results": [],
    "count": 0}`, `{"found": false}`); a plain zero (`{"balance": 0}`) is a value."""
    if result is None or result == "" or result == [] or result == {}:
        return True
    if not isinstance(result, dict):
        return False
    fields = {k: v for k, v in result.items() if k not in ("success", "ok", "error", "message")}
    if not fields or not all(v is None or v in ("", [], {}) or v is False or v == 0 for v in fields.values()):
        return False
    return any(v == [] or v == {} for v in fields.values()) or any(fields.get(k) is False for k in ("found", "exists"))


class StepRules:
    """The sampler's use of these rules for a write's options (a part of `chains._Sampler`, kept apart so each
    module stays readable): it reads the sampler's world and its collection helpers."""

    world: World
    schemas: dict[str, dict[str, Any]]
    _collections: Callable[[str], list[str]]  # the sampler's (`chain_plans.Planning`)
    _fed_collection: Callable[[str, str], str | None]  # the sampler's

    def _fitting(
        self, tool: str, parameter: str, schema: dict[str, Any], pool: list[tuple[str, Any]],
        earlier: dict[str, list[tuple[str, Any]]], about: str | None, current: dict[str, Any],
    ) -> list[tuple[str, Any]]:  # fmt: skip
        """A write's options without what this module forbids: free text other than the named record's own
        value, and a create's name or email that an existing record of its collection holds."""
        if self._free_text(tool, parameter, schema):
            named = first_values(earlier)
            return [("state", v) for v in free_text_values(parameter, current, targets(current, named, about))]
        if self._creates(tool, about):
            taken = duplicate_values(about, parameter, current)
            return [(source, v) for source, v in pool if not (isinstance(v, str) and v in taken)]
        return pool

    def _own_text(self, tool: str, arguments: dict[str, Any], about: str | None, current: dict[str, Any]) -> bool:
        """Whether each free-text argument of a write is the text the record this argument set names holds (the
        options came from the likeliest record; a set may name another)."""
        properties = self.schemas[tool].get("properties", {})
        written = targets(current, arguments, about)
        return all(
            value in free_text_values(parameter, current, written)
            for parameter, value in arguments.items()
            if self._free_text(tool, parameter, properties.get(parameter, {}))
        )

    def _creates(self, tool: str, about: str | None) -> bool:
        """Whether a write of the collection its name names (`about`) takes no key of it: it creates a record."""
        return about is not None and about not in self._collections(tool)

    def _free_text(self, tool: str, parameter: str, schema: dict[str, Any]) -> bool:
        return (
            schema_kind(schema) == "string" and "enum" not in schema and not described_choices(schema)
            and not is_date(parameter, schema) and collection_of(self.world, parameter, schema) is None
            and self._fed_collection(tool, parameter) is None and is_free_text(parameter)
        )  # fmt: skip

    def _why_none(
        self, tool: str, parameter: str, schema: dict[str, Any], about: str | None, current: dict[str, Any]
    ) -> str:
        """Why a required parameter of a write has no value: free_text_unfit or duplicate_record leave the step
        out, no_value drops the attempt."""
        if self._free_text(tool, parameter, schema):
            return "free_text_unfit"
        if self._creates(tool, about) and duplicate_values(about, parameter, current):
            return "duplicate_record"
        return "no_value"
