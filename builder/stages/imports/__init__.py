"""import: environments and scenarios written elsewhere, re-verified in the sandbox like builder's own.

Three stages, run by the executor over a run folder like any other (so the tables, journals, store upserts,
resume and stats are the pipeline's own), followed by the pipeline's `rollout` and `select`:

1. `import` (source stage): every environment of the source as a candidate `Environment` whose provenance names
   the source, its revision, the environment's id there and the split it gave it (`Provenance.origin`); the
   code is adapted to the runtime's conventions in visible source (`adapt`). Rows that cannot be read are
   rejected (`bad_row`, `bad_state_file`).
2. `vet`: the deterministic gates of the evaluate stage under the `import` contract (lint problems are
   information, the sandbox is the boundary): load, every tool called with schema-valid arguments on the
   source's first initial state (or the default state), twice in fresh workers (determinism), JSON state.
   Rejection: `gates_failed` (the problems in the raw output). A private attribute that is not JSON (BFCL's
   `self._random`) is left out of the state, not a failure: listed in the stats report and the audit. With
   `dual_agent`, an environment that passes then goes through the evaluate stage's dual-agent check as well.
   The pipeline passes the evaluate and scenarios stage functions in (`evaluate`, `generate`): no stage imports
   another.
3. `verify`: each imported scenario re-verified (`verify`): rejected as `no_checks`, `check_invalid`,
   `state_load_failed`, `already_solved` or `duplicate`, else kept with `unverified_solvability` (no gold exists).
   The reward audit (`builder.envs.audit`) runs on each kept one too; without a gold only its `nothing` case
   applies (`reward_for_nothing`), and without a gold there is no collateral guard. An
   environment that brought no scenarios (or all of them with `more_scenarios`) also gets scenarios from the
   pipeline's scenarios stage (the model writes them, with gold solutions).

Rollout and select find these stages' records by type (`ItemStage.needs`), as after a synthesis run.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence

from builder.envs.audit import audit_reward
from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source
from builder.envs.state_schema import infer_schema
from builder.limits import DETAIL_CHARS
from builder.records import Environment, Record, Rejection, Scenario, scenario_seed
from builder.run.stage import Rejected, StageContext
from builder.sandbox.world import DEFAULT_NOW
from builder.stages.imports.adapt import adapted_code
from builder.stages.imports.sources import Source, SourceEnv
from builder.stages.imports.verify import check_scenario, imported_scenario_fields

IMPORT_STAGE, VET_STAGE, VERIFY_STAGE = "import", "vet", "verify"  # the run folder's tables of an import
StageFn = Callable[[Environment, StageContext], Awaitable[list[Record]]]
EvaluateFn = Callable[..., Awaitable[list[Record]]]  # `builder.stages.evaluate.evaluate`


async def import_source(inputs: Sequence[Record], ctx: StageContext, *, source: Source) -> list[Record]:
    """The source's environments as candidates, and a rejection per row that could not be read."""
    del inputs  # a source stage
    results: list[Record] = []
    for skipped in source.skipped:
        results.append(ctx.reject(f"{source.kind}:{skipped.ref}", skipped.reason, skipped.detail))
    for item in source.envs:
        results.append(candidate(item, source, ctx))
    return results


def candidate(item: SourceEnv, source: Source, ctx: StageContext) -> Environment:
    """The candidate `Environment` of one source environment (its tools derived from the code, if it parses)."""
    code = adapted_code(item.code, item.class_name, item.default_state)
    try:
        interface = inspect_source(code, "import")
        class_name, tools = interface.class_name, interface.tools
    except ContractError:  # it does not parse or has no tools: the gates reject it with the reason
        class_name, tools = item.class_name, ()
    example = item.scenarios[0].initial_state if item.scenarios else (item.default_state or {})
    provenance = ctx.provenance().model_copy(update={"origin": source.origin(item.ref, item.split)})
    return Environment(
        provenance=provenance, plan_id="", name=item.name, class_name=class_name, description=item.description,
        domain=item.domain, code=code, tools=tools,
        state_schema={"type": "object", "properties": {key: infer_schema(value) for key, value in example.items()}},
    )  # fmt: skip


async def vet(
    env: Environment, ctx: StageContext, *, source: Source, dual_agent: bool, evaluate: EvaluateFn
) -> list[Record]:
    """The environment accepted by the evaluate stage's gates under the import contract, its tools probed on the
    source's first initial state (and by the dual-agent check with `dual_agent`). `evaluate` is that stage's
    function, which the pipeline passes in."""
    item = source.env(env.provenance.origin.ref) if env.provenance.origin else None
    state = item.scenarios[0].initial_state if item is not None and item.scenarios else None
    return await evaluate(env, ctx, "import", gate_state=state, judge=dual_agent)


async def imported_scenarios(
    env: Environment, ctx: StageContext, *, source: Source, more_scenarios: bool, generate: StageFn
) -> list[Record]:
    """The environment's imported scenarios, re-verified, plus generated ones when it brought none (or with
    `more_scenarios`)."""
    origin = env.provenance.origin
    item = source.env(origin.ref) if origin is not None else None
    results: list[Record] = []
    if item is not None and item.scenarios:
        interface = inspect_source(env.code, "import")
        seed = scenario_seed(env.id, DEFAULT_NOW)  # the seed rollouts of these scenarios will use
        for scenario in item.scenarios:
            subject = f"{env.id}/{scenario.ref}"
            found = await asyncio.to_thread(
                check_scenario, ctx.sandbox, env.code, interface, scenario, now=DEFAULT_NOW, seed=seed
            )
            if found.reason is not None:
                results.append(ctx.reject(subject, found.reason, found.detail[:DETAIL_CHARS], raw_output=found.facts()))
                continue
            provenance = ctx.provenance([env]).model_copy(update={"origin": source.origin(scenario.ref, origin.split)})
            fields = imported_scenario_fields(found, scenario, env.id, DEFAULT_NOW)
            made = Scenario(provenance=provenance, **fields)
            audit = await asyncio.to_thread(
                audit_reward, ctx.sandbox, env.code, made.initial_state, made.checks, made.gold_actions, env.tools,
                now=made.now, seed=made.seed, contract="import",
            )  # fmt: skip
            ctx.stats.report.count_audit(audit.outcomes)
            if audit.reason is not None:
                results.append(ctx.reject(subject, audit.reason, audit.detail))
                continue
            if made.id in {record.id for record in results}:
                results.append(ctx.reject(subject, "duplicate", "the same state and task as an earlier scenario"))
            else:
                results.append(made)
    if more_scenarios or item is None or not item.scenarios:
        try:
            results += await generate(env, ctx)
        except Rejected as verdict:
            if not results:
                raise
            results.append(verdict.rejection)
    return results


def rejection_facts(rejection: Rejection) -> dict:
    """The JSON a rejection of these stages keeps in its raw output ({} if none)."""
    try:
        return json.loads(rejection.raw_output or "{}")
    except json.JSONDecodeError:
        return {}
