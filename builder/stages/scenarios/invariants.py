"""Relations between records that a state holds, found in it and checked in another (its enlarged copy).

An environment's tools rely on relations its code keeps but no schema states: a slot is booked exactly when an
appointment that is not cancelled holds it, a provider's `review_count` counts its reviews and its `rating` is
their mean. A long-context state must keep them among its distractors (docs/scenarios.md §10), so the relations
the original records all satisfy are found here and every one is checked on the enlarged state. For every
collection X and every field of another (or the same) collection Y that references X's records:

- `exists`: a boolean field of X is true exactly when some Y record references it (optionally only the Y
  records whose enum field equals, or differs from, one value: `status != "cancelled"`);
- `count`: an integer field of X equals the number of such Y records;
- `mean` / `sum`: a number field of X equals the mean (within 0.05, 0 when none) or the sum of a number field
  of those Y records.

A relation counts only when it is not trivial in the original: a boolean both true and false, a count or total
with two values at least. Pure functions over JSON data.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from builder.json_values import record_pairs
from builder.stages.scenarios.distractors import Collection, profile, read_collection

_MEAN_TOLERANCE = 0.051  # a rating kept to one decimal


@dataclass(frozen=True)
class Relation:
    """`holder.field` derived from the `source` records whose `reference` names the holder (see the module)."""

    holder: str
    field: str
    kind: str  # "exists", "count", "mean", "sum"
    source: str
    reference: str
    value_field: str | None = None  # the source's number field (mean, sum)
    where: tuple[str, Any, bool] | None = None  # (source enum field, value, equal?)

    def __str__(self) -> str:
        where = f" where {self.where[0]} {'==' if self.where[2] else '!='} {self.where[1]!r}" if self.where else ""
        of = f" of {self.source}.{self.value_field}" if self.value_field else f" {self.source}"
        return f"{self.holder}.{self.field} = {self.kind}{of} by {self.reference}{where}"


def relations(state: dict[str, Any]) -> list[Relation]:
    """Every relation (module docstring) that all records of `state` satisfy."""
    collections = _collections(state)
    found = []
    for candidate in _candidates(collections):
        values = _derived(candidate, collections)
        holder = collections[candidate.holder]
        actual = [record.get(candidate.field) for _, record in holder.pairs]
        agree = all(_agrees(candidate, a, d) for a, d in zip(actual, values, strict=True))
        if agree and not _trivial(actual):
            found.append(candidate)
    return found


def relation_problems(original: dict[str, Any], enlarged: dict[str, Any], limit: int = 5) -> list[str]:
    """The relations `original` holds that some record of `enlarged` breaks, one message each."""
    wanted = relations(original)
    if not wanted:
        return []
    collections = _collections(enlarged)
    problems = []
    for relation in wanted:
        if relation.holder not in collections or relation.source not in collections:
            continue
        holder = collections[relation.holder]
        values = _derived(relation, collections)
        for (key, record), value in zip(holder.pairs, values, strict=True):
            if not _agrees(relation, record.get(relation.field), value):
                problems.append(f"{relation}: {relation.holder}[{key!r}].{relation.field} = "
                                f"{record.get(relation.field)!r}, the records give {value!r}")  # fmt: skip
                break
        if len(problems) >= limit:
            break
    return problems


def _collections(state: dict[str, Any]) -> dict[str, Collection]:
    collections = {name: read_collection(name, value) for name, value in state.items()
                   if record_pairs(value)}  # fmt: skip
    for c in collections.values():
        profile(c, collections)
    return collections


def _candidates(collections: dict[str, Collection]) -> Iterator[Relation]:
    for source in collections.values():
        for reference, spec in source.fields.items():
            if spec.kind != "reference" or any(isinstance(v, list) for v in spec.values):
                continue
            holder = collections[spec.target]  # type: ignore[index]
            filters: list[tuple[str, Any, bool] | None] = [None]
            for name, other in source.fields.items():
                if other.kind == "enum":
                    filters += [(name, value, equal) for value in sorted(set(other.values), key=str)
                                for equal in (True, False)]  # fmt: skip
            numbers = [name for name, other in source.fields.items() if other.kind == "number"]
            for name, target_field in holder.fields.items():
                kind = target_field.kind
                for where in filters:
                    if kind == "enum" and all(isinstance(v, bool) for v in target_field.values):
                        yield Relation(holder.name, name, "exists", source.name, reference, where=where)
                    if kind == "number":
                        if all(isinstance(v, int) for v in target_field.values):
                            yield Relation(holder.name, name, "count", source.name, reference, where=where)
                        for number in numbers:
                            for aggregate in ("mean", "sum"):
                                yield Relation(holder.name, name, aggregate, source.name, reference, number, where)


def _derived(relation: Relation, collections: dict[str, Collection]) -> list[Any]:
    """What `relation` gives each record of its holder, in order."""
    holder, source = collections[relation.holder], collections[relation.source]
    grouped: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for _, record in source.pairs:
        if relation.where is not None:
            name, value, equal = relation.where
            if (record.get(name) == value) != equal:
                continue
        grouped[record.get(relation.reference)].append(record)
    derived = []
    for key in holder.ids:
        group = grouped.get(key, [])
        if relation.kind == "exists":
            derived.append(bool(group))
        elif relation.kind == "count":
            derived.append(len(group))
        else:
            numbers = [r.get(relation.value_field) for r in group]
            numbers = [n for n in numbers if isinstance(n, int | float) and not isinstance(n, bool)]
            total = sum(numbers)
            derived.append(total if relation.kind == "sum" else total / len(numbers) if numbers else 0)
    return derived


def _agrees(relation: Relation, actual: Any, derived: Any) -> bool:
    if relation.kind == "exists":
        return actual is derived
    if not isinstance(actual, int | float) or isinstance(actual, bool):
        return False
    if relation.kind == "mean":
        return abs(actual - derived) <= _MEAN_TOLERANCE
    return abs(actual - derived) <= 1e-6 * max(1.0, abs(derived))


def _trivial(actual: list[Any]) -> bool:
    """A relation every record would satisfy by chance: one value throughout (all booked, all counts 0)."""
    return len({repr(value) for value in actual}) < 2
