"""The consistency gates of the evaluate stage, on the state diffs of the rule probes' accepted valid calls
(`builder.stages.evaluate.probes`): one empty value per field (a tool writing `None` where another writes `""`,
or against the state schema's type) and new record ids in the format of the test state's ids of the same
collection (`D16` next to seeded `D-522`)."""

from __future__ import annotations

import json
import re
from typing import Any

from builder.envs.state_schema import generated_state_schema, record_schema
from builder.json_values import record_pairs
from builder.records import Environment
from builder.stages._repair import ToolProblemText
from builder.stages.evaluate.exercise import TestState


def consistency_problems(
    env: Environment, states: list[TestState], probes: list[Any], runs: list[Any], default_state: dict[str, Any]
) -> dict[str, list[ToolProblemText]]:
    """Problems of the records the accepted valid calls wrote: a field whose empty value is `None` in one tool
    and `""` in another (or against the state schema), and new ids whose format is not the seeded ids'."""
    schema = generated_state_schema(env.state_schema, default_state).get("properties", {})
    empties: dict[tuple[str, str], dict[str, set[str]]] = {}  # (collection, field) -> empty kind -> tools
    errors: dict[str, list[ToolProblemText]] = {}
    for probe, run in zip(probes, runs, strict=True):
        if probe.rule is not None or run.before is None or run.after is None:
            continue
        if not run.result.ok or run.result.refused:
            continue
        for collection, key, record, created in written_records(run.before, run.after):
            for field, value in record.items():
                if value is None or value == "":
                    kind = "None" if value is None else '""'
                    empties.setdefault((collection, field), {}).setdefault(kind, set()).add(probe.tool)
            if created:
                problem = id_problem(collection, key, states[probe.state].state.get(collection))
                if problem:
                    message = f"{probe.tool}({json.dumps(probe.arguments, ensure_ascii=False)}) {problem}"
                    errors.setdefault(probe.tool, []).append(ToolProblemText("id_format", message))
    for (collection, field), kinds in sorted(empties.items()):
        convention = schema_empty(schema.get(collection), field)
        if convention is None and len(kinds) < 2:
            continue
        if convention is None:  # two tools disagree and the schema does not say: the more common one wins
            convention = max(sorted(kinds), key=lambda k: (len(kinds[k]), k == "None"))
        for kind, tools in kinds.items():
            if kind == convention:
                continue
            others = sorted(kinds.get(convention, set()))
            said = f"the other tools ({', '.join(others)}) write {convention}" if others else "the state schema says"
            message = (
                f"it writes {kind} for an empty `{field}` of a {collection} record, but {said}: an empty "
                f"`{field}` is {convention} everywhere in this environment. Write {convention}."
            )
            for tool in sorted(tools):
                errors.setdefault(tool, []).append(ToolProblemText("empty_value_mixed", message))
    return errors


def written_records(before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any], bool]]:
    """(collection, key, record, created) of every record a call added or changed (the changed fields only)."""
    found = []
    for collection, value in after.items():
        pairs = record_pairs(value)
        if pairs is None:
            continue
        old = before.get(collection)
        if isinstance(value, dict):
            old_records = old if isinstance(old, dict) else {}
            for key, record in pairs:
                if key not in old_records:
                    found.append((collection, key, record, True))
                elif record != old_records[key]:
                    changed = {f: v for f, v in record.items() if old_records[key].get(f, object()) != v}
                    found.append((collection, key, changed, False))
        else:
            old_items = old if isinstance(old, list) else []
            for index, record in pairs:
                if index >= len(old_items):
                    found.append((collection, _list_id(record), record, True))
    return found


def _list_id(record: dict[str, Any]) -> Any:
    first = next(iter(record), None)
    return record.get("id", record.get(first) if first is not None and str(first).endswith("id") else None)


def id_shape(value: str) -> str:
    """An id's format: its text with every run of digits as `9` (`D-522` -> `D-9`, `D16` -> `D9`)."""
    return re.sub(r"\d+", "9", value)


def id_problem(collection: str, key: Any, seeded: Any) -> str | None:
    """Why a new id of `collection` breaks the format of its seeded ids (None: it keeps it, or the seeded ids do
    not share one format, or fewer than two exist)."""
    if not isinstance(key, str):
        return None
    pairs = record_pairs(seeded) or []
    ids = [k if isinstance(seeded, dict) else _list_id(r) for k, r in pairs]
    shapes = {id_shape(i) for i in ids if isinstance(i, str)}
    if len(ids) < 2 or len(shapes) != 1 or id_shape(key) in shapes:
        return None
    examples = ", ".join(map(str, ids[:3]))
    return (
        f"created the {collection} record {key!r}, but the existing {collection} ids look like {examples}: "
        f"make new ids in the same format (the next free number after the largest existing one)"
    )


def schema_empty(collection: Any, field: str) -> str | None:
    """The empty value the state schema gives a record field: `None` when it is nullable and not a string,
    `""` when it is a string and not nullable; None when it does not say."""
    record = record_schema(collection)
    prop = (record or {}).get("properties", {}).get(field) if record else None
    if not isinstance(prop, dict):
        return None
    options = prop.get("anyOf", [prop])
    types = set()
    for option in options:
        kind = option.get("type") if isinstance(option, dict) else None
        types.update(kind if isinstance(kind, list) else [kind])
    if "null" in types and "string" not in types:
        return "None"
    if "string" in types and "null" not in types:
        return '""'
    return None
