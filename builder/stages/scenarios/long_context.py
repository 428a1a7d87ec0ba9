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
  single lowercase tokens such as `in_person`, or few distinct values) keep the template's value 70% of the time,
  else take a seen one; numbers are scaled by one factor per record (so `approved <= claimed` mostly holds),
  rounded to the field's step (the gcd of its integer values) and kept within the field's observed range; dates
  and date-times move by one whole-day shift per record, so that its first date stays within the range of the
  collection's first dates (`start < end` and the time of day hold); person names (a `name`/`author`/`owner`/...
  field whose values are all one or two capitalised words, maybe after `Dr.`) draw each word from other values of
  the field or a built-in list of first and last names, and the record's other texts follow the renamed words
  (`olivia.bennett@example.com` -> `nadia.okafor@example.com`); a one-word text with digits (a phone) gets new
  digits in its last number; other texts and nested values (a clinic's address, a status history) stay the
  template's, so a record stays coherent. Identifier-like texts (distinct one-word values with a digit or `@._`:
  e-mails, file names) stay distinct (`sgoldberg2@example.com`).
- **Protected values stay unique.** No string inside a distractor (its key included) contains a protected value
  as a whole word sequence, case-insensitively (`Ada Lovelace` blocks `Ada Lovelace Jr` but not `Adam`; `acc-1`
  blocks `acc-1` but not `acc-17`). Enum-like fields and numbers of one or two digits are exempt (`savings` and
  `3` identify no record). A field that conflicts is drawn again from other records; a distractor still
  conflicting after that is dropped. `protected_values` lists what a scenario must protect.
- **Deterministic**: the same state, size, protected values and seed give the same result.

Only top-level collections grow; nested ones (a list of items inside a record) are copied with their record.
The fields are read and the clones filled in builder/stages/scenarios/distractors.py; this module sizes the
collections, allocates the clones' ids and keeps the protected values out.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Iterable
from typing import Any

from builder.json_values import leaves, record_pairs
from builder.stages.scenarios.distractors import (
    Collection,
    clone,
    conflicts,
    profile,
    read_collection,
)

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")
_HEX_RUN = re.compile(r"[0-9a-f]*")


def enlarge(state: dict[str, Any], *, records: int, protected: Iterable[str] = (), seed: int = 0) -> dict[str, Any]:
    """A copy of `state` whose collections of records hold about `records` records in total, the originals first
    and unchanged, then distractor records (see the module docstring for the rules). A state already as large, or
    without collections, comes back as an unchanged copy."""
    result = copy.deepcopy(state)
    collections = {
        name: read_collection(name, value) for name, value in state.items() if record_pairs(value) is not None
    }
    total = sum(len(c.pairs) for c in collections.values())
    if total == 0 or records <= total:
        return result
    blocked = protected_pattern(protected)
    rng = random.Random(seed)
    for c in collections.values():
        profile(c, collections)
    targets = {name: max(len(c.pairs), round(len(c.pairs) * records / total)) for name, c in collections.items()}
    _allocate_ids(collections, targets, blocked, rng)
    for name, c in collections.items():
        for (original, round_), new_id in c.clones.items():
            record = clone(c, original, round_, new_id, collections, blocked, rng)
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


def protected_pattern(protected: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern matching any protected value as a whole word sequence, case-insensitively. Numbers of one or two
    digits are left out: they identify no record and would block every `+1-` phone and `2 Main St`."""
    values = {p.strip().casefold() for p in protected if isinstance(p, str) and p.strip()}
    values = sorted((v for v in values if not re.fullmatch(r"\d{1,2}", v)), key=len)
    if not values:
        return None
    alternation = "|".join(re.escape(v) for v in reversed(values))  # longest first
    return re.compile(rf"(?<![0-9a-z])(?:{alternation})(?![0-9a-z])")


def _whole(folded: str) -> str:
    return rf"(?<![0-9a-z]){re.escape(folded)}(?![0-9a-z])"


# ------------------------------------------------------------------------------------------ new ids


def _allocate_ids(
    collections: dict[str, Collection], targets: dict[str, int], blocked: re.Pattern[str] | None, rng: random.Random
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


def _id_maker(c: Collection, blocked: re.Pattern[str] | None, rng: random.Random):  # noqa: ANN202 - a closure
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
                if key not in taken and not conflicts(key, blocked):
                    taken.add(key)
                    return key

        return numbered

    def shaped() -> str:
        while True:
            key = _reshape(str(rng.choice(ids)), rng)
            if key not in taken and not conflicts(key, blocked):
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
