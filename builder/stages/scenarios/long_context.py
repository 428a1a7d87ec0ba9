"""Long-context states: a verified initial state enlarged with distractor records the task never touches.

`enlarge(state, records=N, protected=..., seed=..., now=...)` returns a copy of `state` whose collections of
records (the top-level attributes `builder.json_values.record_pairs` calls collections) hold about N records in
total. The originals stay first, unchanged; the distractors are appended after them. The rules:

- **Copies of the whole world.** Distractors are made in rounds; each round clones every record of every
  collection once (except catalogs, below), so that the relations between records the environment's tools rely
  on hold among the clones as they do among the originals: a clone's references point at the same round's
  clones of the records they named, and its enums, numbers and booleans are the template's, so a booked slot's
  clone is held by the clone of its appointment, a provider's clone has the clones of its reviews, whose ratings
  its rating is the mean of, and its `review_count` counts them. The number of rounds is
  `round((N - total) / grown)` (`grown`: the records of the collections that grow). So distractors form their
  own consistent worlds and never attach to the records the task is about ("cancel all my bookings" keeps its
  meaning).
- **Catalogs are shared.** A map keyed by codes without digits whose records name no person (`MRI`, `CT`;
  `savings`) is a catalog: it does not grow, and clones keep naming its codes.
- **Dates move by whole weeks, per round.** Every date of a round moves by the same multiple of 7 days (at most
  8 weeks either way), drawn among those that keep every date of the state on its side of `now` (and 0 without
  `now`): weekdays, times of day, order, and what is past or upcoming all hold.
- **Keys in the collection's format.** Keys that share a prefix and a number (`acc-1`, `P-7`, `POL-1003`,
  `0042`) continue the numbering after the largest (`acc-5`, `acc-6`, ...; zero padding kept), so an environment
  that makes the next id from the count or the maximum still makes a fresh one. Other keys (`ABC123`, uuids) get
  random keys of the same shape (letters for letters, digits for digits, hex for hex). A record's own id field
  (`"patient_id": "P-1"` under key `P-1`; `id` / `<thing>_id` of list items, unique across items) gets the new id.
- **New identities.** Person names (a `name`/`author`/`owner`/... field whose values are all one or two
  capitalised words, maybe after `Dr.`) draw each word from other values of the field or a built-in list of first
  and last names, and the record's other texts follow the renamed words (`olivia.bennett@example.com` ->
  `nadia.okafor@example.com`); a one-word text with digits (a phone) gets new digits in its last number; other
  texts and nested values (a clinic's address, a status history) stay the template's. Identifier-like texts
  (distinct one-word values with a digit or `@._`: e-mails, file names) stay distinct (`sgoldberg2@example.com`).
  Within a round the same name or text is renamed the same way in every record.
- **Protected values stay unique.** No name, text, nested value or key of a distractor contains a protected
  value as a whole word sequence, case-insensitively (`Ada Lovelace` blocks `Ada Lovelace Jr` but not `Adam`;
  `acc-1` blocks `acc-1` but not `acc-17`); what a clone copies (enums, numbers, dates, references) is exempt,
  since a task names its records by names, texts and keys. A field that conflicts is drawn again from other
  records; a round with a record that still conflicts is dropped whole (a world with a hole would break the
  relations). `protected_values` lists what a scenario must protect.
- **Deterministic**: the same state, size, protected values, seed and `now` give the same result.

Only top-level collections grow; nested ones (a list of items inside a record) are copied with their record.
The fields are read and the clones filled in builder/stages/scenarios/distractors.py; this module sizes the
rounds, allocates the clones' ids and keeps the protected values out. `checked_enlarge` loads the enlarged state
in the sandbox and checks it (the environment's tools, references, the relations of `invariants.py`), falling
back to fewer rounds rather than play a task on an inconsistent state.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import random
import re
from collections.abc import Iterable
from typing import Any

from builder.envs.lint import Contract
from builder.envs.state_schema import reference_problems
from builder.json_values import leaves, record_pairs
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.distractors import (
    Collection,
    Round,
    clone,
    conflicts,
    date_leaves,
    profile,
    read_collection,
    shift_date,
)
from builder.stages.scenarios.invariants import relation_problems
from builder.stages.scenarios.verify import load_state

logger = logging.getLogger(__name__)

_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")
_HEX_RUN = re.compile(r"[0-9a-f]*")
_WEEKS = 8  # a round's dates move by at most this many weeks either way


def enlarge(
    state: dict[str, Any], *, records: int, protected: Iterable[str] = (), seed: int = 0, now: str | None = None
) -> dict[str, Any]:
    """A copy of `state` whose collections of records hold about `records` records in total, the originals first
    and unchanged, then whole-world rounds of distractor records (see the module docstring for the rules). A state
    already as large, or without collections to grow, comes back as an unchanged copy."""
    result = copy.deepcopy(state)
    collections = {
        name: read_collection(name, value) for name, value in state.items() if record_pairs(value) is not None
    }
    for c in collections.values():
        profile(c, collections)
    total = sum(len(c.pairs) for c in collections.values())
    grown = {name: c for name, c in collections.items() if not c.catalog and c.pairs}
    size = sum(len(c.pairs) for c in grown.values())
    rounds = round((records - total) / size) if size and records > total else 0
    if rounds <= 0:
        return result
    blocked = protected_pattern(protected)
    rng = random.Random(seed)
    shifts = week_shifts(state, now)
    makers = {name: _IdMaker(c, blocked, rng) for name, c in grown.items()}
    for number in range(1, rounds + 1):
        for name, c in grown.items():
            makers[name].mark()
            for original in c.ids:
                c.clones[(original, number)] = makers[name].next()
        made = _round(grown, collections, Round(number, rng.choice(shifts), rng), blocked)
        if made is None:  # a hole in this world would break its relations: none of it, and its ids are reused
            for name, c in grown.items():
                makers[name].reset()
                for original in c.ids:
                    del c.clones[(original, number)]
            continue
        for name, c in grown.items():
            value = result[name]
            for new_id, record in made[name]:
                if c.is_list:
                    value.append(record)
                else:
                    value[new_id] = record
    return result


def _round(
    grown: dict[str, Collection], collections: dict[str, Collection], round_: Round, blocked: re.Pattern[str] | None
) -> dict[str, list[tuple[Any, dict[str, Any]]]] | None:
    """Every record of one round, per collection, or None when one of them cannot avoid a protected value."""
    made: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
    for name, c in grown.items():
        made[name] = []
        for original in c.ids:
            new_id = c.clones[(original, round_.number)]
            record = clone(c, original, new_id, round_, collections, blocked)
            if record is None:
                return None
            made[name].append((new_id, record))
    return made


def week_shifts(state: dict[str, Any], now: str | None) -> list[int]:
    """The shifts in days (whole weeks, at most `_WEEKS` either way) that keep every date of `state` on its side of
    `now`: past stays past, today today, upcoming upcoming. Only 0 without `now`."""
    if not now:
        return [0]
    try:
        moment = dt.datetime.fromisoformat(now)
    except ValueError:
        return [0]
    dates = set(date_leaves(state))

    def side(value: str) -> int:
        point: Any = value[:10] if len(value) <= 10 else value[:19].replace(" ", "T")
        here = moment.date().isoformat() if len(value) <= 10 else moment.isoformat()[:19]
        return (point > here) - (point < here)

    sides = {value: side(value) for value in dates}
    return [
        days
        for days in range(-7 * _WEEKS, 7 * _WEEKS + 1, 7)
        if all(side(shift_date(value, days)) == where for value, where in sides.items())
    ]


def checked_enlarge(
    sandbox: Sandbox, code: str, state: dict[str, Any], *, records: int, protected: Iterable[str], seed: int,
    now: str, contract: Contract = "strict",
) -> dict[str, Any]:  # fmt: skip
    """`enlarge`, then the enlarged state as the environment holds it once it loads in the sandbox, every tool
    answers on it without crashing (`verify.load_state`), its references resolve and it keeps every relation the
    original holds (`invariants.relation_problems`). Else fewer distractors: the records beyond the original
    halve, down to the original state itself. Blocks on the sandbox."""
    protected = list(protected)
    total = sum(len(pairs) for value in state.values() if (pairs := record_pairs(value)) is not None)
    target = records
    while target > total:
        enlarged = enlarge(state, records=target, protected=protected, seed=seed, now=now)
        if enlarged == state:
            break
        loaded, problems = load_state(sandbox, code, enlarged, now=now, seed=seed, contract=contract)
        if loaded is not None and not problems:
            problems = reference_problems(loaded) + relation_problems(state, loaded)
        if loaded is not None and not problems:
            return loaded
        logger.warning("long-context state of %d records refused, trying fewer: %s", target, "; ".join(problems)[:500])
        target = total + (target - total) // 2
    return state


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


class _IdMaker:
    """Fresh ids in the format of a collection's ids: numbered ids continue after the largest number; other ids get
    random ids shaped like a random existing one; positions of an id-less list continue. `mark` and `reset` give
    back the ids of a dropped round, so that numbering stays contiguous."""

    def __init__(self, c: Collection, blocked: re.Pattern[str] | None, rng: random.Random) -> None:
        self.blocked, self.rng, self.ids = blocked, rng, c.ids
        self.taken = {str(i) for i in c.ids}
        self.prefix = self.suffix = None
        self.width, self.number, self.saved = 0, 0, (0, set())
        if c.is_list and c.id_field is None:
            self.kind, self.number = "position", len(c.ids)
        elif all(isinstance(i, int) and not isinstance(i, bool) for i in c.ids):
            self.kind, self.number = "integer", max(c.ids) + 1
        else:
            self.kind = "shaped"
            shapes = [m for i in c.ids if (m := _NUMBERED.match(str(i))) and not re.search(r"\d", m.group(1))]
            if len(shapes) == len(c.ids) and len({(m.group(1), m.group(3)) for m in shapes}) == 1:
                digits = [m.group(2) for m in shapes]
                padded = any(d.startswith("0") and len(d) > 1 for d in digits)
                self.kind, self.prefix, self.suffix = "numbered", shapes[0].group(1), shapes[0].group(3)
                self.width = min(len(d) for d in digits) if padded else 0  # `0042` -> `0043`; `acc-9` -> `acc-10`
                self.number = max(int(d) for d in digits) + 1

    def mark(self) -> None:
        self.saved = (self.number, set(self.taken))

    def reset(self) -> None:
        self.number, self.taken = self.saved[0], self.saved[1]

    def next(self) -> Any:
        if self.kind in ("position", "integer"):
            self.number += 1
            return self.number - 1
        while True:
            if self.kind == "numbered":
                key = f"{self.prefix}{self.number:0{self.width}d}{self.suffix}"
                self.number += 1
            else:
                key = _reshape(str(self.rng.choice(self.ids)), self.rng)
            if key not in self.taken and not conflicts(key, self.blocked):
                self.taken.add(key)
                return key


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
