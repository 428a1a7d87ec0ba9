"""The graph method: scenarios whose gold is a tool chain sampled along the environment's dependency graph, whose
checks are derived from the chain's state diff, and of which the model writes only what the user says.

Chains start from the states an accepted environment already has (no model call): its default state (what
`__init__` builds) when that holds any data, then the test states the evaluate stage wrote and ran; the
standalone command starts from the state it is given. The graph is taken once, from the first state that
loads: the one evaluate stored (`Environment.graph`) when that state is evaluate's first test state at its `now`,
else extracted from it. Each state gets an equal share of the chains (plus one spare), each chain is verified
with its derived checks by the same gates as any scenario (negative control included), and the verified ones are
taken in turn from each state, so the slots see different states.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from builder.envs.answer import is_number, states
from builder.envs.graph import ToolGraph, extract_graph
from builder.envs.lint import ContractError
from builder.envs.session import SessionError
from builder.envs.signatures import tool_defaults
from builder.json_values import leaves
from builder.prompts import prompt_version
from builder.records import Environment, Scenario, scenario_seed
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW
from builder.stages.scenarios.chain import Chain
from builder.stages.scenarios.chains import sample_chains
from builder.stages.scenarios.derived_checks import CheckItem, derive_items, verify_chain
from builder.stages.scenarios.emitted import Words, difficulty, scenario_records
from builder.stages.scenarios.requests import _sampling
from builder.stages.scenarios.template import VERSION as TEMPLATE_VERSION
from builder.stages.scenarios.template import template_request
from builder.stages.scenarios.verbalise import (
    PROMPT,
    Spent,
    UserRequest,
    created_values,
    refusal,
    user_texts,
    verbalise,
)
from builder.stages.scenarios.verify import Evidence

MAX_CALLS = 8  # the longest chain sampled (the bound)
REFUSALS = ("request_invalid", "request_leaks", "task_underspecified")  # a model's replies refused, not failed

State = tuple[dict[str, Any], str]  # a state and the scenario's `now` on it


@dataclass(frozen=True)
class Found:
    """A chain that passed every gate with its derived checks, and where it started."""

    chain: Chain
    now: str
    items: tuple[CheckItem, ...]
    checks: tuple[str, ...]
    evidence: Evidence


def start_states(env: Environment, default: dict[str, Any]) -> list[State]:
    """The states chains start from: the default state if it holds any value, then evaluate's test states."""
    states = [(default, DEFAULT_NOW)] if any(True for _ in leaves(default)) else []
    if env.evaluation is not None:
        states += [(test.state, test.now) for test in env.evaluation.test_states]
    return states


def find_chains(
    sandbox: Sandbox, env: Environment, states: Sequence[State], count: int, min_calls: int
) -> tuple[list[Found], Counter[str]]:
    """Up to `count` verified chains from `states` (blocking: run it in a thread) and why attempts were dropped
    (the sampler's reasons, the verifier's, and `state_load_failed` for a state that does not load)."""
    dropped: Counter[str] = Counter()
    if not states or count < 1:
        return [], dropped
    graph = None
    for state, now in states:
        try:
            graph = start_graph(sandbox, env, state, now)
            break
        except (SessionError, ContractError):
            continue
    if graph is None:
        dropped["state_load_failed"] += len(states)
        return [], dropped
    share = math.ceil(count / len(states)) + 1
    per_state: list[list[Found]] = []
    for state, now in states:
        seed = scenario_seed(env.id, now)
        try:
            sampled = sample_chains(sandbox, env.code, graph, state, share, seed=seed, min_calls=min_calls,
                                    max_calls=MAX_CALLS, now=now, env_seed=seed, contract=env.contract)  # fmt: skip
        except SessionError:
            dropped["state_load_failed"] += 1
            continue
        dropped.update(sampled.dropped)
        kept = []
        for chain in sampled.chains:
            checks, evidence = verify_chain(sandbox, env.code, chain, now=now, seed=seed, contract=env.contract)
            if evidence.reason is not None:
                dropped[evidence.reason] += 1
                continue
            items = tuple(derive_items(chain.initial_state, chain.final_state))
            kept.append(Found(chain=chain, now=now, items=items, checks=tuple(checks), evidence=evidence))
        per_state.append(kept)
    taken = [kept[turn] for turn in range(share) for kept in per_state if turn < len(kept)]
    return taken[:count], dropped


def start_graph(sandbox: Sandbox, env: Environment, state: dict[str, Any], now: str) -> ToolGraph:
    """The tool graph from `state` at `now`: `env.graph` when evaluate extracted it from that state (its first test
    state, at that state's `now`), else extracted here. Raises what `extract_graph` raises."""
    first = env.evaluation.test_states[0] if env.evaluation is not None and env.evaluation.test_states else None
    if env.graph is not None and first is not None and (first.state, first.now) == (state, now):
        # Evaluate extracted it at the default seed, not the scenario's: the seed reaches only values a tool draws
        # at random (a new uuid4 id), which a consumer probed from the initial state refuses under any seed.
        return env.graph
    return extract_graph(sandbox, env.code, state, now=now, seed=scenario_seed(env.id, now), contract=env.contract)


async def graph_chains(
    env: Environment, ctx: StageContext, count: int, states: Sequence[State]
) -> tuple[list[Found], Counter[str]]:
    """`find_chains` in a thread, with at least `scenarios.min_gold_calls` calls per chain (at most 8)."""
    min_calls = min(ctx.config.scenarios.min_gold_calls, MAX_CALLS)
    return await asyncio.to_thread(find_chains, ctx.sandbox, env, states, count, min_calls)


async def graph_scenario(env: Environment, ctx: StageContext, found: Found, spent: Spent) -> list[Scenario]:
    """The scenario of a verified chain in every mode, once worded as `scenarios.wording` says: by the model
    (`verbalise`), by the template (`template`, no model call), or by the template once every model reply was
    refused. `spent` is this slot's own (its refusals are the scenario's repairs).

    Raises:
        Rejected: no usable wording (see `verbalise`; the template's words failing a gate: request_leaks or
            task_underspecified).
    """
    wording = ctx.config.scenarios.wording
    request = None
    if wording != "template":
        try:
            request = await verbalise(env, ctx, found.chain, found.items, found.now, spent)
        except Rejected as verdict:
            if wording == "model" or verdict.rejection.reason not in REFUSALS:
                raise
    if request is None:
        request = _templated(env, ctx, found)
        provenance = ctx.provenance([env], prompt_version=TEMPLATE_VERSION)
    else:
        provenance = ctx.provenance(
            [env], model=ctx.llm.model_id, sampling=_sampling(ctx), prompt_version=prompt_version(PROMPT)
        )
    facts = answer_facts(found.chain.facts, user_texts(request, ctx.config.scenarios.modes))
    words = Words(
        task=request.task, user_profile=request.user_profile, known_up_front=request.known_up_front,
        reveal_when_asked=request.reveal_when_asked, ending=request.ending, difficulty=request.difficulty,
    )  # fmt: skip
    return scenario_records(
        env, ctx, method="graph", provenance=provenance, state=found.chain.initial_state, now=found.now,
        words=words, checklist=[item.describe() for item in found.items], checks=found.checks,
        gold=found.chain.actions, evidence=found.evidence, state_repairs=0, repairs=spent.refused,
        wording="model" if provenance.model is not None else "template", answer_facts=facts,
    )  # fmt: skip


def answer_facts(facts: Sequence[str], texts: dict[str, str]) -> tuple[str, ...]:
    """The chain's answer facts the user's words do not state (a number excepted, as `verify.answer_problems`
    rules): stating what the user said proves no read."""
    return tuple(f for f in facts if is_number(f) or not any(states(text, f) for text in texts.values()))


def _templated(env: Environment, ctx: StageContext, found: Found) -> UserRequest:
    """The template's words for the chain, through the model's gates (a failing gate rejects the slot)."""
    chain, now = found.chain, found.now
    created = created_values(chain, now)
    request = template_request(env, chain, created, difficulty(found.evidence))
    names = [tool["function"]["name"] for tool in env.tools]
    refused = refusal(request, created, names, chain, ctx.config.scenarios.modes, env.tools, now,
                      tool_defaults(env.code))  # fmt: skip
    if refused is not None:
        reason, problems = refused
        raise Rejected(ctx.reject(env, reason, "the template's words: " + "; ".join(problems), request.task))
    return request
