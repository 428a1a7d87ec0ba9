"""The records of a state, the links between them, and argument values one user's goal admits.

A graph chain is one user's goal: it starts from an **anchor**, a record of a collection whose records carry a
key a user knows (a name, an email, a number), and every record its arguments name must be **linked** to that
anchor: the anchor itself, a record it references or that references it, or a record those reference (a patient,
their appointments, and those appointments' dentist, slot and service). A reference is a field whose value is the
key of a record of another collection (read from the values, so no naming convention is assumed).

Values the chain may use besides the linked records' keys and fields: **vocabulary** (a value several records
share, such as a city or a status: a word of the domain, not one record's), an enum of the schema or a choice
the parameter's description lists ("in_person or virtual"), and dates made from the scenario's `now` (a write's
date after `now` and after the dates of the records it touches; an end after its start).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

Ref = tuple[str, str]  # (collection, key) of one record
USER_KEYS = ("name", "email", "phone", "number", "title", "code", "username", "full_name", "plate", "sku")
DATE_WORDS = ("date", "time", "start", "end", "until", "deadline", "due", "when", "at")
KEY_WORDS = ("id", "symbol", "ticker", "code", "sku", "ref")  # a parameter named so takes a record's key
PEOPLE = (
    "patient",
    "customer",
    "member",
    "user",
    "client",
    "holder",
    "student",
    "guest",
    "passenger",
    "employee",
    "owner",
    "traveler",
    "traveller",
    "tenant",
    "subscriber",
    "person",
    "people",
    "account",
    "donor",
    "visitor",
    "attendee",
    "participant",
    "resident",
    "applicant",
    "borrower",
    "renter",
    "buyer",
    "driver",
    "rider",
)
PERSONS = tuple(word for word in PEOPLE if word != "account")  # one user moves money between their own accounts


@dataclass
class World:
    """The state's maps of records: each record by (collection, key), its outgoing references, and shared values."""

    records: dict[Ref, dict[str, Any]] = field(default_factory=dict)
    key_field: dict[str, str] = field(default_factory=dict)  # collection -> the field that repeats its key
    out: dict[Ref, set[Ref]] = field(default_factory=dict)
    back: dict[Ref, set[Ref]] = field(default_factory=dict)
    vocabulary: set[str] = field(default_factory=set)

    def keys(self, collection: str) -> list[str]:
        return [key for (name, key) in self.records if name == collection]

    def owner(self, value: Any) -> list[Ref]:
        """The records whose key is `value`."""
        return [ref for ref in self.records if ref[1] == value] if isinstance(value, str) else []


def world_of(state: dict[str, Any]) -> World:
    """The records of every map of records in `state` and the references between them."""
    world = World()
    for collection, value in state.items():
        if isinstance(value, dict) and value and all(isinstance(r, dict) for r in value.values()):
            for key, record in value.items():
                world.records[(collection, str(key))] = record
            fields = Counter(f for key, r in value.items() for f, v in r.items() if v == key)
            if fields and fields.most_common(1)[0][1] == len(value):
                world.key_field[collection] = fields.most_common(1)[0][0]
    owners: dict[str, list[Ref]] = {}
    for ref in world.records:
        owners.setdefault(ref[1], []).append(ref)
    shared: Counter[tuple[str, str]] = Counter()
    for ref, record in world.records.items():
        for name, value in record.items():
            for item in value if isinstance(value, list) else [value]:
                if not isinstance(item, str):
                    continue
                for target in owners.get(item, []):
                    if target != ref:
                        world.out.setdefault(ref, set()).add(target)
                        world.back.setdefault(target, set()).add(ref)
                if not owners.get(item):
                    shared[(name, item)] += 1
    world.vocabulary = {value for (_, value), count in shared.items() if count >= 2}
    return world


def linked(world: World, anchor: Ref) -> set[Ref]:
    """The anchor, the records it references or that reference it, and the records those reference."""
    near = {anchor} | world.out.get(anchor, set()) | world.back.get(anchor, set())
    return near | {far for ref in near for far in world.out.get(ref, set())}


def allowed(world: World, anchor: Ref) -> set[Ref]:
    """The records a chain anchored at `anchor` may name: its linked records, records whose references lead to the
    anchor (a claim of the holder's policy), and shared records whose references lead to no record of the anchor's
    kind (a catalogue, a clinic, a dentist's free slot); never another record of the anchor's collection nor a
    record whose references lead to one and not to the anchor (another patient's appointment or claim)."""
    kind = anchor[0]
    admitted = linked(world, anchor)
    for ref in world.records:
        if ref[0] == kind:
            continue
        leads_to = reached(world, ref)
        mine = anchor in leads_to
        if mine or not any(other[0] == kind for other in leads_to):
            admitted.add(ref)
    return admitted - {ref for ref in world.records if ref[0] == kind and ref != anchor}


def reached(world: World, start: Ref, depth: int = 4) -> set[Ref]:
    """The records `start`'s references lead to, following references up to `depth` steps."""
    seen: set[Ref] = set()
    frontier = {start}
    for _ in range(depth):
        frontier = {far for ref in frontier for far in world.out.get(ref, set())} - seen - {start}
        seen |= frontier
    return seen


def user_facing(world: World, collection: str) -> int:
    """How many keys a user knows (a name, an email, a number) a collection's records carry (0: none), and 3 more
    for a collection of people (patients, customers, members: the users whose goals the tasks are)."""
    records = [r for (name, _), r in world.records.items() if name == collection]
    if not records:
        return 0
    keys = sum(any(k in field.casefold() for k in USER_KEYS) for field in records[0])
    people = any(word in collection.casefold() for word in PEOPLE)
    return keys + (3 if keys and people else 0)


def people_named(world: World, values: list[Any]) -> set[Ref]:
    """The records of collections of people (`PEOPLE`: patients, donors, guests) that `values` name by key: a
    chain naming two acts for two people, which no one user asks (a donor booking for his nephew)."""
    return {ref for value in values for ref in world.owner(value) if any(w in ref[0].casefold() for w in PERSONS)}


def collection_of(world: World, parameter: str, schema: dict[str, Any]) -> str | None:
    """The collection whose key a parameter takes: its key field (`new_slot_id` ends with `slot_id`), else the
    collection its name or description names (`dentist_id` -> dentists)."""
    if "enum" in schema:
        return None
    name = parameter.casefold()
    collections = sorted({c for c, _ in world.records}, key=len, reverse=True)
    for collection in collections:
        key_field = world.key_field.get(collection, "").casefold()
        if key_field and (name == key_field or name.endswith("_" + key_field)):
            return collection
    for collection in collections:  # `stocks` names the collection itself (a list of its keys)
        if name == collection.casefold():
            return collection
    if not (name.endswith("_id") or name == "id" or name.rsplit("_", 1)[-1] in KEY_WORDS):
        return None
    words = f"{parameter} {schema.get('description', '')}".casefold()
    for collection in collections:
        stem = collection.casefold().removesuffix("s")
        if len(stem) > 2 and (stem in words or stem.split("_")[-1] in name):
            return collection
    return None


def coherent_value(world: World, value: Any, allowed: set[Ref]) -> bool:
    """Whether a state value may appear in a chain anchored where `allowed` says: a linked record's key or one of
    its field values, vocabulary, or a value of no record (a constant, a date, a created id)."""
    if not isinstance(value, str) or value in world.vocabulary:
        return True
    owners = world.owner(value)
    if owners:
        return any(ref in allowed for ref in owners)
    holders = [ref for ref, record in world.records.items() if value in _strings(record)]
    return not holders or any(ref in allowed for ref in holders)


def _strings(record: dict[str, Any]) -> list[str]:
    found = []
    for value in record.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                found.append(item)
    return found


def described_choices(schema: dict[str, Any]) -> list[str]:
    """The values a parameter's description lists in words (`in_person or virtual`, `one of a, b, c`): snake or
    lower-case tokens joined by commas and a final `or`."""
    text = schema.get("description", "")
    match = re.search(r"((?:[a-z][a-z0-9_]*, )*[a-z][a-z0-9_]*,? or [a-z][a-z0-9_]*)", text)
    if match is None:
        return []
    return [w for w in re.split(r",? or |, ", match.group(1)) if w]


def is_date(parameter: str, schema: dict[str, Any]) -> bool:
    words = re.split(r"[_\W]+", parameter.casefold())
    text = schema.get("description", "")
    return "YYYY" in text or "ISO" in text or any(word in DATE_WORDS for word in words)


def date_values(
    parameter: str, schema: dict[str, Any], now: str, touched: list[dict[str, Any]], earlier: dict[str, Any],
    rng: random.Random,
) -> list[str]:  # fmt: skip
    """Dates for a parameter of a changing call, in the format its description (or the state) uses: after `now`
    and after the dates of the records the call touches; an `end`/`until` after the call's start argument."""
    shape = _format(schema.get("description", ""), [v for r in touched for v in r.values()])
    base = datetime.fromisoformat(now)
    starts = [_parse(v) for k, v in earlier.items() if any(w in k for w in ("start", "from", "begin"))]
    starts = [s for s in starts if s is not None]
    if starts and any(w in parameter for w in ("end", "until", "to")):
        return [_render(max(starts) + timedelta(hours=hours), shape) for hours in (1, 2, 24)]
    if "birth" in parameter:
        return [_render(base.replace(year=base.year - rng.randint(20, 70), hour=0, minute=0), shape)]
    latest = [d for r in touched for v in r.values() if (d := _parse(v)) is not None]
    candidates = []
    for floor in (max([base, *latest]), base):
        day = floor + timedelta(days=rng.randint(1, 10))
        candidates.append(_render(day.replace(hour=rng.choice((9, 10, 11, 14, 15)), minute=0, second=0), shape))
    candidates.append(_render((base - timedelta(days=rng.randint(1, 5))).replace(minute=0, second=0), shape))
    return list(dict.fromkeys(candidates))  # after the records, after now, and (for a past event) before now


def _format(description: str, samples: list[Any]) -> str:
    if "YYYY-MM-DDTHH:MM:SS" in description or "HH:MM:SS" in description:
        return "%Y-%m-%dT%H:%M:%S"
    if "YYYY-MM-DDTHH:MM" in description or "YYYY-MM-DD HH:MM" in description:
        return "%Y-%m-%dT%H:%M" if "T" in description else "%Y-%m-%d %H:%M"
    if "YYYY-MM-DD" in description:
        return "%Y-%m-%d"
    for value in samples:
        if isinstance(value, str) and _parse(value) is not None:
            return {10: "%Y-%m-%d", 16: "%Y-%m-%dT%H:%M"}.get(len(value), "%Y-%m-%dT%H:%M:%S")
    return "%Y-%m-%dT%H:%M:%S"


def _parse(value: Any) -> datetime | None:
    if not isinstance(value, str) or not re.fullmatch(r"\d{4}-\d\d-\d\d([T ]\d\d:\d\d(:\d\d)?)?", value):
        return None
    try:
        return datetime.fromisoformat(value)
    except ValueError:
        return None


def _render(moment: datetime, shape: str) -> str:
    return moment.strftime(shape)
