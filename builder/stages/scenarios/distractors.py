"""The collections of a state, read field by field, and the distractor records cloned from them: the rules are
in builder/stages/scenarios/long_context.py, which allocates the clones' ids and calls `clone` for each record of
each round (one `Round` per copy of the world)."""

from __future__ import annotations

import copy
import datetime as dt
import random
import re
from dataclasses import dataclass, field
from typing import Any

from builder.json_values import leaves, record_pairs

_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2})((?:[T ]\d{2}:\d{2}(?::\d{2}(?:\.\d+)?)?)?(?:Z|[+-]\d{2}:?\d{2})?)$")
_ENUM_TOKEN = re.compile(r"^[a-z][a-z0-9_\-]*$")
_WORD = re.compile(r"[A-Za-z][A-Za-z']+")
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
# Kinds whose values a clone copies (shifted, for dates) so that relations between records hold; the protected
# values do not apply to them: a task names its records by names, texts and keys, which clones never repeat.
COPIED = frozenset({"self_id", "reference", "enum", "number", "date"})
MISSING = object()


@dataclass
class Field:
    """What the values of one field of a collection are, and the values seen."""

    kind: str  # "self_id", "reference", "enum", "number", "date", "person", "text", "other"
    values: list[Any] = field(default_factory=list)
    target: str | None = None  # the referenced collection
    seen: set[str] | None = None  # the values so far of a one-word text field whose values are all distinct


@dataclass
class Collection:
    """One collection of records being enlarged: its records and ids, its fields, and the clones planned."""

    name: str
    is_list: bool
    pairs: list[tuple[Any, dict[str, Any]]]
    ids: list[Any]  # the keys others refer to: dict keys, or the id field of list items (positions if none)
    id_field: str | None  # the record's own id field, if any
    fields: dict[str, Field] = field(default_factory=dict)
    catalog: bool = False  # keyed by codes (`MRI`, `savings`) and naming no person: shared, never grown
    clones: dict[tuple[Any, int], Any] = field(default_factory=dict)  # (original id, round) -> clone id


@dataclass
class Round:
    """One copy of the world: its number, the whole days every date of it moves by, and what it renamed, so that
    a value repeated across records (a patient's name on an appointment) is renamed the same way everywhere."""

    number: int
    shift: int
    rng: random.Random
    names: dict[str, str] = field(default_factory=dict)  # person name -> its clone's
    texts: dict[str, str] = field(default_factory=dict)  # a template's text -> its clone's


# ------------------------------------------------------------------------------------------ reading the state


def read_collection(name: str, value: Any) -> Collection:
    pairs = record_pairs(value) or []
    is_list = isinstance(value, list)
    id_field = _own_id_field(name, pairs, is_list)
    if is_list:
        ids = [record.get(id_field) for _, record in pairs] if id_field else [key for key, _ in pairs]
    else:
        ids = [key for key, _ in pairs]
    return Collection(name=name, is_list=is_list, pairs=pairs, ids=ids, id_field=id_field)


def _own_id_field(collection: str, pairs: list[tuple[Any, dict[str, Any]]], is_list: bool) -> str | None:
    """The field holding a record's own id: under a dict, the one equal to the key in every record; in a list,
    `id` or a `<thing>_id` named like the collection (`loan_id` in `loans`, not `member_id`) whose values are
    unique strings or ints across the items."""
    names = [name for name in pairs[0][1] if all(name in record for _, record in pairs)]
    if not is_list:
        return next((n for n in names if all(record[n] == key for key, record in pairs)), None)
    for name in names:
        if name != "id" and not (name.endswith("_id") and collection.casefold().startswith(name[:-3].casefold()[:4])):
            continue
        values = [record[name] for _, record in pairs]
        if all(isinstance(v, str | int) and not isinstance(v, bool) for v in values) and len(set(values)) == len(
            values
        ):
            return name
    return None


def profile(c: Collection, collections: dict[str, Collection]) -> None:
    """The kind of every field of `c`'s records, and whether `c` is a catalog."""
    names: list[str] = []
    for _, record in c.pairs:
        names += [name for name in record if name not in names]
    for name in names:
        values = [record.get(name, MISSING) for _, record in c.pairs]
        values = [v for v in values if v is not MISSING]
        c.fields[name] = _field(c, name, values, collections)
    codes = all(isinstance(i, str) and not re.search(r"\d", i) for i in c.ids)
    c.catalog = codes and not c.is_list and not any(f.kind == "person" for f in c.fields.values())


def _field(c: Collection, name: str, values: list[Any], collections: dict[str, Collection]) -> Field:
    if name == c.id_field:
        return Field("self_id", values)
    target = _reference_target(c, name, values, collections)
    if target is not None:
        return Field("reference", values, target=target)
    present = [v for v in values if v is not None]
    if present and all(isinstance(v, bool) for v in present):
        return Field("enum", present)
    if present and all(isinstance(v, int | float) and not isinstance(v, bool) for v in present):
        return Field("number", present)
    if present and all(isinstance(v, str) for v in present):
        if all(_date_of(v) is not None for v in present):
            return Field("date", present)
        if any(_date_of(v) is not None for v in present):
            return Field("other", present)  # dates move with the round's shift
        distinct = set(present)
        if all(_ENUM_TOKEN.match(v) for v in present) or (len(present) >= 4 and len(distinct) <= len(present) / 2):
            return Field("enum", present)
        if _PERSON_FIELD.search(name.casefold()) and all(_PERSON.match(v) for v in present):
            return Field("person", present)
        unique = len(distinct) == len(present) and all(_IDENTIFIER_LIKE.match(v) for v in present)
        return Field("text", present, seen=set(present) if unique else None)
    return Field("other", values)


def _reference_target(c: Collection, name: str, values: list[Any], collections: dict[str, Collection]) -> str | None:
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


def date_leaves(state: Any) -> list[str]:
    """Every date or date-time string in `state`."""
    return [leaf for leaf in leaves(state) if _date_of(leaf) is not None]


def shift_date(value: str, days: int) -> str:
    day = _date_of(value)
    return value if day is None or not days else (day + dt.timedelta(days=days)).isoformat() + value[10:]


# ------------------------------------------------------------------------------------------ filling a clone


def clone(
    c: Collection, original: Any, new_id: Any, round_: Round, collections: dict[str, Collection],
    blocked: re.Pattern[str] | None,
) -> dict[str, Any] | None:  # fmt: skip
    """The distractor cloned in `round_` from the record with id `original`, or None when its names, texts or
    key cannot avoid a protected value. References, enums and numbers are copied (references to the same round's
    clones), dates shifted by the round's days; names, e-mails, phones and other identifying texts are new.
    Texts are filled last, so that an e-mail address can follow the renamed person."""
    template = c.pairs[c.ids.index(original)][1]
    record: dict[str, Any] = dict.fromkeys(template)
    renamed: dict[str, str] = {}
    for name, value in template.items():
        spec = c.fields[name]
        if spec.kind == "self_id":
            record[name] = new_id
        elif spec.kind == "reference":
            record[name] = remap(value, collections[spec.target], round_.number)  # type: ignore[index]
        elif spec.kind in ("enum", "number"):
            record[name] = value
        elif spec.kind == "date" and isinstance(value, str):
            record[name] = shift_date(value, round_.shift)
        elif spec.kind == "person" and isinstance(value, str):
            record[name] = _person(value, spec, blocked, round_)
            if isinstance(record[name], str):
                renamed.update(_renamed_words(value, record[name]))
        elif spec.kind != "text" or not isinstance(value, str):
            record[name] = _other(name, value, c, collections, blocked, round_)
        if record[name] is MISSING:
            return None
    for name, value in template.items():
        if c.fields[name].kind == "text" and isinstance(value, str):
            record[name] = _text(value, renamed, c.fields[name], blocked, round_)
            if record[name] is MISSING:
                return None
    if blocked is not None and conflicts(new_id, blocked):
        return None
    return record


def remap(value: Any, target: Collection, number: int) -> Any:
    """A reference (or a list of them) pointed at the clone of round `number` of the record it names; a catalog's
    codes, and values that name no record, stay."""
    if isinstance(value, list):
        return [remap(item, target, number) for item in value]
    return target.clones.get((value, number), value) if not target.catalog else value


def _text(
    value: str, renamed: dict[str, str], spec: Field, blocked: re.Pattern[str] | None, round_: Round
) -> Any:  # fmt: skip
    """A text for a clone, the same for the same text within a round: the template's, with the renamed person's
    words followed (`olivia.bennett@...` -> `nadia.okafor@...`); a single token with digits (a phone, a code) gets
    new digits in its last number; while it holds a protected value, another record's value is drawn (`MISSING`
    if they all do). A field of distinct one-word values with a digit or `@._` (an e-mail, a file name) stays
    distinct: a repeat gets a number (`sgoldberg2@example.com`)."""
    if value in round_.texts:
        return round_.texts[value]
    rng, candidate = round_.rng, _follow_renames(value, renamed)
    for attempt in range(_FIELD_RETRIES):
        picked = candidate
        if " " not in candidate and (digits := list(re.finditer(r"\d+", candidate))):
            last = digits[-1]
            fresh = "".join(rng.choice("0123456789") for _ in last.group(0))
            picked = candidate[: last.start()] + fresh + candidate[last.end() :]
            if spec.seen is not None and picked in spec.seen and attempt < _FIELD_RETRIES - 1:
                continue  # new digits again (a phone number stays shaped like one), then a number is added
        if spec.seen is not None:
            picked = _distinct(picked, spec.seen)
        if not conflicts(picked, blocked):
            if spec.seen is not None:
                spec.seen.add(picked)
            round_.texts[value] = picked
            return picked
        candidate = rng.choice(spec.values)
    return MISSING


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


def _person(value: str, spec: Field, blocked: re.Pattern[str] | None, round_: Round) -> Any:
    """A person's name for a clone, the same for the same name within a round: a title (`Dr.`) is kept; each
    name word comes from another value of the field at the same position or from a built-in list of first and
    last names; drawn again while it contains a protected value (`MISSING` if it always does)."""
    if value in round_.names:
        return round_.names[value]
    rng = round_.rng
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
        if not conflicts(name, blocked):
            round_.names[value] = name
            return name
    return MISSING


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
    name: str, value: Any, c: Collection, collections: dict[str, Collection], blocked: re.Pattern[str] | None,
    round_: Round,
) -> Any:  # fmt: skip
    """A nested value or mixed field: the template's value, else (while it holds a protected value) another
    record's; dates inside move by the round's shift; `*_id` fields inside point at the round's clones."""
    others = [record[name] for _, record in c.pairs if name in record and record[name] is not value]
    candidates = [value] + round_.rng.sample(others, min(len(others), _FIELD_RETRIES))
    for candidate in candidates:
        candidate = _remap_nested(_shift_dates(copy.deepcopy(candidate), round_.shift), collections, round_.number)
        if not any(conflicts(leaf, blocked) for leaf in leaves(candidate)):
            return candidate
    return MISSING


def _shift_dates(value: Any, days: int) -> Any:
    if isinstance(value, dict):
        return {key: _shift_dates(item, days) for key, item in value.items()}
    if isinstance(value, list):
        return [_shift_dates(item, days) for item in value]
    return shift_date(value, days) if isinstance(value, str) else value


def _remap_nested(value: Any, collections: dict[str, Collection], number: int) -> Any:
    """`*_id` fields inside nested dicts naming a record of a collection, pointed at the round's clones."""
    if isinstance(value, list):
        return [_remap_nested(item, collections, number) for item in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        target = _nested_target(key, item, collections) if isinstance(key, str) and key.endswith("_id") else None
        out[key] = remap(item, target, number) if target else _remap_nested(item, collections, number)
    return out


def _nested_target(key: str, item: Any, collections: dict[str, Collection]) -> Collection | None:
    if not isinstance(item, str | int) or isinstance(item, bool):
        return None
    fitting = [c for c in collections.values() if item in c.ids and (not c.is_list or c.id_field)]
    stem = key[: -len("_id")].casefold()
    return next((c for c in fitting if c.name.casefold().startswith(stem[:4])), fitting[0] if fitting else None)


def conflicts(value: Any, blocked: re.Pattern[str] | None) -> bool:
    if blocked is None or isinstance(value, bool) or value is None:
        return False
    return blocked.search(str(value).casefold()) is not None
