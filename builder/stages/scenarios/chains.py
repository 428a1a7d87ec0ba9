"""Tool chains sampled along an environment's dependency graph and executed in the sandbox.

A chain is 2-8 calls toward a goal: a state-changing tool, look-ups that feed it (a data edge of the graph), and
sometimes a further change or a read of what changed. Every argument comes from an earlier call's result (along
a data edge) or from the initial state (`builder.envs.graph.state_values`); a required string neither gives is
never invented: the attempt is dropped. Only numbers and flags a state cannot give are drawn from small
constants. A chain is kept only if every call succeeds, the state changes and a fresh replay from the initial
state gives the same final state. Sampling is seeded: the same graph, state and seed give the same chains.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from builder.envs.graph import ToolGraph, state_values, succeeded
from builder.envs.lint import Contract
from builder.envs.session import Session, SessionError
from builder.frozen import JSON, Frozen
from builder.records import Action
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED
from builder.stages.scenarios.verify import run_actions

SMALL_NUMBERS = (1, 2, 3, 5, 10, 20, 50, 100)  # for a number neither the state nor a result gives
USE_RESULT = 0.85  # chance a parameter fed by an earlier result takes it (else a state value)
OMIT_OPTIONAL = 0.6  # chance an optional parameter no result feeds is left at its default


class ChainCall(Frozen):
    """One executed call: its arguments, where each came from (`result N field`, `state`, `constant`), its result
    and whether it changed the state."""

    name: str
    arguments: JSON
    sources: dict[str, str]
    result: JSON
    changed: bool


class Chain(Frozen):
    """An executed chain and the states around it."""

    calls: tuple[ChainCall, ...]
    initial_state: JSON
    final_state: JSON

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(Action(name=call.name, arguments=call.arguments) for call in self.calls)

    @property
    def shape(self) -> str:
        """The tools in order, a changing call marked with `*`: `get_account > transfer*`."""
        return " > ".join(f"{call.name}{'*' if call.changed else ''}" for call in self.calls)


class Sampled(Frozen):
    """What one sampling run kept and why each dropped attempt was dropped (reason -> count)."""

    chains: tuple[Chain, ...]
    dropped: dict[str, int]


def sample_chains(
    sandbox: Sandbox, code: str, graph: ToolGraph, state: dict[str, Any], count: int,
    *, seed: int = 0, min_calls: int = 2, max_calls: int = 8, attempts: int | None = None,
    now: str = DEFAULT_NOW, env_seed: int = DEFAULT_SEED, contract: Contract = "strict",
) -> Sampled:  # fmt: skip
    """Up to `count` distinct verified chains from `state`, in at most `attempts` (default 10 per chain) tries.

    `seed` seeds the sampling; `now` and `env_seed` are the sandbox world's, as for any session. Drop reasons:
    no_writer, no_value (a required id nothing gives), call_failed, no_state_change, nondeterministic,
    duplicate, load_failed.
    """
    if not 1 <= min_calls <= max_calls:
        raise ValueError(f"need 1 <= min_calls <= max_calls, got {min_calls} and {max_calls}")
    with Session(sandbox, code, state, now=now, seed=env_seed, contract=contract) as session:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in session.tools}
        initial = session.snapshot()
    kept: list[Chain] = []
    dropped: Counter[str] = Counter()
    used: Counter[str] = Counter()
    for attempt in range(attempts if attempts is not None else 10 * count):
        if len(kept) >= count:
            break
        rng = random.Random(f"{seed}:{attempt}")
        plan = _plan(graph, rng, rng.randint(min_calls, max_calls), min_calls, used)
        if plan is None:
            dropped["no_writer"] += 1
            break  # no tool changes the state: no attempt can succeed
        try:
            chain, reason = _execute(sandbox, code, graph, schemas, initial, plan, rng, now, env_seed, contract)
        except SessionError:
            chain, reason = None, "load_failed"
        if chain is not None and any(c.actions == chain.actions for c in kept):
            chain, reason = None, "duplicate"
        if chain is None:
            dropped[reason] += 1
            continue
        kept.append(chain)
        used.update(call.name for call in chain.calls)
    return Sampled(chains=tuple(kept), dropped=dict(dropped))


def _plan(graph: ToolGraph, rng: random.Random, length: int, shortest: int, used: Counter[str]) -> list[str] | None:
    """Up to `length` tools around a goal writer: look-ups that feed a later tool before it, reads of what a
    writer changed or further changes after it. A look-up appears once (a second would return the same)."""
    writers = graph.writers()
    if not writers:
        return None
    plan = [_least_used(writers, used, rng)]
    while len(plan) < length:
        feeders = {e.source for e in graph.edges if e.kind == "data" and e.target in plan} - set(plan)
        readers = {e.target for e in graph.edges if e.kind == "state" and e.source in plan} - set(plan)
        roll = rng.random()
        if feeders and roll < 0.5:
            plan.insert(0, _least_used(sorted(feeders), used, rng))
        elif readers and roll < 0.75:
            plan.append(_least_used(sorted(readers - set(writers)) or sorted(readers), used, rng))
        elif roll < 0.9 or len(plan) < shortest:
            plan.append(_least_used(writers, used, rng))
        else:
            break
    return plan


def _least_used(names: list[str], used: Counter[str], rng: random.Random) -> str:
    """One of `names`, tools the kept chains used less drawn more often (diversity across tools)."""
    options = sorted(set(names))
    return rng.choices(options, weights=[1 / (1 + used[name]) for name in options])[0]


def _execute(
    sandbox: Sandbox, code: str, graph: ToolGraph, schemas: dict[str, dict[str, Any]], initial: dict[str, Any],
    plan: list[str], rng: random.Random, now: str, env_seed: int, contract: Contract,
) -> tuple[Chain | None, str]:  # fmt: skip
    calls: list[ChainCall] = []
    with Session(sandbox, code, initial, now=now, seed=env_seed, contract=contract) as session:
        before = session.snapshot()
        for name in plan:
            arguments, sources = _arguments(graph, name, schemas[name], initial, calls, rng)
            if arguments is None:
                return None, "no_value"
            result = session.call(name, arguments)
            if not succeeded(result):
                return None, "call_failed"
            after = session.snapshot()
            calls.append(ChainCall(name=name, arguments=arguments, sources=sources, result=result.result,
                                   changed=after != before))  # fmt: skip
            before = after
    if before == initial:
        return None, "no_state_change"
    if run_actions(sandbox, code, initial, [Action(name=c.name, arguments=c.arguments) for c in calls],
                   now=now, seed=env_seed, contract=contract)[1] != before:  # fmt: skip
        return None, "nondeterministic"
    return Chain(calls=tuple(calls), initial_state=initial, final_state=before), ""


def _arguments(
    graph: ToolGraph, name: str, parameters: dict[str, Any], state: dict[str, Any], calls: list[ChainCall],
    rng: random.Random,
) -> tuple[dict[str, Any] | None, dict[str, str]]:  # fmt: skip
    arguments: dict[str, Any] = {}
    sources: dict[str, str] = {}
    required = set(parameters.get("required", []))
    for parameter, schema in parameters.get("properties", {}).items():
        fed = [
            (f"result {i + 1} {edge.output or '(result)'}", value)
            for edge in graph.feeding(name, parameter)
            for i, call in enumerate(calls)
            if call.name == edge.source
            for value in values_at(call.result, edge.output)
        ]
        if fed and (parameter in required or rng.random() < 0.5) and rng.random() < USE_RESULT:
            sources[parameter], arguments[parameter] = _fresh(fed, arguments, rng)
            continue
        if parameter not in required and rng.random() < OMIT_OPTIONAL:
            continue
        pool = state_values(parameter, schema, state)
        if pool:
            origin = "schema" if "enum" in schema else "state"
            sources[parameter], arguments[parameter] = _fresh([(origin, v) for v in pool], arguments, rng)
            continue
        constant = _constant(schema, rng)
        if constant is not None:
            sources[parameter], arguments[parameter] = "constant", constant
        elif parameter in required:
            return None, sources  # a required string no result or state gives: never invented
    return arguments, sources


def _fresh(options: list[tuple[str, Any]], arguments: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    """One (source, value) option, preferring a value no other argument of the call has (a transfer between two
    accounts, not from one to itself)."""
    taken = [repr(value) for value in arguments.values()]
    return rng.choice([o for o in options if repr(o[1]) not in taken] or options)


def _constant(schema: dict[str, Any], rng: random.Random) -> Any:
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
