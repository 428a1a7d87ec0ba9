"""Values for the arguments of sampled chains (`builder.stages.scenarios.chains`): paths into results, schema
kinds, and the draws the sampler makes among candidate values."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

SMALL_NUMBERS = (1, 2, 3, 5, 10, 20, 50, 100)  # for a number neither the state nor a result gives


def named_collection(tool: str, collections: set[str]) -> str | None:
    """The collection a tool's name names (`find_patients`, `get_patient` -> patients), the longest match."""
    words = tool.casefold()
    named = [c for c in collections if len(stem := c.casefold().removesuffix("s")) > 2 and stem in words]
    return max(named, key=len, default=None)


def value_paths(value: Any, path: str) -> list[tuple[str, Any]]:
    """Every (field path, scalar) of a result, paths as `values_at` reads them."""
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in value_paths(item, f"{path}.{key}" if path else str(key))]
    if isinstance(value, list):
        return [p for item in value for p in value_paths(item, f"{path}[]")]
    return [(path, value)]


def first_values(pools: dict[str, list[tuple[str, Any]]]) -> dict[str, Any]:
    """The most likely value of each parameter drawn so far (for dates: the records a call touches, its start)."""
    return {parameter: pool[0][1] for parameter, pool in pools.items() if pool}


def schema_kind(schema: dict[str, Any]) -> str | None:
    kinds = schema.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return next((k for k in ("string", "integer", "number", "boolean", "array") if k in kinds), None)


def fits(value: Any, kind: str | None) -> bool:
    if kind in ("integer", "number"):
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    return kind is None or isinstance(value, str)


def least_used(names: list[str], used: Counter[str], rng: random.Random) -> str:
    """One of `names`, tools the kept chains used less drawn more often (diversity across tools)."""
    options = sorted(set(names))
    return rng.choices(options, weights=[1 / (1 + used[name]) for name in options])[0]


def fresh_option(options: list[tuple[str, Any]], arguments: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    """One (source, value) option, preferring a value no other argument of the call has (a transfer between two
    accounts, not from one to itself)."""
    taken = [repr(value) for value in arguments.values()]
    return rng.choice([o for o in options if repr(o[1]) not in taken] or options)


def small_constant(schema: dict[str, Any], rng: random.Random) -> Any:
    """A number or flag for a parameter the state cannot give (None for anything else)."""
    kinds = schema.get("type", [])
    kinds = kinds if isinstance(kinds, list) else [kinds]
    low, high = schema.get("minimum", float("-inf")), schema.get("maximum", float("inf"))
    if "integer" in kinds or "number" in kinds:
        fitting = [n for n in SMALL_NUMBERS if low <= n <= high]
        return rng.choice(fitting) if fitting else None
    if "boolean" in kinds:
        return rng.random() < 0.5
    return None


def values_at(value: Any, path: str) -> list[Any]:
    """Every value at a result field path of `builder.envs.graph` (dots for keys, `[]` for list items)."""
    if not path:
        return [value] if not isinstance(value, dict | list) else []
    head, _, rest = path.partition(".")
    key, depth = head.split("[]", 1)[0], head.count("[]")
    found = [value[key]] if key and isinstance(value, dict) and key in value else ([] if key else [value])
    for _ in range(depth):
        found = [item for inner in found if isinstance(inner, list) for item in inner]
    return [leaf for inner in found for leaf in values_at(inner, rest)]
