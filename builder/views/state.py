"""States in prompts and in model replies: the one rule for what is a collection of records, a state rendered as
JSON of whole records within a budget, the records a set of calls involves, and the structured-output type a
model writes a state in (validated against the environment's state schema). Plain JSON data only."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, ClassVar

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model, model_validator

from builder.json_values import leaves, record_pairs
from builder.records import Action
from builder.sandbox.world import normalized_now
from builder.views.budget import PromptBudget

NOW_DESCRIPTION = (
    "The current local date-time of this state, ISO 8601 without a time zone (YYYY-MM-DDTHH:MM:SS), consistent "
    "with the dates in the state."
)


def _rebuild(original: Any, pairs: Sequence[tuple[Any, Any]]) -> Any:
    return dict(pairs) if isinstance(original, dict) else [record for _, record in pairs]


# ------------------------------------------------------------------------------------------------ rendering


def clip_json(value: Any, limit: int) -> str:
    """`value` as compact JSON, cut to `limit` characters with a note saying how much was left out."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=False, separators=(",", ":"))
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters cut)"


def state_text(state: dict[str, Any], budget: PromptBudget | int) -> str:
    """`state` as compact JSON of whole records: at most `budget.records` per collection, then within
    `budget.state_chars` characters (an int budget: that many characters, every record that fits).

    Never cut mid-JSON (a cut hides the ids a call needs and leaves text that does not parse): the largest
    collections lose their last records first, and a note after the JSON names what was left out. Attributes
    that are not collections of records are always shown whole.
    """
    chars, records = (budget, None) if isinstance(budget, int) else (budget.state_chars, budget.records)
    shown: dict[str, Any] = {}
    hidden: dict[str, list[str | None]] = {}
    for key, value in state.items():
        pairs = record_pairs(value)
        if pairs is not None and records is not None and len(pairs) > records:
            hidden[key] = [_label(k, r, value) for k, r in pairs[records:]]
            pairs = pairs[:records]
        shown[key] = _rebuild(value, pairs) if pairs is not None else value
    sizes = {key: _record_sizes(value) for key, value in shown.items() if record_pairs(value) is not None}
    total = len(_dumps(shown))
    while total + len(_omission_note(hidden)) > chars:
        candidates = [key for key in sizes if sizes[key]]
        if not candidates:
            break
        key = max(candidates, key=lambda k: sum(sizes[k]))
        collection = shown[key]
        if isinstance(collection, dict):
            label, record = next(reversed(collection.items()))
            del collection[label]
        else:
            label, record = len(collection) - 1, collection.pop()
        hidden.setdefault(key, []).insert(0, _label(label, record, collection))
        total -= sizes[key].pop() + (1 if sizes[key] else 0)  # the record and the comma before it
    return _dumps(shown) + _omission_note(hidden)


def _record_sizes(collection: dict[str, Any] | list[Any]) -> list[int]:
    """Characters each record takes in the compact JSON of its collection (its key included), in order."""
    if isinstance(collection, dict):
        return [len(_dumps({key: value})) - 2 for key, value in collection.items()]
    return [len(_dumps(value)) for value in collection]


def _label(key: Any, record: Any, collection: Any) -> str | None:
    """How the note names a left-out record: its key in a map, else the id it carries (`id` or `*_id`), if any."""
    if isinstance(collection, dict):
        return str(key)
    if isinstance(record, dict):
        for field in ["id", *(k for k in record if isinstance(k, str) and k.endswith("_id"))]:
            if isinstance(record.get(field), str | int):
                return str(record[field])
    return None


def _omission_note(hidden: dict[str, list[str | None]], shown_ids: int = 8) -> str:
    lines = []
    for key, labels in hidden.items():
        ids = [label for label in labels if label is not None]
        listed = f": ids {', '.join(ids[:shown_ids])}{', …' if len(ids) > shown_ids else ''}" if ids else ""
        lines.append(f"\n… {len(labels)} more {key} not shown{listed}")
    return "".join(lines)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _scalars(value: Any) -> Iterable[str]:
    """The strings and integers inside `value`, as text: what a call can name (ids, keys, counts)."""
    return (str(leaf) for leaf in leaves(value) if isinstance(leaf, str | int) and not isinstance(leaf, bool))


def involved_state(state: dict[str, Any], actions: Sequence[Action]) -> dict[str, Any]:
    """The records the actions' arguments name (by key or by a field value), plus one example of every other
    collection; other attributes as they are. What a check has to read, at a fraction of the state."""
    named = {value for action in actions for value in _scalars(action.arguments)}
    view = {}
    for name, value in state.items():
        pairs = record_pairs(value)
        if pairs is None:
            view[name] = value
            continue
        hits = [(k, r) for k, r in pairs if str(k) in named or named & set(_scalars(r))]
        view[name] = _rebuild(value, hits or pairs[:1])
    return view


# ---------------------------------------------------------------------------------------------- model output


class StateShapeError(ValueError):
    pass


class WrittenState(BaseModel):
    """A state a model wrote: the base of the types `state_output_type` makes (`now`, `state`, maybe `purpose`)."""

    model_config = ConfigDict(extra="forbid")
    SCHEMA: ClassVar[dict[str, Any]] = {}

    # `now`, `state` (and `purpose`) are fields of the type `state_output_type` makes, in the order a decoder
    # writes them; declared here they would come first.

    def values(self) -> dict[str, Any]:
        """The state as plain JSON data."""
        return self.state.model_dump()  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _follows_schema(self) -> WrittenState:
        self.now = normalized_now(self.now)
        validator = jsonschema.Draft202012Validator(type(self).SCHEMA)
        errors = sorted(validator.iter_errors(self.values()), key=lambda e: e.path)
        if errors:
            described = "; ".join(
                f"state.{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"[:300] for e in errors[:5]
            )
            raise StateShapeError(described)
        return self


def state_output_type(
    schema: dict[str, Any], name: str, *, purpose: bool = False, default_now: str | None = None
) -> type[WrittenState]:
    """The structured-output type of a state a model writes: (`purpose`, one sentence, when asked for), `now` and
    a `state` that must satisfy `schema`. `name` is the response format's name; `now` is required unless a
    `default_now` is given.

    `now` comes before the state, so the model picks "today" before the dates around it; it is normalised to
    whole seconds. The state's fields carry the attribute schemas as their JSON schema (so a constrained decoder
    follows them); validation re-checks the whole state with `jsonschema`, and its message goes back to the model
    on a retry.
    """
    fields: dict[str, Any] = {
        attribute: (Annotated[Any, WithJsonSchema(sub)], ...) for attribute, sub in schema["properties"].items()
    }
    state_type = create_model(f"{name}Values", __config__=ConfigDict(extra="forbid"), **fields)  # type: ignore[call-overload]
    head: dict[str, Any] = {}
    if purpose:
        description = "One sentence: what situation this state sets up for testing."
        head["purpose"] = (str, Field(description=description, max_length=400))
    made = create_model(  # type: ignore[call-overload]
        name,
        __base__=WrittenState,
        **head,
        now=(str, Field(... if default_now is None else default_now, description=NOW_DESCRIPTION, max_length=40)),
        state=(state_type, ...),
    )
    made.SCHEMA = schema
    return made
