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
from builder.json_values import leaves
from builder.records import Action
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED
from builder.stages.scenarios.anchors import (
    USER_KEYS,
    World,
    coherent_value,
    collection_of,
    date_values,
    described_choices,
    is_date,
    people_named,
    world_of,
)
from builder.stages.scenarios.anchors import (
    allowed as admitted,
)
from builder.stages.scenarios.chain import Chain, ChainCall, Plan, Sampled, chain_changes
from builder.stages.scenarios.chain_facts import FACTS_PER_READ, MAX_FACTS, read_facts, reported, without
from builder.stages.scenarios.chain_plans import Planning
from builder.stages.scenarios.chain_steps import StepRules, duplicates, is_empty, targets, undone, without_noop
from builder.stages.scenarios.chain_values import (
    first_values,
    fits,
    named_collection,
    schema_kind,
    small_constant,
    value_paths,
    values_at,
)
from builder.stages.scenarios.verify import run_actions

USE_RESULT = 0.85  # chance a parameter fed by an earlier result takes it (else a state value)
OMIT_OPTIONAL = 0.6  # chance an optional parameter no result feeds is left at its default
TRIES = 6  # argument sets tried for one call before the attempt is dropped as call_failed
# Why a step is left out of a chain while the chain goes on (`chain_steps`, `chain_facts`), counted per step.
STEP_REASONS = ("noop_write", "free_text_unfit", "empty_read", "duplicate_record", "unchecked_read")


def sample_chains(
    sandbox: Sandbox, code: str, graph: ToolGraph, state: dict[str, Any], count: int,
    *, seed: int = 0, min_calls: int = 2, max_calls: int = 8, attempts: int | None = None,
    now: str = DEFAULT_NOW, env_seed: int = DEFAULT_SEED, contract: Contract = "strict",
) -> Sampled:  # fmt: skip
    """Up to `count` distinct verified chains from `state`, in at most `attempts` (default 10 per chain) tries.

    `seed` seeds the sampling; `now` and `env_seed` are the sandbox world's, as for any session. Drop reasons
    (attempts): no_writer, no_value (a required id nothing gives), call_failed (every argument set tried was
    refused), duplicate_record (a create made a record with an existing one's name or email), too_short (fewer
    than `min_calls` calls were left), incoherent (a value of a record not linked to the chain's anchor),
    no_state_change, nondeterministic, duplicate, load_failed. Steps left out while the attempt goes on are
    counted under STEP_REASONS (`chain_steps`, `chain_facts`).
    """
    if not 1 <= min_calls <= max_calls:
        raise ValueError(f"need 1 <= min_calls <= max_calls, got {min_calls} and {max_calls}")
    with Session(sandbox, code, state, now=now, seed=env_seed, contract=contract) as session:
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in session.tools}
        initial = session.snapshot()
    sampler = _Sampler(graph, schemas, initial, world_of(initial), now, min_calls)
    kept: list[Chain] = []
    dropped: Counter[str] = Counter()
    for attempt in range(attempts if attempts is not None else 10 * count):
        if len(kept) >= count:
            break
        rng = random.Random(f"{seed}:{attempt}")
        plan = sampler.plan(rng, rng.randint(min_calls, max_calls), min_calls)
        if plan is None:
            dropped["no_writer"] += 1
            break  # no tool changes the state: no attempt can succeed
        try:
            chain, reason = sampler.execute(sandbox, code, plan, rng, env_seed, contract)
        except SessionError:
            chain, reason = None, "load_failed"
        if chain is not None and any(chain_changes(c) == chain_changes(chain) for c in kept):
            chain, reason = None, "duplicate"  # the same changes with other look-ups: the same task for the user
        if chain is None:
            dropped[reason] += 1
            sampler.failed[plan.goal] += 1
            continue
        kept.append(chain)
        sampler.used.update(call.name for call in chain.calls)
        if chain.anchor is not None:
            sampler.anchors_used[chain.anchor] += 1
    dropped.update(sampler.steps)
    return Sampled(chains=tuple(kept), dropped=dict(dropped))


class _Sampler(Planning, StepRules):
    """Plans and runs attempts from one state, learning which values each tool refuses."""

    def __init__(self, graph: ToolGraph, schemas: dict[str, dict[str, Any]], initial: dict[str, Any],
                 world: World, now: str, min_calls: int = 1) -> None:  # fmt: skip
        self.graph, self.schemas, self.initial, self.world, self.now = graph, schemas, initial, world, now
        self.min_calls, self.writers = min_calls, set(graph.writers())
        self.steps: Counter[str] = Counter()  # steps left out of attempts, by reason (STEP_REASONS)
        self.used: Counter[str] = Counter()
        self.anchors_used: Counter[tuple[str, str]] = Counter()
        # (collection, collection) pairs whose records reference one another's (time_slots -> doctors)
        self.kind_links = {(ref[0], target[0]) for ref, targets in world.out.items() for target in targets}
        self.failed: Counter[str] = Counter()  # goal tool -> attempts it failed (drawn less often next time)
        # (tool, parameter, value) -> times refused / accepted: a refused call says the record does not fit
        self.refused: Counter[tuple[str, str, str]] = Counter()
        self.accepted: set[tuple[str, str, str]] = set()

    def execute(self, sandbox: Sandbox, code: str, plan: Plan, rng: random.Random, env_seed: int,
                contract: Contract) -> tuple[Chain | None, str]:  # fmt: skip
        allowed = admitted(self.world, plan.anchor) if plan.anchor is not None else None
        calls: list[ChainCall] = []
        with Session(sandbox, code, self.initial, now=self.now, seed=env_seed, contract=contract) as session:
            before = session.snapshot()
            for name in plan.tools:
                options, why = self._argument_sets(name, calls, allowed, rng, before)
                if not options:
                    if why in STEP_REASONS:  # the step is left out; the chain goes on without it
                        self.steps[why] += 1
                        continue
                    return None, "no_value"
                for arguments, sources in options:  # noqa: B007 - the accepted set is used below
                    result = session.call(name, arguments)
                    after = session.snapshot()
                    if succeeded(result):
                        self._learn(name, arguments, accepted=True)
                        break
                    self._learn(name, arguments, accepted=False)
                    if after != before:
                        return None, "call_failed"  # a refusal that changed the state cannot be left out
                else:
                    return None, "call_failed"
                writes = name in self.writers
                if writes and after == before or not writes and is_empty(result.result):
                    self.steps["noop_write" if writes else "empty_read"] += 1  # it changed or told nothing
                    continue
                if writes and duplicates(before, after):
                    return None, "duplicate_record"  # a second record with an existing one's name or email
                if writes and undone(self.initial, before, after):
                    return None, "undoes_write"  # the step takes back what an earlier one did
                calls.append(ChainCall(name=name, arguments=arguments, sources=sources, result=result.result,
                                       changed=after != before))  # fmt: skip
                before = after
        if before == self.initial:
            return None, "no_state_change"
        calls, facts = self._reported(calls, before)
        if len(calls) < self.min_calls:
            return None, "too_short"
        named = [value for call in calls for value in leaves(call.arguments)]
        if allowed is not None and not all(coherent_value(self.world, value, allowed) for value in named):
            return None, "incoherent"
        if len(people_named(self.world, named)) > 1:
            return None, "incoherent"  # two people's records: one user does not act for another
        if run_actions(sandbox, code, self.initial, [Action(name=c.name, arguments=c.arguments) for c in calls],
                       now=self.now, seed=env_seed, contract=contract)[1] != before:  # fmt: skip
            return None, "nondeterministic"
        anchor = f"{plan.anchor[0]}/{plan.anchor[1]}" if plan.anchor is not None else None
        chain = Chain(calls=tuple(calls), initial_state=self.initial, final_state=before, anchor=anchor, facts=facts)
        return chain, ""

    def _reported(self, calls: list[ChainCall], final: dict[str, Any]) -> tuple[list[ChainCall], tuple[str, ...]]:
        """The calls without the reads the user would ask about that give no fact to check (`unchecked_read`, while
        `min_calls` remain), and the answer facts of those kept (`chain_facts`)."""
        asked = reported(calls)
        share = FACTS_PER_READ if len(asked) <= MAX_FACTS // FACTS_PER_READ else 1
        found = {i: read_facts(calls[i], calls, self.initial, final)[:share] for i in asked}
        # a read the user cannot be asked about (no fact to check) is left out while the chain keeps `min_calls`;
        # one kept is a silent look-up (the template states its values as context, the prompt marks it so)
        dropped = [i for i in asked if not found[i]][: max(0, len(calls) - self.min_calls)]
        self.steps["unchecked_read"] += len(dropped)
        facts = tuple(dict.fromkeys(f for i in asked for f in found[i]))[:MAX_FACTS]
        return without(calls, dropped), facts

    def _learn(self, tool: str, arguments: dict[str, Any], *, accepted: bool) -> None:
        for parameter, value in arguments.items():
            key = (tool, parameter, repr(value))
            if accepted:
                self.accepted.add(key)
            else:
                self.refused[key] += 1

    def _argument_sets(
        self, name: str, calls: list[ChainCall], allowed: set[tuple[str, str]] | None, rng: random.Random,
        current: dict[str, Any],
    ) -> tuple[list[tuple[dict[str, Any], dict[str, str]]], str]:  # fmt: skip
        """Up to TRIES distinct argument sets for `name` on the `current` state, values the tool accepted before
        first and values it refused last, and why there is none: a required parameter with no value (no_value,
        or free_text_unfit, duplicate_record for a free text or a create's name nothing fits), or every set would
        set values the record already has (noop_write)."""
        parameters = self.schemas[name]
        required = set(parameters.get("required", []))
        writes = name in self.writers
        about = named_collection(name, {c for c, _ in self.world.records}) if writes else None
        pools: dict[str, list[tuple[str, Any]]] = {}
        offered: dict[str, list[tuple[str, Any]]] = {}  # optional parameters left out, with their options
        for parameter, schema in parameters.get("properties", {}).items():
            pool = self._options(name, parameter, schema, calls, allowed, writes, pools, rng)
            pool = self._fitting(name, parameter, schema, pool, pools, about, current) if writes else pool
            if not pool:
                if parameter in required:
                    return [], self._why_none(name, parameter, schema, about, current)
                continue
            if parameter not in required and not any(s.startswith("result ") for s, _ in pool):
                # an optional id of a linked record (whose reminders) is kept more often than a filter
                linked_id = allowed is not None and collection_of(self.world, parameter, schema) is not None
                if rng.random() < (OMIT_OPTIONAL / 2 if linked_id else OMIT_OPTIONAL):
                    offered[parameter] = pool
                    continue
            pools[parameter] = pool
        if not pools and offered:
            parameter = rng.choice(sorted(offered))
            pools[parameter] = offered[parameter]  # a search with no criterion is refused or returns everything
        sets: list[tuple[dict[str, Any], dict[str, str]]] = []
        for depth in range(TRIES * 4):
            arguments: dict[str, Any] = {}
            sources: dict[str, str] = {}
            for parameter, pool in pools.items():
                # the best option no other argument of the call took (a transfer between two accounts), more
                # options for each further set
                taken = [repr(v) for v in arguments.values()]
                fresh = [option for option in pool if repr(option[1]) not in taken] or pool
                source, value = rng.choice(fresh[: depth + 1] if depth < TRIES else fresh)
                arguments[parameter], sources[parameter] = value, source
            if all(arguments != seen for seen, _ in sets):
                sets.append((arguments, sources))
            if len(sets) >= 2 * TRIES:
                break
        if writes:  # a write sets no value its record has or had (`chain_steps.without_noop`)
            changing = []
            for arguments, sources in sets:
                kept = without_noop(arguments, current, self._written(arguments, about, current), required)
                if kept is not None and self._own_text(name, kept, about, current):
                    changing.append((kept, {p: s for p, s in sources.items() if p in kept}))
            if sets and not changing:
                return [], "noop_write"
            sets = [option for i, option in enumerate(changing) if option[0] not in [o[0] for o in changing[:i]]]
        # sets whose records agree first: a slot of the doctor the call names, not another doctor's
        sets.sort(key=lambda option: not self._consistent(option[0]))
        return sets[:TRIES], ""

    def _written(self, arguments: dict[str, Any], about: str | None, current: dict[str, Any]) -> list[dict[str, Any]]:
        """The records a write names, as they are now and as they were before the chain (setting a value back is
        undoing the chain's own change: the negative control refuses it)."""
        return targets(current, arguments, about) + targets(self.initial, arguments, about)

    def _consistent(self, arguments: dict[str, Any]) -> bool:
        """Whether the records a call names agree: when records of one's collection reference records of the
        other's (slots reference doctors), the one named references the other named."""
        named = [ref for value in arguments.values() for ref in self.world.owner(value)]
        for first in named:
            for second in named:
                kinds_link = (first[0], second[0]) in self.kind_links
                if first != second and kinds_link and second not in self.world.out.get(first, set()):
                    return False
        return True

    def _options(
        self, tool: str, parameter: str, schema: dict[str, Any], calls: list[ChainCall],
        allowed: set[tuple[str, str]] | None, writes: bool, earlier: dict[str, list[tuple[str, Any]]],
        rng: random.Random,
    ) -> list[tuple[str, Any]]:  # fmt: skip
        """(source, value) options for one parameter, best first."""
        if "enum" in schema:
            return self._ranked(tool, parameter, [("schema", v) for v in schema["enum"]], rng)
        kind = schema_kind(schema)
        if (choices := described_choices(schema)) and not (kind == "string" and is_date(parameter, schema)):
            return self._ranked(tool, parameter, [("schema", v) for v in choices], rng)
        collection = collection_of(self.world, parameter, schema) or self._fed_collection(tool, parameter)
        fed = [(source, v) for source, v in self._from_results(tool, parameter, collection, calls) if fits(v, kind)]
        if collection is not None and kind == "array":  # `add_to_watchlist(stocks)`: a list of one admitted key
            keys = [key for c, key in (allowed if allowed is not None else self.world.records) if c == collection]
            return self._ranked(tool, parameter, [("state", [k]) for k in sorted(keys)], rng)
        if collection is not None:
            keys = [key for c, key in (allowed if allowed is not None else self.world.records) if c == collection]
            if allowed is None:
                keys = self.world.keys(collection)
            state = self._ranked(tool, parameter, [("state", k) for k in sorted(keys)], rng)
            return (fed + state) if fed and rng.random() < USE_RESULT else state + fed
        if kind == "string" and is_date(parameter, schema):
            if not writes:
                return []  # a date filter narrows a look-up; the look-up works without it
            touched = [self.world.records[ref] for value in first_values(earlier) for ref in self.world.owner(value)]
            dates = date_values(parameter, schema, self.now, touched, first_values(earlier), rng)
            return [("now", d) for d in dates]
        about = named_collection(tool, {c for c, _ in self.world.records})
        if about is not None:  # `register_patient(name)` takes no medication's name a search returned
            fed = [(source, v) for source, v in fed if not self._foreign(v, about)]
        if self._plain_field(parameter):
            fed = [(source, v) for source, v in fed if not self.world.owner(v)]  # a name field takes no record key
        if fed:
            return fed
        near = self._near_values(tool, parameter, allowed)
        if near:
            unique = [v for i, v in enumerate(near) if v not in near[:i]]
            options = [("state", v) for v in unique if fits(v, kind)]
            if kind in ("integer", "number") and (constant := small_constant(schema, rng)) is not None:
                options.append(("constant", constant))  # a record's 0 may be what the tool refuses
            return self._ranked(tool, parameter, options, rng)
        if kind is not None or allowed is None:  # what the state holds: keys its description names, like fields
            pool = [v for v in state_values(parameter, schema, self.initial) if fits(v, kind) and
                    (allowed is None or coherent_value(self.world, v, allowed))]  # fmt: skip
            if self._plain_field(parameter):
                pool = [v for v in pool if not self.world.owner(v)]
            if pool:
                return [("state", v) for v in pool]
        constant = small_constant(schema, rng)
        return [("constant", constant)] if constant is not None else []

    def _from_results(self, tool: str, parameter: str, collection: str | None,
                      calls: list[ChainCall]) -> list[tuple[str, Any]]:  # fmt: skip
        """Values earlier results give for a parameter: along the graph's data edges, or at a field named like
        it (or like the key field of the collection it takes)."""
        names = {parameter}
        if collection is not None and collection in self.world.key_field:
            names.add(self.world.key_field[collection])
        found = [
            (f"result {i + 1} {edge.output or '(result)'}", value)
            for edge in self.graph.feeding(tool, parameter)
            for i, call in enumerate(calls)
            if call.name == edge.source
            for value in values_at(call.result, edge.output)
        ]
        for i, call in enumerate(calls):
            for path, value in value_paths(call.result, ""):
                if path.rsplit(".", 1)[-1].removesuffix("[]") in names and isinstance(value, str | int):
                    found.append((f"result {i + 1} {path}", value))
        return list(dict.fromkeys(found))

    def _near_values(self, tool: str, parameter: str, allowed: set[tuple[str, str]] | None) -> list[Any]:
        """Values of fields named like `parameter` in the admitted records (of the collection the tool's name
        names, when it names one: `find_patients(name)` takes a patient's name, not a dentist's), then vocabulary
        of that field; for a search text, the admitted records' user-facing keys."""
        refs = sorted(allowed) if allowed is not None else []
        about = named_collection(tool, {c for c, _ in self.world.records})
        if about is not None and any(c == about and parameter in self.world.records[(c, k)] for c, k in refs):
            refs = [ref for ref in refs if ref[0] == about]
        values = [r[parameter] for ref in refs if parameter in (r := self.world.records[ref])]
        if not values and any(w in parameter for w in ("query", "search", "text", "term", "keyword")):
            values = [v for ref in refs for f, v in self.world.records[ref].items()
                      if any(k in f.casefold() for k in USER_KEYS) and isinstance(v, str)]  # fmt: skip
        field_values = [r[parameter] for r in self.world.records.values() if parameter in r]
        values += [v for v in field_values if isinstance(v, str) and v in self.world.vocabulary]
        return [v for v in values if not isinstance(v, dict)]

    def _plain_field(self, parameter: str) -> bool:
        """Whether records hold a field of this name with values that are no record's key (`customer: "Ada
        Palmer"`): the parameter then takes such values, never an id."""
        return any(parameter in r and not self.world.owner(r[parameter]) for r in self.world.records.values())

    def _fed_collection(self, tool: str, parameter: str) -> str | None:
        """The collection whose keys the graph's data edges into a parameter carry (`transfer(target)` is fed
        account ids), for a parameter whose name does not say it."""
        if self._plain_field(parameter):
            return None
        owners = {ref[0] for edge in self.graph.feeding(tool, parameter) for ref in self.world.owner(edge.example)}
        return owners.pop() if len(owners) == 1 else None

    def _foreign(self, value: Any, collection: str) -> bool:
        """Whether `value` is a field value of records of other collections only (not of `collection`'s)."""
        holders = {c for (c, _), record in self.world.records.items() if value in record.values()}
        return bool(holders) and collection not in holders

    def _ranked(self, tool: str, parameter: str, options: list[tuple[str, Any]],
                rng: random.Random) -> list[tuple[str, Any]]:  # fmt: skip
        """Options in a random order, those the tool refused (and never accepted) last."""
        shuffled = list(options)
        rng.shuffle(shuffled)

        def rank(option: tuple[str, Any]) -> int:
            key = (tool, parameter, repr(option[1]))
            # only refusals reorder: a value refused and never accepted goes last; accepted values keep no
            # precedence over untried ones, so the chains do not all settle on the first record that worked
            return 1 if self.refused[key] and key not in self.accepted else 0

        return sorted(shuffled, key=rank)
