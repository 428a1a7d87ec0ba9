"""A tool chain as the graph method keeps it: the calls it executed, the states around it, the plan it came from
(`builder.stages.scenarios.chains` samples them)."""

from __future__ import annotations

from builder.frozen import JSON, Frozen
from builder.records import Action


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
    anchor: str | None = None  # `collection/key` of the record the user's goal is about
    facts: tuple[str, ...] = ()  # what the answer must state: values the reads the user asks about returned

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


class Plan(Frozen):
    """The tools of one attempt, in order, and the record the user's goal is about (None: no record)."""

    tools: tuple[str, ...]
    goal: str
    anchor: tuple[str, str] | None


def chain_changes(chain: Chain) -> list[tuple[str, str]]:
    """The chain's state-changing calls (what the user asks for), as comparable text."""
    return [(call.name, repr(sorted(call.arguments.items()))) for call in chain.calls if call.changed]
