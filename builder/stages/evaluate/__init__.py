"""evaluate: accept or reject each candidate environment, first by deterministic gates, then by the dual-agent check.

1. Gates (`builder env check`): lint, load, every tool called with schema-valid arguments, twice in fresh
   workers (determinism), JSON state, no crash or hang; plus the stored tool schemas must be the code's. A tool
   that fails its probe is repaired through the code stage, at most `evaluate.fuzz_repairs` times
   (`gates`); a repaired environment is a new record (new code, new id, `synthesis.repairs`).
2. Test states: `evaluate.test_states` initial states as structured output, each validated against the state
   schema, its references checked (an empty value is no reference) and loaded in a sandbox session (failures
   fed back, bounded).
3. Rule probes and consistency gates (`probes.py`, `evaluate.probes`): a call per numbered rule that must be
   refused on a test state, each run in a fresh session; an unrefused one the checker confirms, or records written
   inconsistently (`None` next to `""` for one field, new ids unlike the seeded ones), go back to the code stage,
   at most `evaluate.probe_repairs` times.
4. Dual-agent check: for each test state its own session; the harness schedules which tool to test and whether with
   a positive or a negative case (the tools in turn, cases alternating so half the judged calls are negative; a
   tool no argument of which can be wrong gets positive cases only), the tester agent fills `calls_per_request`
   numbered slots at once (structured output: a tool and its arguments per slot), the calls run in turn in the
   session, and one checker request rules pass / warning / fail per call from the rules, each method's source,
   the arguments, the result and the state before, after and diffed. States run their batches in rounds; after
   each round the sequential rule (`sequential.py`) may settle the verdict before N calls are judged. Calls that
   crash, hang or return non-JSON are failures without asking the checker. Unknown tools and arguments off the
   schema are the tester's error: not counted, bounded by `max_invalid_replies` per state. States in prompts are
   whole records (`state_text`); a prompt too long for the model's context is retried with fewer records.
5. Score = (pass + warning) / judged calls over `evaluate.calls` calls (fewer when settled early); accepted at
   `keep_score` or above and upserted into the store by the runner; the per-call verdicts are the evidence
   (`Environment.evaluation`).
6. An accepted environment gets its tool dependency graph (`Environment.graph`, `builder.envs.graph`), extracted
   from its first test state: here the sandbox is open and the state is one the check just exercised, so the
   graph is computed once per environment, export publishes it as stored and the scenarios stage's graph method
   starts from it when its chains start from that state.

Rejection reasons: gates_failed, no_valid_test_state, rule_not_enforced, inconsistent_state, tester_invalid,
checker_invalid, low_score, llm_request, prompt_too_long, session_failed.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable
from typing import Any

from builder import __version__
from builder.envs.graph import ToolGraph, extract_graph
from builder.envs.lint import Contract, ContractError
from builder.envs.schema import EnvInterface
from builder.envs.session import Session, SessionError
from builder.envs.state_schema import generated_state_schema, reference_problems
from builder.evidence import (
    Evaluation,
    EvaluationCounts,
    EvaluationProvenance,
    EvaluationState,
    FailedTestState,
    UnusableReply,
)
from builder.limits import DETAIL_CHARS
from builder.llm import LLMRequestError, PromptTooLongError
from builder.prompts import prompt_version
from builder.records import Environment, Record
from builder.run.stage import Rejected, StageContext
from builder.sandbox.world import DEFAULT_NOW
from builder.stages._llm import shrinking
from builder.stages._repair import RepairTools
from builder.stages.evaluate.agents import Agents, InvalidReply
from builder.stages.evaluate.exercise import (
    StateRun,
    TestState,
    _all,
    exercise_all,
)
from builder.stages.evaluate.facts import shows_whole_source
from builder.stages.evaluate.gates import passing_gates
from builder.stages.evaluate.probes import enforce_rules
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import class_header
from builder.views.state import state_output_type

logger = logging.getLogger(__name__)

PROMPTS = ("evaluate_state", "evaluate_tester", "evaluate_checker", "evaluate_probe", "evaluate_roles")


async def evaluate(
    env: Environment, ctx: StageContext, contract: Contract = "strict", *, repair: RepairTools | None = None,
    gate_state: dict[str, Any] | None = None, judge: bool = True,
) -> list[Record]:  # fmt: skip
    """The environment accepted (with scores and evidence; the runner upserts it into the store) or a rejection.

    `contract`: the trust level its code is read under (envs/lint.py; imported environments: "import").
    `repair`: how a tool that fails the gates is repaired (the pipeline passes the code stage's; None: it is
    rejected). `gate_state`: the state the gates probe the tools on (None: the default state). `judge=False`
    accepts on the gates alone (an import without the dual-agent check).
    """
    candidate = env
    env, interface, default_state = await passing_gates(env, ctx, contract, repair, gate_state)
    if not judge:
        return [env.model_copy(update={"status": "accepted"})]
    agents = Agents(
        ctx.llm, ctx.config.evaluate, retries=ctx.config.llm.structured_retries, seed=ctx.config.run.seed,
        affinity=env.id,
    )  # fmt: skip
    try:
        states, failures = await make_test_states(env, interface, default_state, ctx, agents)
        if not states:
            detail = "; ".join(f"state {i + 1}: {f.detail}" for i, f in failures)[:DETAIL_CHARS]
            raise Rejected(ctx.reject(env, "no_valid_test_state", detail, raw_output=failures[-1][1].raw))
        env, interface, probing = await enforce_rules(
            env, interface, default_state, states, ctx, agents, contract=contract, repair=repair,
            gate_state=gate_state, subject=candidate,
        )  # fmt: skip
        runs = await exercise_all(env, interface, states, ctx, agents)
    except PromptTooLongError as error:
        raise Rejected(ctx.reject(env, "prompt_too_long", str(error)[:DETAIL_CHARS])) from None
    except LLMRequestError as error:  # also after every retry (the status is in the message)
        raise Rejected(ctx.reject(env, "llm_request", str(error)[:DETAIL_CHARS])) from None
    except SessionError as error:  # a session broke beyond replay (its state could no longer be read or restored)
        raise Rejected(ctx.reject(env, "session_failed", f"{error.kind}: {error}"[:DETAIL_CHARS])) from None
    evidence = summarize(env, interface, states, failures, runs, ctx, agents).model_copy(update={"probes": probing})
    counts = evidence.counts
    logger.info(
        "evaluate: %s (%s) scored %.2f over %d judged calls, %d unusable replies, %d model calls",
        env.id, env.name, evidence.score, counts.judged, counts.invalid_replies, agents.usage.calls,
    )  # fmt: skip
    incomplete = [run for run in runs if len(run.judged) < run.quota and run.settled is None]
    if incomplete:
        raise _gave_up(env, ctx, incomplete, evidence)
    if evidence.score < ctx.config.evaluate.keep_score:
        raise Rejected(ctx.reject(env, "low_score", _low_score_detail(evidence), raw_output=_compact(evidence)))
    accepted = env.model_copy(
        update={
            "status": "accepted",
            "reason": None,
            "scores": {"dual_agent": evidence.score, "tool_coverage": evidence.tool_coverage},
            "evaluation": evidence,
            "graph": await asyncio.to_thread(tool_graph, ctx.sandbox, env, states[0], contract),
        }
    )
    return [accepted]


def tool_graph(sandbox: Any, env: Environment, state: TestState, contract: Contract = "strict") -> ToolGraph | None:
    """The tool dependency graph from a test state (`builder env graph` with that state gives the same); None
    when the extraction fails: the graph describes the environment, it does not judge it."""
    try:
        return extract_graph(sandbox, env.code, state.state, now=state.now, contract=contract)
    except (ContractError, SessionError) as error:
        logger.warning("evaluate: no tool graph for %s: %s", env.id, error)
        return None


# ------------------------------------------------------------------------------------------- test states


async def make_test_states(
    env: Environment, interface: EnvInterface, default_state: dict[str, Any], ctx: StageContext, agents: Agents
) -> tuple[list[TestState], list[tuple[int, InvalidReply]]]:
    """Valid test states (in index order) and the slots that produced none, with their last error."""
    config = ctx.config.evaluate
    output_type = state_output_type(
        generated_state_schema(env.state_schema, default_state), "TestState", purpose=True, default_now=DEFAULT_NOW
    )
    header = class_header(env.code)
    whole = shows_whole_source(config.calls, len(interface.tools))  # as the checker's requests: one shared start

    async def loads(draft: Any) -> str | None:
        state = draft.values()
        dangling = "; ".join(reference_problems(state))
        if dangling:
            return f"references that name no record (use an existing id, or an empty value for none): {dangling}"
        return await asyncio.to_thread(load_error, ctx.sandbox, env.code, interface, state, draft.now)

    async def one(index: int) -> TestState | InvalidReply:
        def ask(budget: PromptBudget) -> Awaitable[Any]:
            messages = agents.state_messages(env, header, default_state, index, budget, whole)
            return agents.ask_json(messages, output_type, "state", sample_index=index, accept=loads)

        try:
            draft = await shrinking(ctx, "evaluate_state", prompt_budgets(ctx.config.llm.max_state_chars), ask)
        except InvalidReply as invalid:
            return invalid
        return TestState(index, " ".join(draft.purpose.split()), draft.values(), draft.now)

    results = await _all([one(i) for i in range(min(config.test_states, config.calls))])
    states = [r for r in results if isinstance(r, TestState)]
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, InvalidReply)]
    return states, failures


def load_error(
    sandbox: Any, code: str, interface: EnvInterface, state: dict[str, Any], now: str = DEFAULT_NOW
) -> str | None:
    """Why `state` cannot serve as an initial state (None: it loads and reads back as JSON)."""
    try:
        with Session(sandbox, code, state, interface=interface, now=now) as session:
            session.snapshot()
    except SessionError as error:
        return f"the environment does not load with this state: {error}"
    return None


# ---------------------------------------------------------------------------------------- dual-agent check


# ------------------------------------------------------------------------------------------------ verdict


def summarize(
    env: Environment, interface: EnvInterface, states: list[TestState], failures: list[tuple[int, InvalidReply]],
    runs: list[StateRun], ctx: StageContext, agents: Agents,
) -> Evaluation:  # fmt: skip
    """The evidence behind the verdict: score, counts, per-tool coverage, every judged call, unusable replies."""
    calls = [call for run in runs for call in run.judged]
    verdicts = Counter(call.verdict for call in calls)
    per_tool: dict[str, Counter[str]] = {name: Counter() for name in interface.tool_names}
    for call in calls:
        per_tool[call.tool].update(["calls", call.case, call.verdict])
    score = (verdicts["pass"] + verdicts["warning"]) / len(calls) if calls else 0.0
    config = ctx.config.evaluate
    return Evaluation(
        score=round(score, 4),
        keep_score=config.keep_score,
        calls_required=config.calls,
        settled_early=runs[0].settled if runs else None,
        counts=EvaluationCounts(
            judged=len(calls),
            pass_=verdicts["pass"],
            warning=verdicts["warning"],
            fail=verdicts["fail"],
            failed_by_runtime=sum(c.judge == "runtime" for c in calls),
            invalid_replies=sum(len(run.invalid) for run in runs),
        ),
        tool_coverage=round(sum(1 for c in per_tool.values() if c["calls"]) / len(per_tool), 4),
        tools={name: dict(counter) for name, counter in per_tool.items()},
        test_states=tuple(EvaluationState(purpose=s.purpose, now=s.now, state=s.state) for s in states),
        failed_test_states=tuple(FailedTestState(index=i, kind=f.kind, detail=f.detail) for i, f in failures),
        calls=tuple(calls),
        invalid_replies=tuple(
            UnusableReply(**{k: v for k, v in item.items() if k != "raw"}) for run in runs for item in run.invalid
        ),
        usage=agents.usage.model_dump(),
        provenance=EvaluationProvenance(
            model=getattr(ctx.llm, "model_id", None),
            prompt_versions=tuple(prompt_version(name) for name in PROMPTS),
            sampling={role: agents.sampling(role).model_dump() for role in ("state", "tester", "checker")},
            tester_tool_choice=config.tester_tool_choice,
            config_hash=ctx.config_hash,
            builder_version=__version__,
        ),
    )


def _gave_up(env: Environment, ctx: StageContext, incomplete: list[StateRun], evidence: Evaluation) -> Rejected:
    """The check could not judge N calls: blame whichever agent wasted the most replies."""
    invalid = [item for run in incomplete for item in run.invalid]
    checker = sum(item["kind"] == "checker_invalid" for item in invalid)
    reason = "checker_invalid" if checker * 2 > len(invalid) else "tester_invalid"
    kinds = ", ".join(f"{kind}={n}" for kind, n in sorted(Counter(item["kind"] for item in invalid).items()))
    judged = evidence.counts.judged
    detail = f"gave up after {judged} of {evidence.calls_required} judged calls; unusable replies: {kinds}"
    return Rejected(ctx.reject(env, reason, detail, raw_output=invalid[-1]["raw"]))


def _low_score_detail(evidence: Evaluation) -> str:
    counts = evidence.counts
    first = next((c for c in evidence.calls if c.verdict == "fail"), None)
    worst = f"; first failure: {first.tool} ({first.case}): {first.reason}" if first else ""
    return (
        f"score {evidence.score:.2f} < {evidence.keep_score} over {counts.judged} judged calls "
        f"({counts.pass_} pass, {counts.warning} warning, {counts.fail} fail){worst}"
    )[:DETAIL_CHARS]


def _compact(evidence: Evaluation) -> str:
    """The per-call verdicts of a rejected environment, kept as the rejection's raw output."""
    keep = {"tool", "case", "arguments", "verdict", "reason", "judge"}
    compact = evidence.model_dump(mode="json", include={"score": True, "counts": True, "calls": {"__all__": keep}})
    return json.dumps(compact, ensure_ascii=False)
