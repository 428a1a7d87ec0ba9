"""How the chain sampler plans an attempt (`builder.stages.scenarios.chains`): a goal tool, the record the user's
goal is about (a person first), a look-up that reaches it, then look-ups, reads and further changes along the
tool graph. A part of the sampler, kept apart so each module stays readable."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from builder.envs.graph import ToolGraph
from builder.stages.scenarios.anchors import USER_KEYS, World, collection_of, linked, reached, user_facing
from builder.stages.scenarios.chain import Plan
from builder.stages.scenarios.chain_values import least_used


class Planning:
    """The planning half of the sampler: it reads the sampler's graph, schemas, world and usage counters."""

    graph: ToolGraph
    schemas: dict[str, dict[str, Any]]
    world: World
    used: Counter[str]
    failed: Counter[str]
    anchors_used: Counter[tuple[str, str]]

    def _collections(self, tool: str) -> list[str]:
        """The collections whose ids the tool takes."""
        properties = self.schemas[tool].get("properties", {})
        return [c for p, s in properties.items() if (c := collection_of(self.world, p, s)) is not None]

    def plan(self, rng: random.Random, length: int, shortest: int) -> Plan | None:
        """A goal writer, the record it is about (a user-facing one when it can), a look-up that reaches that
        record first, then look-ups feeding later tools, reads of what changed, or further changes."""
        writers = self.graph.writers()
        if not writers:
            return None
        goal = least_used(writers, self.used + self.failed, rng)
        anchor = self._anchor(goal, rng)
        tools = [goal]
        if anchor is not None and (finders := self._finders(anchor[0], exclude=writers)):
            tools.insert(0, least_used(finders, self.used, rng))
        while len(tools) < length:
            feeders = ({e.source for e in self.graph.edges if e.kind == "data" and e.target in tools}
                       | self._lookups(tools, writers)) - set(tools)  # fmt: skip
            readers = {e.target for e in self.graph.edges if e.kind == "state" and e.source in tools} - set(tools)
            related = self._related(anchor, writers) - set(tools)
            roll = rng.random()
            if feeders and roll < 0.3:
                tools.insert(0, least_used(sorted(feeders), self.used, rng))
            elif readers and roll < 0.7:
                tools.append(least_used(sorted(readers - set(writers)) or sorted(readers), self.used, rng))
            elif roll < 0.9 or len(tools) < shortest:
                tools.append(least_used(sorted(related) or writers, self.used, rng))
            else:
                break
        return Plan(tools=tuple(tools), goal=goal, anchor=anchor)

    def _anchor(self, goal: str, rng: random.Random) -> tuple[str, str] | None:
        """The person (or else the most user-facing record) a record of the goal leads to: a record of a collection
        the goal takes an id of is drawn, then among it, the records its references lead to and the records linked
        to it, the one whose collection has the most keys a user knows (people first); the records the kept chains
        were about least often drawn first."""
        collections = self._collections(goal)
        if not collections:  # a goal that names no record (a registration): the rest of the chain is one person's
            people = sorted({c for c, _ in self.world.records}, key=lambda c: (-user_facing(self.world, c), c))
            # the most user-facing collection, or with none, any record (an order stands for its customer)
            collections = people[:1] if people and user_facing(self.world, people[0]) else people
        keys = [(collection, key) for collection in dict.fromkeys(collections) for key in self.world.keys(collection)]
        if not keys:
            return None
        fewest = min(self.anchors_used[key] for key in keys)
        record = rng.choice([key for key in keys if self.anchors_used[key] == fewest])
        around = {record} | reached(self.world, record) | linked(self.world, record)
        best = max(user_facing(self.world, c) for c, _ in around)
        if best == 0:
            return record
        people = sorted({c for c, _ in around if user_facing(self.world, c) == best})
        # any record of the best collection may anchor (the goal's record is then one of its own, or refused)
        candidates = [(c, k) for c in people for k in self.world.keys(c)]
        fewest = min(self.anchors_used[key] for key in candidates)
        preferred = [key for key in candidates if key in around and self.anchors_used[key] == fewest]
        return rng.choice(preferred or [key for key in candidates if self.anchors_used[key] == fewest])

    def _finders(self, collection: str, exclude: list[str]) -> list[str]:
        """Read tools that reach a record of `collection` by a key a user knows or by its id."""
        fields = {f for (c, _), r in self.world.records.items() if c == collection for f in r}
        found = []
        for tool, parameters in self.schemas.items():
            if tool in exclude:
                continue
            names = set(parameters.get("properties", {}))
            facing = {n for n in names & fields if any(k in n.casefold() for k in USER_KEYS)}
            if facing or collection in self._collections(tool):
                found.append(tool)
        return sorted(found)

    def _lookups(self, tools: list[str], writers: list[str]) -> set[str]:
        """Read tools that take an id of a collection a planned tool takes and read a collection a planned tool
        takes an id of (`list_available_slots(dentist_id)` before `book_appointment(..., slot_id)`)."""
        wanted = {c for tool in tools for c in self._collections(tool)}
        reads = {node.name: set(node.reads) for node in self.graph.nodes}
        return {
            tool for tool in self.schemas
            if tool not in writers and set(self._collections(tool)) & wanted and reads.get(tool, set()) & wanted
        }  # fmt: skip

    def _related(self, anchor: tuple[str, str] | None, writers: list[str]) -> set[str]:
        """Writers that take an id of a collection the anchor's linked records belong to."""
        if anchor is None:
            return set()
        collections = {c for c, _ in linked(self.world, anchor)}
        return {w for w in writers if set(self._collections(w)) & collections}
