"""scenarios: per accepted environment, verified scenarios (initial state, task, checklist, checks, gold actions).

For each of `scenarios.per_environment` slots the model writes, in turn, an initial state (structured output
constrained by the environment's state schema), a task with a user script and a checklist, one check function per
checklist item, and a gold action sequence. Nothing is trusted until the sandbox has shown it:

1. the state loads, reads back as JSON and every tool answers on it without crashing; every collection of
   records holds `min_records` records, `<entity>_id` fields point at existing records, and every attribute is
   one the class has;
2. every check lints clean and returns a real bool on the initial and the final state;
3. the gold sequence runs without a failing or refused call; what the task asks to be told (`answer_facts`) is in
   what its calls return and not in what the user says; every literal argument of it comes from what the
   user says in each mode (the task, or the user script), from an earlier call's result or from the tool schema
   (`sufficiency`); it has `min_gold_calls` calls, changes the state and gives the same final state
   when replayed. A gold argument may be a reference to an earlier call's result (`references`: the id of a
   record an earlier call creates); it is resolved as the gold runs, and the scenario stores the resolved calls;
4. not every check already passes on the initial state; every check passes after the gold sequence;
5. negative control: dropping any one state-changing gold call makes at least one check fail. Checks that never
   failed on any state tried are kept but reported as vacuous.

A failing piece is regenerated with the evidence fed back (`scenarios.repair_attempts` times for the state, and
as many rounds for task, checks and gold; a repair is the piece's request, the current piece and the feedback);
then the slot becomes a rejection with the reason code of the last failure. A verified scenario is emitted once per
mode in `scenarios.modes` (the runner upserts them into the store).

Each request is shown what it needs, not the whole module (`views`): the interface (class header and
tool schemas) and the state for the state, task and gold; the state schema, the records the gold names and the
source of the gold's state-changing methods for a check, which is written after the gold.

That is the `llm` method. `scenarios.method` picks it, the `graph` method (`graph_method`: a chain sampled along
the tool graph is the gold, the checks are derived from its diff, the model words only the user's request, under
the same gates) or both, the slots alternating llm, graph, llm, ... Each scenario records its method; the
stage's stats report both side by side (`method_stats`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from builder.envs.answer import answer_check
from builder.envs.audit import FAILURES, Audit, audit_reward
from builder.envs.lint import ContractError
from builder.envs.session import SessionError
from builder.errors import ItemError, OperatorError
from builder.limits import DETAIL_CHARS
from builder.records import Environment, Record, Rejection, Scenario
from builder.run.stage import Rejected, StageContext
from builder.stages.scenarios.emitted import reject_slot
from builder.stages.scenarios.families import slot_families
from builder.stages.scenarios.family_stats import report_families
from builder.stages.scenarios.graph_method import State, graph_chains, graph_scenario, start_states
from builder.stages.scenarios.llm_method import build_slot as _build
from builder.stages.scenarios.llm_method import seed_requests
from builder.stages.scenarios.method_stats import report_methods
from builder.stages.scenarios.variety import repeats
from builder.stages.scenarios.verbalise import Spent
from builder.stages.scenarios.verify import default_state
from builder.store import Store
from builder.usage import Usage, tally

logger = logging.getLogger(__name__)

# Every reason code this stage gives (stable: aggregated in stats and the dataset card; see docs/scenarios.md).
REASONS = (
    "not_accepted", "env_load_failed", "state_invalid", "state_load_failed", "state_too_small", "state_inconsistent",
    "task_invalid", "check_invalid", "gold_invalid", "check_broken", "gold_call_failed", "answer_not_read",
    "not_refused", "state_changed", "nothing_withheld", "doable_without_withheld", "copies_seed", "task_underspecified",
    "too_few_calls", "no_state_change", "gold_nondeterministic", "already_solved", "gold_fails_checks",
    "negative_control_failed", "duplicate", "llm_request", "prompt_too_long", "no_chain", "request_invalid",
    "request_leaks", *FAILURES.values(),
)  # fmt: skip
Made = list[Scenario] | Rejection  # what one slot makes
OnSlot = Callable[[int, str, Made], None]


async def scenarios(
    env: Environment, ctx: StageContext, *, start: State | None = None, on_slot: OnSlot | None = None
) -> list[Record]:
    """Verified scenarios of one environment (each in every configured mode) and one rejection per failed slot.

    `start` is a (state, now) every slot starts from (the state of `python -m builder scenarios`; it must load):
    the llm method then writes no state and the graph method samples from it alone. `on_slot(slot, method, made)` is
    told of each slot as it ends (progress).

    Rejects the whole environment with `not_accepted` (its status is not "accepted") or `env_load_failed` (its
    default state does not load). Slot rejections have subject `<env id>/scenario-<slot>` and these reasons:
    state_invalid, state_load_failed, state_too_small, state_inconsistent, task_invalid, check_invalid,
    gold_invalid, check_broken, gold_call_failed, answer_not_read, not_refused, state_changed, nothing_withheld,
    copies_seed, task_underspecified, too_few_calls, no_state_change,
    gold_nondeterministic, already_solved, gold_fails_checks, negative_control_failed, duplicate, llm_request,
    prompt_too_long; for the graph method also no_chain (fewer verified chains than slots), request_invalid
    and request_leaks (`verbalise`); the reward audit's (`builder.envs.audit`, run on every verified slot with
    the collateral guard appended to its checks): reward_for_nothing, gold_not_rewarded, collateral_rewarded,
    order_sensitive, spelling_sensitive; and `exception:<Type>` for a slot that hit an unexpected error, logged
    with its traceback.

    Counts in `ctx.stats.report` (`builder.reports.ScenariosReport`) `verified_slots` (a slot is emitted once per
    mode, so `per_kept` is per record)
    and the figures per method; `method_stats.derive_report` (the stage's `derive`) adds the costs per verified
    slot from them.
    """
    if env.status != "accepted":
        raise Rejected(ctx.reject(env, "not_accepted", f"status is {env.status!r}; only accepted environments"))
    try:
        example = await asyncio.to_thread(default_state, ctx.sandbox, env.code, env.contract)
    except (SessionError, ContractError) as error:
        raise Rejected(ctx.reject(env, "env_load_failed", str(error)[:DETAIL_CHARS])) from None
    kinds = slot_families(ctx.config.scenarios.per_environment, ctx.config.scenarios.families)
    methods = slot_methods(ctx.config.scenarios.method, kinds)
    llm_slots = [slot for slot, method in enumerate(methods) if method == "llm"]
    graph_slots = [slot for slot, method in enumerate(methods) if method == "graph"]
    spent = {slot: Spent() for slot in graph_slots}
    families = {slot: kinds[slot] for slot in llm_slots}  # the graph method writes plain tasks only
    costs: dict[int, Usage] = {}
    seeds = seed_requests(ctx, env)

    async def llm(slot: int) -> Made:
        family = families.get(slot, "plain")  # a graph slot the llm method makes (fallback) is plain
        build = functools.partial(_build, env, ctx, slot, example, start, family, seeds)
        with tally() as counted:
            made = await _slot(env, ctx, slot, "llm", build, on_slot)
        costs[slot] = counted.usage
        return made

    fell_back: list[int] = []  # graph slots with no chain that the llm method made instead (method both)

    async def graph() -> tuple[list[Made], Counter[str]]:
        if not graph_slots:
            return [], Counter()
        states = [start] if start is not None else start_states(env, example)
        found, dropped = await graph_chains(env, ctx, len(graph_slots), states)

        async def one(index: int, slot: int) -> Made:
            if index < len(found):
                chain = found[index]
                return await _slot(env, ctx, slot, "graph", lambda: graph_scenario(env, ctx, chain, spent[slot]),
                                   on_slot)  # fmt: skip
            if ctx.config.scenarios.method == "both":
                fell_back.append(slot)  # no chain: the llm method makes this slot
                return await llm(slot)
            detail = (
                f"{len(found)} verified chains for {len(graph_slots)} slots from {len(states)} start states "
                f"(dropped: {json.dumps(dict(sorted(dropped.items())))})"
            )
            rejection = reject_slot(ctx, env, slot, "no_chain", detail)
            if on_slot is not None:
                on_slot(slot, "graph", rejection)
            return rejection

        return list(await asyncio.gather(*(one(i, slot) for i, slot in enumerate(graph_slots)))), dropped

    llm_made, (graph_made, dropped) = await asyncio.gather(asyncio.gather(*map(llm, llm_slots)), graph())
    made = dict(zip(llm_slots, llm_made, strict=True)) | dict(zip(graph_slots, graph_made, strict=True))
    results: list[Record] = []
    outcomes: list[tuple[str, Made]] = []
    seen: set[str] = set()
    near = await _near_duplicates(ctx, env, made)
    for slot in range(len(methods)):
        result = made[slot]
        if not isinstance(result, Rejection) and result[0].id in seen:
            result = reject_slot(ctx, env, slot, "duplicate", "the same state and task as an earlier slot")
        elif slot in near:
            result = reject_slot(ctx, env, slot, "duplicate", near[slot])
        elif not isinstance(result, Rejection):
            seen.add(result[0].id)
        outcomes.append((methods[slot], result))
        results += [result] if isinstance(result, Rejection) else result
    kept = [record for record in results if isinstance(record, Scenario)]
    _count_verified(ctx, len(kept) // max(1, len(ctx.config.scenarios.modes)))
    graph_usage = sum((s.usage for s in spent.values()), Usage())
    report_methods(ctx, env, outcomes, graph_usage, dropped, fell_back=[outcomes[slot][1] for slot in fell_back])
    costs |= {slot: spent[slot].usage for slot in graph_slots if slot not in fell_back}
    report_families(ctx, [(families.get(slot, "plain"), result, costs[slot]) for slot, (_, result) in
                          enumerate(outcomes)])  # fmt: skip
    return results


async def _near_duplicates(ctx: StageContext, env: Environment, made: dict[int, Made]) -> dict[int, str]:
    """The slots whose task near-duplicates an earlier slot's task or a task the store holds for an environment of
    this name (earlier runs; docs/scenarios.md §11), each with why. A stored scenario with the id of one made now
    is the same record (a resumed run), not an earlier one."""
    kept = {slot: result for slot, result in made.items() if not isinstance(result, Rejection)}
    made_ids = {scenario.id for result in kept.values() for scenario in result}
    store = Store(ctx.config.store.path, ctx.config.store.lock_timeout_s)
    stored = await asyncio.to_thread(store.scenario_tasks, env.name)
    earlier = list(dict.fromkeys(task for id_, task in stored.items() if id_ not in made_ids))  # one per mode pair
    slots, tasks = list(kept), [result[0].task for result in kept.values()]
    found: dict[int, str] = {}
    for repeat in repeats(tasks, earlier=earlier):
        if repeat.kind == "near_duplicate":
            what = (
                f"an earlier run's task {earlier[-repeat.earlier - 1]!r}" if repeat.earlier < 0
                else f"slot {slots[repeat.earlier]}'s task"
            )  # fmt: skip
            found[slots[repeat.index]] = (
                f"a near-duplicate (similarity {repeat.similarity}) of {what} (docs/scenarios.md §11): "
                f"{tasks[repeat.index]}"
            )
    outcomes: dict[tuple[str, str], int] = {}  # the same change to the same state is the same task, however worded
    for position, (slot, result) in enumerate(kept.items()):
        changes = result[0].verification.gold_state_changes
        key = (json.dumps(result[0].initial_state, sort_keys=True), json.dumps(changes, sort_keys=True))
        if changes and key in outcomes and slot not in found:
            found[slot] = f"the same state change on the same initial state as slot {outcomes[key]}: {tasks[position]}"
        outcomes.setdefault(key, slot)
    return found


def slot_methods(method: str, families: Sequence[str]) -> list[str]:
    """The method of each slot, given its family (`slot_families`): all one method; for `both` the plain slots
    alternate llm, graph, llm, ... and the other families, which only the llm method writes, are llm (so `both`
    keeps the whole family mix)."""
    if method != "both":
        return [method] * len(families)
    plain = [slot for slot, family in enumerate(families) if family == "plain"]
    graph = set(plain[1::2])
    return ["graph" if slot in graph else "llm" for slot in range(len(families))]


def _count_verified(ctx: StageContext, verified: int) -> None:
    ctx.stats.report.verified_slots += verified


async def _slot(
    env: Environment, ctx: StageContext, slot: int, method: str, build: Callable[[], Awaitable[list[Scenario]]],
    on_slot: OnSlot | None,
) -> Made:  # fmt: skip
    made = await _made(env, ctx, slot, build)
    if on_slot is not None:
        on_slot(slot, method, made)
    return made


async def _made(env: Environment, ctx: StageContext, slot: int, build: Callable[[], Awaitable[list[Scenario]]]) -> Made:
    try:
        made = await build()
        # The modes of a slot share state, checks and gold, except where a family grades them apart (missing_info).
        variants = {(s.checks, s.answer_facts, len(s.gold_actions)): s for s in made}
        for scenario in variants.values():
            audit = await asyncio.to_thread(_audit, ctx, env, scenario)
            if audit.reason is not None:
                raw = json.dumps({"mode": scenario.mode, "outcomes": audit.outcomes, "rewards": audit.rewards})
                return reject_slot(ctx, env, slot, audit.reason, f"{scenario.mode}: {audit.detail}", raw)
        return made
    except Rejected as verdict:
        rejection = verdict.rejection
        if rejection.subject_id == env.id:  # from `ask`: give it this slot's subject, so slots do not collide
            return reject_slot(ctx, env, slot, rejection.reason, rejection.detail, rejection.raw_output)
        return rejection
    except (asyncio.CancelledError, OperatorError):
        raise  # an interrupt or an operator error (an unreachable server) stops the run; it is not this slot's
    except ItemError as error:  # a failed request or session: this slot's, the other slots go on
        return reject_slot(ctx, env, slot, error.reason, str(error)[:DETAIL_CHARS])
    except Exception as error:  # noqa: BLE001 - like the runner: one bad slot must not cost the others
        logger.error("scenarios: %s slot %d failed:\n%s", env.id, slot, traceback.format_exc())
        return reject_slot(ctx, env, slot, f"exception:{type(error).__name__}", str(error))


def _audit(ctx: StageContext, env: Environment, scenario: Scenario) -> Audit:
    """The reward audit of one of a slot's scenarios, counted in the report."""
    audit = audit_reward(
        ctx.sandbox, env.code, scenario.initial_state, scenario.checks, scenario.gold_actions, env.tools,
        now=scenario.now, seed=scenario.seed, contract=env.contract, check=answer_check(scenario),
    )  # fmt: skip
    ctx.stats.report.count_audit(audit.outcomes)
    return audit
