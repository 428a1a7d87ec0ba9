"""The reward audit: before a scenario is kept, its published reward (`builder.envs.checks.published_reward`) is
tried on sequences whose right reward is known, all run in the sandbox at the scenario's `now` and seed.

- `nothing`: no call. The reward must be 0, else `reward_for_nothing`.
- `gold`: the gold sequence. The reward must be 1, else `gold_not_rewarded`.
- `collateral`: the gold plus one state-changing call on a record the gold does not touch. The reward must be
  below 1, else `collateral_rewarded`.
- `order`: the gold with two state-changing calls swapped that name different records (no record key in
  common, each naming one): independent, so their order is the gold's incidental choice. When every call still
  succeeds, the reward must be 1 (two appends to a log in the other order), else `order_sensitive`.
- `spelling`: the gold with equivalent spellings of its values (an ISO date-time without its `:00` seconds; `""`
  for `null` and back where the tool's schema allows both). The reward must be 1, else `spelling_sensitive`.

When the task asks to be told something (`answer_facts`), the agent's answer is graded too (`builder.envs.answer`):
`nothing` says nothing; the other cases answer with every fact (`gold_answer`), and `spelling` says them as a
person would (`natural_answer`: "March 14, 2025 at 9:20 AM", "1,250", "dual monitor"), a case of its own even
when no call value has another spelling.

A case that cannot be built for a scenario (no other record to touch, no independent pair, no value with another
spelling, the environment refusing the variant call) is `n/a`, not a failure. A scenario without a gold sequence
(imported from a dataset that has none) gets the `nothing` case only.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from builder.envs.answer import NOTHING_ASKED, AnswerCheck, gold_answer, natural_answer
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.guard import changed_paths, covered
from builder.envs.lint import Contract
from builder.envs.probe import generate_arguments
from builder.envs.session import Session, SessionError
from builder.json_values import record_pairs
from builder.records import Action
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED

CASES = ("nothing", "gold", "collateral", "order", "spelling")
FAILURES = {
    "nothing": "reward_for_nothing",
    "gold": "gold_not_rewarded",
    "collateral": "collateral_rewarded",
    "order": "order_sensitive",
    "spelling": "spelling_sensitive",
}
_WHOLE_MINUTE = re.compile(r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}):00$")


@dataclass(frozen=True)
class Audit:
    """Each case's outcome (`pass`, `fail` or `n/a`), the reward seen in each case that ran, and the first failure
    as a reason code with a detail (None: the scenario passed)."""

    outcomes: dict[str, str]
    rewards: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class _Run:
    final: dict[str, Any] | None  # None: a call failed (refused, raised) or the session broke
    paths: tuple[tuple[str, ...], ...] = ()  # the paths each call changed
    seen: str = ""  # what the calls returned (an answer's facts must be among it)


def audit_reward(
    sandbox: Sandbox, code: str, initial_state: dict[str, Any], checks: Sequence[str], gold: Sequence[Action],
    tools: Sequence[dict[str, Any]], *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED,
    contract: Contract = "strict", check: AnswerCheck = NOTHING_ASKED,
) -> Audit:  # fmt: skip
    """Run every case on one scenario (see the module docstring); `check` is its answer check
    (`builder.envs.answer.answer_check`)."""
    specs = checks_from_scenario(list(checks))
    facts = check.facts

    def reward(final: dict[str, Any], answer: str = "", seen: str = "") -> float:
        verdict = published_reward(sandbox, specs, initial_state, final, now=now, seed=seed, check=check,
                                   answer=answer, seen=seen)  # fmt: skip
        return verdict.reward

    def run(actions: Sequence[Action]) -> _Run:
        return _run(sandbox, code, initial_state, actions, now=now, seed=seed, contract=contract)

    outcomes, rewards = dict.fromkeys(CASES, "n/a"), {}
    rewards["nothing"] = reward(initial_state)
    outcomes["nothing"] = "pass" if rewards["nothing"] == 0 else "fail"
    if gold:
        done = run(gold)
        if done.final is None:
            outcomes["gold"], rewards["gold"] = "fail", 0.0
        else:
            answer = gold_answer(facts, declining=check.declines)
            rewards["gold"] = reward(done.final, answer, done.seen)
            outcomes["gold"] = "pass" if rewards["gold"] == 1 else "fail"
            allowed = sorted({path for paths in done.paths for path in paths})
            variants = itertools.chain(
                itertools.islice(
                    _collateral_variants(gold, done.paths, initial_state, allowed), MAX_COLLATERAL_TRIES // 2
                ),
                _other_tool_variants(gold, tools, initial_state),
            )
            damage = _first_run(run, variants, outside=(done, allowed))
            if damage is not None:
                rewards["collateral"] = reward(damage, answer, done.seen)
                outcomes["collateral"] = "pass" if rewards["collateral"] < 1 else "fail"
            spelled = _spelling_variant(gold, tools)
            for case, variant, said in (
                ("order", _order_variant(gold, done.paths, initial_state), answer),
                (
                    "spelling",
                    spelled if spelled or not facts else list(gold),
                    natural_answer(facts, declining=check.declines),
                ),
            ):
                final = _first_run(run, [variant] if variant is not None else [])
                if final is not None:  # the same final state and answer as the gold's get the gold's reward
                    same = final == done.final and said == answer
                    rewards[case] = rewards["gold"] if same else reward(final, said, done.seen)
                    outcomes[case] = "pass" if rewards[case] == 1 else "fail"
    failed = next((case for case in CASES if outcomes[case] == "fail"), None)
    if failed is None:
        return Audit(outcomes, rewards)
    detail = f"{failed}: reward {rewards.get(failed, 0.0):.3f} ({_EXPECTED[failed]})"
    return Audit(outcomes, rewards, FAILURES[failed], detail)


_EXPECTED = {
    "nothing": "an agent that makes no call must get 0: a check already holds on the initial state",
    "gold": "the gold sequence must get 1",
    "collateral": "the gold plus a write to a record the task does not touch must get less than 1",
    "order": "the gold with two independent calls swapped must still get 1",
    "spelling": "the gold with equivalent spellings of its values must still get 1",
}


def _run(
    sandbox: Sandbox, code: str, state: dict[str, Any], actions: Sequence[Action], *, now: str, seed: int,
    contract: Contract,
) -> _Run:  # fmt: skip
    try:
        with Session(sandbox, code, state, now=now, seed=seed, contract=contract) as session:
            before, paths, seen = session.snapshot(), [], []
            for action in actions:
                result = session.call(action.name, action.arguments)
                if not result.ok or result.refused:
                    return _Run(None)
                seen.append(result.content())
                after = session.snapshot()
                paths.append(tuple(changed_paths(before, after)))
                before = after
            return _Run(before, tuple(paths), "\n".join(seen))
    except SessionError:
        return _Run(None)


MAX_COLLATERAL_TRIES = 30  # variants tried before the case is n/a (each is a sandbox replay of the gold)


def _first_run(run: Any, variants: Any, *, outside: tuple[_Run, list[str]] | None = None) -> dict[str, Any] | None:
    """The final state of the first variant that runs (no call refused) and, with `outside`, changes a path the
    gold's allowed ones do not cover. None: none does."""
    for tries, variant in enumerate(variants):
        if tries >= MAX_COLLATERAL_TRIES:
            break
        ran = run(variant)
        if ran.final is None:
            continue  # the environment refused the variant
        if outside is None:
            return ran.final
        done, allowed = outside
        if any(not covered(path, allowed) for path in changed_paths(done.final, ran.final)):
            return ran.final
    return None


def _collateral_variants(
    gold: Sequence[Action], paths: Sequence[tuple[str, ...]], state: dict[str, Any], allowed: list[str]
) -> Any:
    """The gold plus one of its writes again on another record: an argument naming a record (a key of a
    collection of records) re-aimed at a record of the same collection that the gold never names; the last
    writes and the first such records first."""
    named = {str(value) for action in gold for value in action.arguments.values()}
    collections = {name: [str(key) for key, _ in pairs] for name, value in state.items()
                   if isinstance(value, dict) and (pairs := record_pairs(value))}  # fmt: skip
    writes = [action for action, changed in zip(gold, paths, strict=True) if changed]
    for action in reversed(writes):
        for parameter, value in action.arguments.items():
            for name, keys in collections.items():
                if str(value) not in keys:
                    continue
                for other in (key for key in keys if key not in named and not covered(f"{name}.{key}", allowed)):
                    yield [*gold, Action(name=action.name, arguments={**action.arguments, parameter: other})]


def _other_tool_variants(gold: Sequence[Action], tools: Sequence[dict[str, Any]], state: dict[str, Any]) -> Any:
    """The gold plus one call of each tool with arguments drawn from the records the gold never names (when
    re-aiming the gold's own writes is refused: a booked slot, a past date): any write outside the task is
    collateral, whichever tool makes it."""
    named = {str(value) for action in gold for value in action.arguments.values()}
    others = {
        name: {str(k): v for k, v in value.items() if str(k) not in named} if isinstance(value, dict) else value
        for name, value in state.items()
    }
    for tool in tools:
        function = tool["function"]
        yield [
            *gold,
            Action(name=function["name"], arguments=generate_arguments(function.get("parameters", {}), others)),
        ]


def _order_variant(
    gold: Sequence[Action], paths: Sequence[tuple[str, ...]], state: dict[str, Any]
) -> list[Action] | None:
    """The gold with the first pair of state-changing calls that name different records swapped (the calls
    between them stay where they are)."""
    keys = {str(key) for value in state.values() if isinstance(value, dict) for key, _ in record_pairs(value) or ()}

    def records(action: Action) -> set[str]:
        return {str(value) for value in action.arguments.values() if str(value) in keys}

    writes = [i for i, changed in enumerate(paths) if changed]
    for position, i in enumerate(writes):
        for j in writes[position + 1 :]:
            first, second = records(gold[i]), records(gold[j])
            if first and second and not first & second:
                swapped = list(gold)
                swapped[i], swapped[j] = gold[j], gold[i]
                return swapped
    return None


def _spelling_variant(gold: Sequence[Action], tools: Sequence[dict[str, Any]]) -> list[Action] | None:
    """The gold with every value that has an equivalent spelling respelled; None when none has."""
    nullable = {
        (tool["function"]["name"], name)
        for tool in tools
        for name, schema in tool["function"].get("parameters", {}).get("properties", {}).items()
        if _allows_null(schema)
    }
    changed, variant = False, []
    for action in gold:
        arguments = {}
        for name, value in action.arguments.items():
            respelled = _respelled(value, (action.name, name) in nullable)
            changed |= respelled is not value
            arguments[name] = respelled
        variant.append(Action(name=action.name, arguments=arguments))
    return variant if changed else None


def _respelled(value: Any, nullable: bool) -> Any:
    if isinstance(value, str) and (match := _WHOLE_MINUTE.match(value)):
        return match.group(1)
    if nullable and value == "":
        return None
    if nullable and value is None:
        return ""
    return value


def _allows_null(schema: dict[str, Any]) -> bool:
    if schema.get("nullable") is True:  # how the tool schemas spell `str | None` (builder.envs.signatures)
        return True
    kinds = schema.get("type")
    if kinds == "null" or isinstance(kinds, list) and "null" in kinds:
        return True
    return any(_allows_null(option) for option in schema.get("anyOf", []))
