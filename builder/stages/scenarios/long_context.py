"""Long-context states: a verified initial state enlarged with distractor records the task never touches.

`enlarge(state, records=N, protected=..., seed=...)` returns a copy of `state` whose collections of records (the
top-level attributes `builder.json_values.record_pairs` calls collections) hold about N records in total. The
originals stay first, unchanged; the distractors are appended after them. The rules:

- **Proportional sizes.** Each collection grows to `round(size * N / total)` records, never below its own size.
- **A world of copies.** Distractors are made in rounds: round g clones every original record once (collection
  by collection, in order), until each collection reaches its size. A reference inside a clone (a field whose
  values are keys of another collection, or ids of a list collection's items) points at the clone of the same
  round of the record it named, else at another clone of that collection; a clone whose reference has no clone
  to point at is dropped. So distractors form their own consistent world and never attach to the records the
  task is about ("cancel all my bookings" keeps its meaning).
- **Keys in the collection's format.** Keys that share a prefix and a number (`acc-1`, `P-7`, `POL-1003`,
  `0042`) continue the numbering after the largest (`acc-5`, `acc-6`, ...; zero padding kept), so an environment
  that makes the next id from the count or the maximum still makes a fresh one. Other keys (`ABC123`, uuids) get
  random keys of the same shape (letters for letters, digits for digits, hex for hex). A record's own id field
  (`"patient_id": "P-1"` under key `P-1`; `id` / `<thing>_id` of list items, unique across items) gets the new id.
- **Real-looking values.** Per field, from the values the collection's records have: enum-like fields (bools,
  single lowercase tokens such as `in_person`, or few distinct values) take a seen value; numbers are scaled by one
  factor per record (so `approved <= claimed` mostly holds), rounded to the field's step (the gcd of its integer
  values) and kept within the field's observed range; dates and date-times move by one whole-day shift per record
  that keeps the record's dates within the collection's observed range (so `start < end` holds and the time of day
  is kept); person names (a `name`/`author`/`owner`/... field whose values are all one or two capitalised words,
  maybe after `Dr.`) draw each word from other values of the field or a built-in list of first and last names,
  and the record's other texts follow the renamed words (`olivia.bennett@example.com` ->
  `nadia.okafor@example.com`); a one-word text with digits (a phone, a code) gets new digits in its last number;
  other texts and nested values (a status history) are another record's value of that field.
- **Protected values stay unique.** No string inside a distractor (its key included) contains a protected value
  as a whole word sequence, case-insensitively (`Ada Lovelace` blocks `Ada Lovelace Jr` but not `Adam`; `acc-1`
  blocks `acc-1` but not `acc-17`). Enum-like fields are exempt (`savings` does not identify a record). A field
  that conflicts is drawn again from other records; a distractor still conflicting after that is dropped.
- **Deterministic**: the same state, size, protected values and seed give the same result.

Only top-level collections grow; nested ones (a list of items inside a record) are copied with their record.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from builder.json_values import leaves, record_pairs

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")
_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})((?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2})?)$")
_ENUM_TOKEN = re.compile(r"^[a-z][a-z0-9_\-]*$")
_WORD = re.compile(r"[A-Za-z][A-Za-z']+")
_HEX_RUN = re.compile(r"[0-9a-f]*")
_TITLE = re.compile(r"^(?:Dr|Mr|Mrs|Ms|Mx|Prof)\. ")
_PERSON = re.compile(r"^(?:(?:Dr|Mr|Mrs|Ms|Mx|Prof)\. )?[A-Z][a-z'\-]+(?: [A-Z][a-z'\-]+)?$")
_PERSON_FIELD = re.compile(r"name|author|owner|holder|contact|person|guest|customer|patient|member|user")
_FIRST_NAMES = (
    "Aisha Ben Carmen Dmitri Elena Farid Grace Hana Ivan Julia Kofi Lena Marco Nadia Omar Priya Quinn Rosa "
    "Stefan Tara Umar Vera Wei Ximena Yusuf Zoe Diego Ingrid Malik Sofia"
).split()
_LAST_NAMES = (
    "Abara Brennan Castro Dubois Eriksen Fischer Gupta Horvath Ibrahim Jensen Kowalski Lindqvist Moreno Novak "
    "Okafor Petrov Quintero Rossi Sato Tanaka Ueda Varga Walsh Xu Yilmaz Zielinski Haddad Mendes Olsen Park"
).split()
_FIELD_RETRIES = 8
_IDENTIFIER_LIKE = re.compile(r"^\S*[@._0-9]\S*$")  # one word with a symbol or digit: an e-mail, a file name
_KEEP_ENUM = 0.7  # the share of enum values a clone keeps from its template (a paid claim keeps its history)
_MISSING = object()


@dataclass
class _Field:
    """What the values of one field of a collection are, and the values seen."""

    kind: str  # "self_id", "reference", "enum", "number", "person", "text", "other"
    values: list[Any] = field(default_factory=list)
    target: str | None = None  # the referenced collection
    step: int | None = None  # integer step of a number field
    low: float = 0.0
    high: float = 0.0
    seen: set[str] | None = None  # the values so far of a one-word text field whose values are all distinct


@dataclass
class _Collection:
    name: str
    is_list: bool
    pairs: list[tuple[Any, dict[str, Any]]]
    ids: list[Any]  # the keys others refer to: dict keys, or the id field of list items (positions if none)
    id_field: str | None  # the record's own id field, if any
    fields: dict[str, _Field] = field(default_factory=dict)
    date_range: tuple[dt.date, dt.date] | None = None  # of the records' first dates
    clones: dict[tuple[Any, int], Any] = field(default_factory=dict)  # (original id, round) -> clone id
    made: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # (key or None, record)


def enlarge(state: dict[str, Any], *, records: int, protected: Iterable[str] = (), seed: int = 0) -> dict[str, Any]:
    """A copy of `state` whose collections of records hold about `records` records in total, the originals first
    and unchanged, then distractor records (see the module docstring for the rules). A state already as large, or
    without collections, comes back as an unchanged copy."""
    result = copy.deepcopy(state)
    collections = {name: _collection(name, value) for name, value in state.items() if record_pairs(value) is not None}
    total = sum(len(c.pairs) for c in collections.values())
    if total == 0 or records <= total:
        return result
    blocked = _protected_pattern(protected)
    rng = random.Random(seed)
    for c in collections.values():
        _profile(c, collections)
    targets = {name: max(len(c.pairs), round(len(c.pairs) * records / total)) for name, c in collections.items()}
    _allocate_ids(collections, targets, blocked, rng)
    for name, c in collections.items():
        for (original, round_), new_id in c.clones.items():
            record = _clone(c, original, round_, new_id, collections, blocked, rng)
            if record is not None:
                c.made.append((new_id, record))
        value = result[name]
        for new_id, record in c.made:
            if c.is_list:
                value.append(record)
            else:
                value[new_id] = record
    return result


def protected_values(state: dict[str, Any], texts: Iterable[str], arguments: Iterable[Any]) -> set[str]:
    """The values `enlarge` must keep unique for a scenario: every string and number inside the gold's `arguments`
    (as text), and every string value and record key of `state` that the `texts` (the task and the user script's
    parts) mention as a whole word sequence, case-insensitively (two characters at least: `c1` yes, `a` no)."""
    found = {
        str(leaf)
        for leaf in leaves(list(arguments))
        if isinstance(leaf, str | int | float) and not isinstance(leaf, bool)
    }
    said = " ".join(texts).casefold()
    candidates = {leaf for leaf in leaves(state) if isinstance(leaf, str)}
    candidates |= {str(key) for value in state.values() for key, _ in record_pairs(value) or ()}
    for value in candidates:
        folded = value.strip().casefold()
        if len(folded) >= 2 and folded in said and re.search(_whole(folded), said):
            found.add(value)
    return {value for value in found if value.strip()}


def _whole(folded: str) -> str:
    return rf"(?<![0-9a-z]){re.escape(folded)}(?![0-9a-z])"


# ------------------------------------------------------------------------------------------ reading the state


def _collection(name: str, value: Any) -> _Collection:
    pairs = record_pairs(value) or []
    is_list = isinstance(value, list)
    id_field = _own_id_field(pairs, is_list)
    if is_list:
        ids = [record.get(id_field) for _, record in pairs] if id_field else [key for key, _ in pairs]
    else:
        ids = [key for key, _ in pairs]
    return _Collection(name=name, is_list=is_list, pairs=pairs, ids=ids, id_field=id_field)


def _own_id_field(pairs: list[tuple[Any, dict[str, Any]]], is_list: bool) -> str | None:
    """The field holding a record's own id: under a dict, the one equal to the key in every record; in a list,
    `id` or a `<thing>_id` whose values are unique strings or ints across the items (the first such field)."""
    names = [name for name in pairs[0][1] if all(name in record for _, record in pairs)]
    if not is_list:
        return next((n for n in names if all(record[n] == key for key, record in pairs)), None)
    for name in names:
        if name != "id" and not name.endswith("_id"):
            continue
        values = [record[name] for _, record in pairs]
        if all(isinstance(v, str | int) and not isinstance(v, bool) for v in values) and len(set(values)) == len(
            values
        ):
            return name
    return None


def _profile(c: _Collection, collections: dict[str, _Collection]) -> None:
    """The kind of every field of `c`'s records, and the collection's date range."""
    names: list[str] = []
    for _, record in c.pairs:
        names += [name for name in record if name not in names]
    for name in names:
        values = [record.get(name, _MISSING) for _, record in c.pairs]
        values = [v for v in values if v is not _MISSING]
        c.fields[name] = _field(c, name, values, collections)
    firsts = [_first_date(record) for _, record in c.pairs]
    firsts = [d for d in firsts if d is not None]
    c.date_range = (min(firsts), max(firsts)) if firsts else None


def _field(c: _Collection, name: str, values: list[Any], collections: dict[str, _Collection]) -> _Field:
    if name == c.id_field:
        return _Field("self_id", values)
    target = _reference_target(c, name, values, collections)
    if target is not None:
        return _Field("reference", values, target=target)
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return _Field("enum", present)
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        integers = all(isinstance(v, int) for v in present)
        step = math.gcd(*present) if integers else None
        return _Field("number", present, step=step or None, low=min(present), high=max(present))
    if present and all(isinstance(v, str) for v in present):
        if any(_date_of(v) is not None for v in present):
            return _Field("other", present)  # dates move with the record's shift
        distinct = set(present)
        if all(_ENUM_TOKEN.match(v) for v in present) or (len(present) >= 4 and len(distinct) <= len(present) / 2):
            return _Field("enum", present)
        if _PERSON_FIELD.search(name.casefold()) and all(_PERSON.match(v) for v in present):
            return _Field("person", present)
        unique = len(distinct) == len(present) and all(_IDENTIFIER_LIKE.match(v) for v in present)
        return _Field("text", present, seen=set(present) if unique else None)
    return _Field("other", values)


def _reference_target(c: _Collection, name: str, values: list[Any], collections: dict[str, _Collection]) -> str | None:
    """The collection whose ids every non-empty value (or list item) of this field names; ints count only for
    `*_id(s)` fields. When several collections fit, the one whose name starts like the field (`dentist_id` ->
    `dentists`) wins, else the first."""
    items: list[Any] = []
    for value in values:
        if isinstance(value, list):
            items += value
        elif value not in (None, ""):
            items.append(value)
    if not items or not all(isinstance(v, str | int) and not isinstance(v, bool) for v in items):
        return None
    if any(isinstance(v, int) for v in items) and not re.search(r"_ids?$", name):
        return None
    fitting = [
        other.name
        for other in collections.values()
        if other.ids and set(items) <= set(other.ids) and (other.is_list is False or other.id_field is not None)
    ]
    if not fitting:
        return None
    stem = re.sub(r"_ids?$", "", name).casefold()
    return next((n for n in fitting if stem and n.casefold().startswith(stem[:4])), fitting[0])


def _date_of(value: Any) -> dt.date | None:
    if not isinstance(value, str) or not (match := _DATE.match(value)):
        return None
    try:
        return dt.date.fromisoformat(match.group(1))
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------ new ids


def _allocate_ids(
    collections: dict[str, _Collection], targets: dict[str, int], blocked: re.Pattern[str] | None, rng: random.Random
) -> None:
    """Decide every clone's id, round by round, before any clone is filled (references need them)."""
    makers = {name: _id_maker(c, blocked, rng) for name, c in collections.items()}
    needed = {name: targets[name] - len(c.pairs) for name, c in collections.items()}
    round_ = 0
    while any(n > 0 for n in needed.values()):
        round_ += 1
        for name, c in collections.items():
            for original in c.ids:
                if needed[name] <= 0:
                    break
                c.clones[(original, round_)] = makers[name]()
                needed[name] -= 1


def _id_maker(c: _Collection, blocked: re.Pattern[str] | None, rng: random.Random):  # noqa: ANN202 - a closure
    """A function returning fresh ids in the format of `c`'s ids: numbered ids continue after the largest number;
    other ids get random ids shaped like a random existing one; positions of an id-less list continue."""
    taken = {str(i) for i in c.ids}
    ids = c.ids
    if c.is_list and c.id_field is None:
        counter = iter(range(len(ids), 10**12))
        return lambda: next(counter)
    if all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        numbers = iter(range(max(ids) + 1, 10**12))
        return lambda: next(numbers)
    shapes = [match for i in ids if (match := _NUMBERED.match(str(i))) and not re.search(r"\d", match.group(1))]
    if len(shapes) == len(ids) and len({(m.group(1), m.group(3)) for m in shapes}) == 1:
        prefix, suffix = shapes[0].group(1), shapes[0].group(3)
        digits = [m.group(2) for m in shapes]
        padded = any(d.startswith("0") and len(d) > 1 for d in digits)
        width = min(len(d) for d in digits) if padded else 0  # `0042` -> `0043`; `acc-9` -> `acc-10`
        start = max(int(d) for d in digits) + 1
        numbers = iter(range(start, 10**12))

        def numbered() -> str:
            while True:
                key = f"{prefix}{next(numbers):0{width}d}{suffix}"
                if key not in taken and not _conflicts(key, blocked):
                    taken.add(key)
                    return key

        return numbered

    def shaped() -> str:
        while True:
            key = _reshape(str(rng.choice(ids)), rng)
            if key not in taken and not _conflicts(key, blocked):
                taken.add(key)
                return key

    return shaped


def _reshape(key: str, rng: random.Random) -> str:
    """A random string shaped like `key`: each letter/digit replaced by one of its class; a key of hex runs (a
    uuid, a hash) stays hex."""
    runs = re.split(r"([^0-9A-Za-z]+)", key)
    hexish = all(_HEX_RUN.fullmatch(run) for run in runs[::2]) and any(len(run) >= 6 for run in runs[::2])
    out = []
    for ch in key:
        if hexish and ch in "0123456789abcdef":
            out.append(rng.choice("0123456789abcdef"))
        elif ch.isdigit():
            out.append(rng.choice("0123456789"))
        elif ch.isupper():
            out.append(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
        elif ch.islower():
            out.append(rng.choice("abcdefghijklmnopqrstuvwxyz"))
        else:
            out.append(ch)
    return "".join(out)


# ------------------------------------------------------------------------------------------ filling a clone


def _clone(
    c: _Collection, original: Any, round_: int, new_id: Any, collections: dict[str, _Collection],
    blocked: re.Pattern[str] | None, rng: random.Random,
) -> dict[str, Any] | None:  # fmt: skip
    """The distractor cloned from the record with id `original` in round `round_`, or None when it cannot be made
    without touching an original record or containing a protected value. Texts are filled last, so that an
    e-mail address can follow the renamed person."""
    template = c.pairs[c.ids.index(original)][1]
    shift = _date_shift(c, template, rng)
    factor = rng.uniform(0.5, 1.5)
    record: dict[str, Any] = dict.fromkeys(template)
    renamed: dict[str, str] = {}
    for name, value in template.items():
        spec = c.fields[name]
        if spec.kind == "self_id":
            record[name] = new_id
        elif spec.kind == "reference":
            record[name] = _remap(value, collections[spec.target], round_, rng)  # type: ignore[index]
        elif spec.kind == "enum":
            keep = value is None or rng.random() < _KEEP_ENUM
            record[name] = value if keep else rng.choice(spec.values)
        elif spec.kind == "number" and isinstance(value, int | float) and not isinstance(value, bool):
            record[name] = _scaled(value, spec, factor)
        elif spec.kind == "person" and isinstance(value, str):
            record[name] = _person(value, spec, blocked, rng)
            if isinstance(record[name], str):
                renamed.update(_renamed_words(value, record[name]))
        elif spec.kind != "text" or not isinstance(value, str):
            record[name] = _other(name, value, c, shift, collections, round_, blocked, rng)
        if record[name] is _MISSING:
            return None
    for name, value in template.items():
        if c.fields[name].kind == "text" and isinstance(value, str):
            record[name] = _text(_follow_renames(value, renamed), c.fields[name], blocked, rng)
            if record[name] is _MISSING:
                return None
    if blocked is not None:
        if _conflicts(new_id, blocked):
            return None
        for name, value in record.items():
            if c.fields[name].kind != "enum" and any(_conflicts(leaf, blocked) for leaf in leaves(value)):
                return None
    return record


def _remap(value: Any, target: _Collection, round_: int, rng: random.Random) -> Any:
    """A reference (or a list of them) pointed at clones of `target`: the same round's clone of the same record,
    else a random clone; `_MISSING` when `target` has no clone at all."""
    if isinstance(value, list):
        mapped = [_remap(item, target, round_, rng) for item in value]
        return _MISSING if any(m is _MISSING for m in mapped) else mapped
    if value in (None, ""):
        return value
    if (value, round_) in target.clones:
        return target.clones[(value, round_)]
    if not target.clones:
        return _MISSING
    same = [clone for (orig, _), clone in target.clones.items() if orig == value]
    return rng.choice(same or list(target.clones.values()))


def _scaled(value: int | float, spec: _Field, factor: float) -> int | float:
    if spec.low == spec.high:
        return value
    scaled = min(max(value * factor, spec.low), spec.high)
    if isinstance(value, int):
        step = spec.step or 1
        return int(min(max(round(scaled / step) * step, spec.low), spec.high))
    decimals = max((len(repr(v).partition(".")[2]) for v in spec.values if isinstance(v, float)), default=2)
    return round(scaled, min(decimals, 6))


def _first_date(record: dict[str, Any]) -> dt.date | None:
    dates = [d for d in (_date_of(leaf) for leaf in leaves(record)) if d is not None]
    return min(dates) if dates else None


def _date_shift(c: _Collection, template: dict[str, Any], rng: random.Random) -> int:
    """Whole days to move every date of this clone by, so that its first date lands within the range of the
    first dates of the collection's records (a one-year policy that started in 2022 does not move to 2039 because
    a life policy in the collection ends then)."""
    first = _first_date(template)
    if first is None or c.date_range is None:
        return 0
    earliest, latest = c.date_range
    return rng.randint((earliest - first).days, (latest - first).days)


def _shift_dates(value: Any, days: int) -> Any:
    if isinstance(value, dict):
        return {key: _shift_dates(item, days) for key, item in value.items()}
    if isinstance(value, list):
        return [_shift_dates(item, days) for item in value]
    if days and (day := _date_of(value)) is not None:
        return (day + dt.timedelta(days=days)).isoformat() + value[10:]
    return value


def _text(value: str, spec: _Field, blocked: re.Pattern[str] | None, rng: random.Random) -> Any:
    """A text for a clone: a single token with digits (a phone, a code) gets new digits in its last number, other
    texts stay the template's (a clinic's name, city and address stay together); while it holds a protected value,
    another record's value is drawn (`_MISSING` if they all do). A field of distinct one-word values with a digit
    or `@._` (an e-mail, a file name) stays distinct: a repeat gets a number (`sgoldberg2@example.com`)."""
    for attempt in range(_FIELD_RETRIES):
        picked = value
        if " " not in value and (digits := list(re.finditer(r"\d+", value))):
            last = digits[-1]
            fresh = "".join(rng.choice("0123456789") for _ in last.group(0))
            picked = value[: last.start()] + fresh + value[last.end() :]
            if spec.seen is not None and picked in spec.seen and attempt < _FIELD_RETRIES - 1:
                continue  # new digits again (a phone number stays shaped like one), then a number is added
        if spec.seen is not None:
            picked = _distinct(picked, spec.seen)
        if not _conflicts(picked, blocked):
            if spec.seen is not None:
                spec.seen.add(picked)
            return picked
        value = rng.choice(spec.values)
    return _MISSING


def _distinct(value: str, seen: set[str]) -> str:
    """`value`, or it with the smallest number from 2 that makes it new, before an `@` or a file extension."""
    if value not in seen:
        return value
    at = value.find("@")
    cut = at if at > 0 else (value.rfind(".") if value.rfind(".") > 0 else len(value))
    number = 2
    while (candidate := f"{value[:cut]}{number}{value[cut:]}") in seen:
        number += 1
    return candidate


def _person(value: str, spec: _Field, blocked: re.Pattern[str] | None, rng: random.Random) -> Any:
    """A person's name for a clone: a title (`Dr.`) is kept; each name word comes from another value of the field
    at the same position or from a built-in list of first and last names; drawn again while it contains a
    protected value (`_MISSING` if it always does)."""
    title, _, rest = value.partition(" ") if _TITLE.match(value) else ("", "", value)
    words = rest.split(" ")
    peers = [v.split(" ")[-len(words) :] for v in spec.values if len(v.split(" ")) >= len(words)]
    for _ in range(_FIELD_RETRIES):
        picked = []
        for i, word in enumerate(words):
            pool = _LAST_NAMES if i == len(words) - 1 and len(words) > 1 else _FIRST_NAMES
            draw = rng.random()
            picked.append(rng.choice(peers)[i] if draw < 0.3 and peers else rng.choice(pool) if draw < 0.9 else word)
        name = " ".join(([title] if title else []) + picked)
        if not _conflicts(name, blocked):
            return name
    return _MISSING


def _renamed_words(old: str, new: str) -> dict[str, str]:
    """Words of a name that changed (`Rebecca` -> `Anthony`), for the record's other texts to follow."""
    old_words, new_words = old.split(" "), new.split(" ")
    if len(old_words) != len(new_words):
        return {}
    return {
        a.casefold(): b.casefold()
        for a, b in zip(old_words, new_words, strict=True)
        if a != b and _WORD.fullmatch(a) and _WORD.fullmatch(b)
    }


def _follow_renames(value: str, renamed: dict[str, str]) -> str:
    """`value` with whole words renamed (case-insensitive; the replacement is lower case, as in e-mail names)."""
    return _WORD.sub(lambda m: renamed.get(m.group(0).casefold(), m.group(0)), value)


def _other(
    name: str, value: Any, c: _Collection, shift: int, collections: dict[str, _Collection], round_: int,
    blocked: re.Pattern[str] | None, rng: random.Random,
) -> Any:  # fmt: skip
    """A date, nested value or mixed field: the template's value, else (while it holds a protected value) another
    record's; dates move by the clone's shift; `*_id` fields inside point at clones."""
    others = [record[name] for _, record in c.pairs if name in record and record[name] is not value]
    candidates = [value] + rng.sample(others, min(len(others), _FIELD_RETRIES))
    for candidate in candidates:
        if isinstance(candidate, dict | list) or _date_of(candidate) is not None:
            candidate = _shift_dates(copy.deepcopy(candidate), shift)
        candidate = _remap_nested(candidate, collections, round_, rng)
        if candidate is _MISSING:
            return _MISSING
        if not any(_conflicts(leaf, blocked) for leaf in leaves(candidate)):
            return candidate
    return _MISSING


def _remap_nested(value: Any, collections: dict[str, _Collection], round_: int, rng: random.Random) -> Any:
    """`*_id` fields inside nested dicts naming a record of a collection, pointed at clones of it."""
    if isinstance(value, list):
        items = [_remap_nested(item, collections, round_, rng) for item in value]
        return _MISSING if any(i is _MISSING for i in items) else items
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        target = _nested_target(key, item, collections) if isinstance(key, str) and key.endswith("_id") else None
        item = _remap(item, target, round_, rng) if target else _remap_nested(item, collections, round_, rng)
        if item is _MISSING:
            return _MISSING
        out[key] = item
    return out


def _nested_target(key: str, item: Any, collections: dict[str, _Collection]) -> _Collection | None:
    if not isinstance(item, str | int) or isinstance(item, bool):
        return None
    fitting = [c for c in collections.values() if item in c.ids and (not c.is_list or c.id_field)]
    stem = key[: -len("_id")].casefold()
    return next((c for c in fitting if c.name.casefold().startswith(stem[:4])), fitting[0] if fitting else None)


# ------------------------------------------------------------------------------------------ protected values


def _protected_pattern(protected: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern matching any protected value as a whole word sequence, case-insensitively."""
    values = sorted({p.strip().casefold() for p in protected if isinstance(p, str) and p.strip()}, key=len)
    if not values:
        return None
    alternation = "|".join(re.escape(v) for v in reversed(values))  # longest first
    return re.compile(rf"(?<![0-9a-z])(?:{alternation})(?![0-9a-z])")


def _conflicts(value: Any, blocked: re.Pattern[str] | None) -> bool:
    if blocked is None or isinstance(value, bool) or value is None:
        return False
    return blocked.search(str(value).casefold()) is not None
