"""A verified slot as the records the scenarios stage emits: one `Scenario` per configured mode, whichever method
made it, with its `Verification` built from the verifier's evidence and, as its last check, the collateral guard
derived from what the gold changed (`builder.envs.guard`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from builder.envs.guard import GUARD_ITEM, allowed_paths, blank_fields, guard_source
from builder.envs.session import diff_states
from builder.evidence import Verification
from builder.limits import DETAIL_CHARS
from builder.records import Action, Environment, Provenance, Rejection, Scenario, UserScript
from builder.run.stage import StageContext
from builder.stages.scenarios.verify import Evidence

Difficulty = Literal["easy", "medium", "hard"]


@dataclass(frozen=True)
class Declined:
    """How a family's non-conversational row is graded when it must change nothing (missing_info, policy_trap:
    `family_gates.one_shot_decline`): the facts its answer must state, and its gold (the look-ups that read
    them; none for missing_info)."""

    facts: tuple[str, ...]
    gold: tuple[Action, ...] = ()


@dataclass(frozen=True)
class Words:
    """What the user says (the model's part of a scenario, under either method, or the graph method's template)
    and its difficulty rating."""

    task: str
    user_profile: str
    known_up_front: str
    reveal_when_asked: str
    ending: str
    difficulty: Difficulty


def difficulty(evidence: Evidence) -> Difficulty:
    """From the verified gold sequence, not the model's opinion: calls and state changes it needs."""
    calls, changes = len(evidence.gold), len(evidence.state_changing_calls)
    if changes >= 3 or calls >= 7:
        return "hard"
    if changes >= 2 or calls >= 4:
        return "medium"
    return "easy"


def scenario_records(
    env: Environment,
    ctx: StageContext,
    *,
    method: Literal["llm", "graph"],
    provenance: Provenance,
    state: dict[str, Any],
    now: str,
    words: Words,
    checklist: Sequence[str],
    checks: Sequence[str],
    gold: Sequence[Action],
    evidence: Evidence,
    state_repairs: int,
    repairs: Sequence[str],
    wording: Literal["model", "template"] = "model",
    answer_facts: Sequence[str] = (),
    family: str = "plain",
    declined: Declined | None = None,
) -> list[Scenario]:
    """The slot's scenario in every mode of `scenarios.modes` (they share a `scenario_group`). A missing_info or
    policy_trap slot's non-conversational scenario is graded apart (`declined`): the request lacks a value, or
    asks for a forbidden thing with no alternative, so nothing may change (its guard allows no path), and the
    answer must state `declined.facts` (what is missing; why it is forbidden); its gold is `declined.gold`."""
    task = " ".join(words.task.split())
    final = evidence.final_state or state
    guard = guard_source(allowed_paths(state, final), blank_fields(state, final))
    nothing = guard_source([])
    group = hashlib.sha256(json.dumps([env.id, state, task], sort_keys=True).encode()).hexdigest()[:16]
    verification = Verification(
        scenario_group=group,
        gold=evidence.gold,
        state_changing_calls=evidence.state_changing_calls,
        gold_state_changes=tuple(diff_states(state, evidence.final_state)[:200]),
        checks_on_initial=(*evidence.checks_on_initial, True),  # the guard holds on both, by construction
        checks_on_final=(*evidence.checks_on_final, True),
        negative_control=evidence.negative_control,
        vacuous_checks=evidence.vacuous_checks,
        model_difficulty=words.difficulty,
        state_repairs=state_repairs,
        repairs=tuple(repairs),
    )
    user = UserScript(
        profile=words.user_profile,
        known_up_front=words.known_up_front,
        reveal_when_asked=words.reveal_when_asked,
        ending=words.ending,
    )
    def graded(mode: str) -> dict[str, Any]:
        if declined is not None and mode == "non_conversational":
            return {"checklist": (GUARD_ITEM,), "checks": (nothing,), "answer_facts": declined.facts,
                    "gold_actions": declined.gold}  # fmt: skip
        return {
            "checklist": (*checklist, GUARD_ITEM), "checks": (*checks, guard), "answer_facts": tuple(answer_facts),
            "gold_actions": tuple(gold),
        }  # fmt: skip

    return [
        Scenario(
            provenance=provenance,
            env_id=env.id,
            mode=mode,
            method=method,
            wording=wording,
            family=family,
            initial_state=state,
            now=now,
            task=task,
            user=user if mode == "conversational" else None,
            difficulty=difficulty(evidence),
            verification=verification,
            **graded(mode),
        )
        for mode in ctx.config.scenarios.modes
    ]


def reject_slot(
    ctx: StageContext, env: Environment, slot: int, reason: str, detail: str, raw_output: str | None = None
) -> Rejection:
    """A failed slot as the stage's rejection, subject `<env id>/scenario-<slot>` (slots do not collide)."""
    return Rejection(
        provenance=ctx.provenance([env]),
        stage=ctx.stage,
        subject_id=f"{env.id}/scenario-{slot}",
        reason=reason,
        detail=detail[:DETAIL_CHARS],
        raw_output=raw_output,
    )
