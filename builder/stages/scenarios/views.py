"""What each scenario request is shown, instead of the whole module: the environment's interface (description,
the class header with its rules and state definition, the tool schemas), states cut to the records a request
needs, and the sources of the methods a check has to understand (the gold's calls that change the state).

Every view takes a `shrink` level (0 .. SHRINK_LEVELS - 1): a prompt too long for the model's context is asked
again one level smaller (fewer state records, a shorter class header, fewer methods). Nothing here runs generated
code: methods are read from the AST.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Sequence
from typing import Any

from builder.envs.graph import written_attributes
from builder.json_values import leaves
from builder.records import Action, Environment
from builder.stages.evaluate.source import class_header, environment_text, method_nodes, method_source
from builder.stages.evaluate.source import state_text as whole_records_text

SHRINK_LEVELS = 3
STATE_CHARS = (12000, 6000, 3000)  # a state shown in a prompt is cut to this many characters, by record
RECORDS = (None, 6, 2)  # records kept per collection of a shown state (None: all)
HEADER_CHARS = (4000, 2000, 800)  # the class header (docstring, __init__) is cut to this many characters
METHODS = (4, 2, 0)  # method sources a check request is shown


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} … ({len(text) - limit} more characters cut)"


def interface_text(env: Environment, shrink: int = 0) -> str:
    """The environment as a user of its tools sees it: description, class header (rules, state) and tool schemas."""
    try:
        header = class_header(env.code)
    except (StopIteration, SyntaxError, IndexError):  # an accepted environment has a class; be safe anyway
        header = ""
    tools = json.dumps([tool["function"] for tool in env.tools], ensure_ascii=False)
    # The module docstring holds the plan's description and numbered rules (the code stage writes them there).
    about = environment_text(env.description, env.code)
    return (
        f"# Environment {env.name} ({env.domain})\n{about}\n\n"
        f"## Class header (state)\n```python\n{_clip(header, HEADER_CHARS[shrink])}\n```\n\n"
        f"## Tools\n{tools}"
    )


def _collection(value: Any) -> list[tuple[Any, Any]] | None:
    """The (key, record) pairs of a collection of records (a dict of dicts or a list of dicts), else None."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return list(value.items())
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return list(enumerate(value))
    return None


def _rebuild(original: Any, pairs: list[tuple[Any, Any]]) -> Any:
    return dict(pairs) if isinstance(original, dict) else [record for _, record in pairs]


def state_text(state: dict[str, Any], shrink: int = 0) -> str:
    """`state` as JSON of whole records: at most RECORDS[shrink] per collection, then within STATE_CHARS[shrink]
    characters (evaluate's cut: the largest collections lose their last records first and a note names them);
    never cut mid-JSON."""
    limit = RECORDS[shrink]
    shown = {}
    for name, value in state.items():
        pairs = _collection(value)
        shown[name] = value if pairs is None or limit is None or len(pairs) <= limit else _rebuild(value, pairs[:limit])
    note = " (some records left out)" if shown != state else ""
    return whole_records_text(shown, STATE_CHARS[shrink]) + note


def _scalars(value: Any) -> Iterable[str]:
    """The strings and integers inside `value`, as text: what a gold call can name (ids, keys, counts)."""
    return (str(leaf) for leaf in leaves(value) if isinstance(leaf, str | int) and not isinstance(leaf, bool))


def involved_state(state: dict[str, Any], actions: Sequence[Action]) -> dict[str, Any]:
    """The records the gold arguments name (by key or by a field value), plus one example of every other
    collection; other attributes as they are. What a check has to read, at a fraction of the state."""
    named = {value for action in actions for value in _scalars(action.arguments)}
    view = {}
    for name, value in state.items():
        pairs = _collection(value)
        if pairs is None:
            view[name] = value
            continue
        hits = [(k, r) for k, r in pairs if str(k) in named or named & {s for s in _scalars(r)}]
        view[name] = _rebuild(value, hits or pairs[:1])
    return view


# ------------------------------------------------------------------------------------------------ methods


def writes_state(method: ast.FunctionDef) -> bool:
    """Whether `method` may change the state (the tool graph's rule: `builder.envs.graph.written_attributes`)."""
    return bool(written_attributes(method))


def writer_sources(code: str, names: Sequence[str], shrink: int = 0) -> str:
    """The sources (with their helpers) of the distinct methods in `names` that change the state, at most
    METHODS[shrink] of them, in call order."""
    writers = []
    for name in dict.fromkeys(names):
        try:
            nodes = method_nodes(code, name)
        except (KeyError, StopIteration, SyntaxError):  # not a method of the class (or no class to read)
            continue
        if any(writes_state(node) for node in nodes):
            writers.append(name)
    return "\n\n".join(method_source(code, name) for name in writers[: METHODS[shrink]])
