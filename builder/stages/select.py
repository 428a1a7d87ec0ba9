"""select: the SFT and RL sets from graded trajectories, on an environment-disjoint train / rl split.

Environments are split by `builder.splits.is_rl_environment` (the same function rollout and export use, so the
model that played a scenario, a selection and a release always agree). SFT takes trajectories of `train`
environments (played by the synthesis model); RL takes scenarios of `rl` environments (played by
`rollout.rl_agent_model` when set, so the pass rates are the policy's), so RL measures generalisation to
environments SFT never saw. Rules, in order (the first failing one is the rejection's reason code):

- SFT, per trajectory: `contaminated`, `void` (an infrastructure end: user_leak, user_error, llm_error,
  env_error), `not_solved` (the checks, never the agent's own word), `cut` (ended by a limit), `collateral`,
  `bad_reply` (an assistant reply cut by max_reply_tokens, or empty),
  `malformed_call` (a tool call that does not fit its schema or names no tool), `too_short` / `too_long`
  (`select.sft_min_turns`, `sft_max_turns`, `sft_max_chars`), `duplicate` (same conversation as a kept one).
- RL, per scenario: `contaminated`, `too_few_rollouts` (fewer than `select.min_rollouts` graded rollouts when
  the band is applied, else none),
  `pass_rate_out_of_band` (not strictly inside `select.rl_pass_band`; only when `rollout.rl_agent_model` is set).

The band is applied only to a policy's pass rates. Without `rollout.rl_agent_model` the synthesis model played
the `rl` environments: a strong teacher solves nearly every scenario, so its pass rates say nothing about the
policy a trainer will use and the band would empty the `rl` split in every run. Then every measured `rl`
scenario is kept with its pass rate, and the report's `rl_band` says the band was not applied and why.

The stage's report (stats: `select.report`) holds solve rates per environment and mode, turn and tool-call
distributions, yield, tokens per kept trajectory and the decontamination report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from builder.decontaminate import BenchmarkIndex
from builder.llm.parsing import check_tool_call
from builder.records import Environment, Record, Scenario, Selection, Trajectory
from builder.reports import SelectReport
from builder.rollout.episode import AGENT_DONE, INFRA_END_REASONS, USER_STOP
from builder.run.stage import StageContext
from builder.splits import declared_split, is_rl_environment, rl_band

SFT_REASONS = (
    "contaminated", "void", "not_solved", "cut", "collateral", "bad_reply", "malformed_call", "too_short", "too_long",
    "duplicate",
)  # fmt: skip
RL_REASONS = ("contaminated", "too_few_rollouts", "pass_rate_out_of_band")

logger = logging.getLogger(__name__)


async def select(trajectories: Sequence[Trajectory], ctx: StageContext) -> list[Record]:
    """Selections (sft trajectories, rl scenarios) and rejections with the reason codes above."""
    scenarios = await asyncio.to_thread(ctx.earlier, Scenario)
    environments = await asyncio.to_thread(ctx.earlier, Environment)
    contaminated, decontamination = _decontaminate(ctx, trajectories, scenarios, environments)
    by_scenario: dict[str, list[Trajectory]] = defaultdict(list)
    # Sample order decides which of two identical conversations is kept: the earlier sample.
    for trajectory in sorted(trajectories, key=lambda t: (t.sample_index, t.id)):
        by_scenario[trajectory.scenario_id].append(trajectory)
    fraction = ctx.config.select.rl_env_fraction
    results: list[Record] = []
    seen: set[str] = set()
    rl_models: set[str] = set()  # who really played the rl scenarios: the band's policy, or the teacher
    for scenario_id, group in sorted(by_scenario.items()):
        graded = [t for t in group if t.end_reason not in INFRA_END_REASONS]
        rate = sum(t.solved for t in graded) / len(graded) if graded else 0.0
        env_id = group[0].env_id
        env = environments.get(env_id)
        if is_rl_environment(env_id, fraction, declared_split(env.provenance) if env is not None else None):
            results.append(_rl(ctx, scenario_id, env_id, rate, len(graded), contaminated.get(scenario_id)))
            rl_models.update(t.model for t in graded)
            continue
        for trajectory in group:
            reason, detail = _sft_problem(ctx, trajectory, contaminated.get(scenario_id), seen)
            if reason is not None:
                results.append(ctx.reject(trajectory, reason, detail))
            else:
                results.append(_selection(ctx, "sft", "train", trajectory.id, scenario_id, env_id, rate, len(graded)))
    band = rl_band(ctx.config)
    if rl_models:
        band["measured_with"] = ", ".join(sorted(rl_models))
    ctx.stats.report = SelectReport(**_report(trajectories, results, decontamination), rl_band=band)
    declared = {env_id: declared_split(env.provenance) for env_id, env in environments.items()}
    ctx.stats.report.splits = _split_sizes({t.env_id for t in trajectories}, fraction, declared)
    return results


def _selection(
    ctx: StageContext, kind: str, split: str, subject_id: str, scenario_id: str, env_id: str, rate: float, n: int
) -> Selection:
    return Selection(
        provenance=ctx.provenance([subject_id]), kind=kind, split=split, subject_id=subject_id,
        scenario_id=scenario_id, env_id=env_id, pass_rate=rate, num_rollouts=n,
    )  # fmt: skip


def _rl(ctx: StageContext, scenario_id: str, env_id: str, rate: float, n: int, contamination: str | None) -> Record:
    low, high = ctx.config.select.rl_pass_band
    if contamination:
        return ctx.reject(scenario_id, "contaminated", contamination)
    applied = rl_band(ctx.config)["applied"]
    # A band needs enough rollouts to place a pass rate in it; without one, one graded rollout measures the rate.
    if n < (ctx.config.select.min_rollouts if applied else 1):
        return ctx.reject(scenario_id, "too_few_rollouts", f"{n} graded rollouts")
    if applied and not low < rate < high:
        return ctx.reject(scenario_id, "pass_rate_out_of_band", f"pass rate {rate:.3f} not inside ({low}, {high})")
    return _selection(ctx, "rl", "rl", scenario_id, scenario_id, env_id, rate, n)


def _sft_problem(
    ctx: StageContext, trajectory: Trajectory, contamination: str | None, seen: set[str]
) -> tuple[str | None, str]:
    """The first SFT rule `trajectory` breaks, as (reason, detail); (None, "") when it is kept (and now seen)."""
    config = ctx.config.select
    if contamination:
        return "contaminated", contamination
    if trajectory.end_reason in INFRA_END_REASONS:
        return "void", trajectory.end_reason
    if not trajectory.solved:
        return "not_solved", f"reward {trajectory.reward:.3f}, checks {list(trajectory.checks_passed)}"
    if trajectory.end_reason not in (AGENT_DONE, USER_STOP):
        return "cut", trajectory.end_reason
    if trajectory.collateral:
        return "collateral", ", ".join(trajectory.collateral)
    bad = [flag for flag in trajectory.flags if flag in ("truncated_reply", "empty_reply")]
    if bad:
        return "bad_reply", ", ".join(bad)
    malformed = malformed_calls(trajectory)
    if malformed:
        return "malformed_call", malformed[0]
    turns = sum(message.role == "assistant" for message in trajectory.messages)
    if turns < config.sft_min_turns:
        return "too_short", f"{turns} assistant messages"
    chars = conversation_chars(trajectory)
    if turns > config.sft_max_turns or chars > config.sft_max_chars:
        return "too_long", f"{turns} assistant messages, {chars} characters"
    key = conversation_key(trajectory)
    if key in seen:
        return "duplicate", "the same conversation as a kept trajectory of this scenario"
    seen.add(key)
    return None, ""


def malformed_calls(trajectory: Trajectory) -> list[str]:
    """Why each bad tool call of a trajectory is bad: not fitting its schema, an unknown tool, or unanswered."""
    problems = []
    answered = {message.tool_call_id for message in trajectory.messages if message.role == "tool"}
    for message in trajectory.messages:
        for call in message.tool_calls or ():
            parsed = check_tool_call(call, trajectory.tools)
            if not parsed.ok:
                problems.append(parsed.error or "")
            elif call.id not in answered:
                problems.append(f"tool call {call.id} has no answer")
    if any("malformed_call" == flag or "unknown_tool" == flag for flag in trajectory.flags) and not problems:
        problems.append("the environment refused a call's arguments")
    return problems


def conversation_chars(trajectory: Trajectory) -> int:
    return sum(
        len(message.content or "") + sum(len(call.function.arguments) for call in message.tool_calls or ())
        for message in trajectory.messages
    )


def conversation_key(trajectory: Trajectory) -> str:
    """What makes two conversations the same: per message the role, the whitespace-normalised text and the tool
    calls with canonical arguments (call ids and the system prompt left out)."""
    parts = []
    for message in trajectory.messages:
        if message.role == "system":
            continue
        calls = []
        for call in message.tool_calls or ():
            try:
                arguments: Any = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = call.function.arguments
            calls.append([call.function.name, arguments])
        parts.append([message.role, " ".join((message.content or "").split()).casefold(), calls])
    return f"{trajectory.scenario_id}:{json.dumps(parts, sort_keys=True)}"


# ------------------------------------------------------------------------------------------ decontamination


def _decontaminate(
    ctx: StageContext,
    trajectories: Sequence[Trajectory],
    scenarios: dict[str, Scenario],
    environments: dict[str, Environment],
) -> tuple[dict[str, str], dict[str, Any]]:
    """{scenario id: why it is contaminated} and the report; an environment's contamination covers its scenarios."""
    config = ctx.config.select
    report: dict[str, Any] = {"benchmarks": list(config.benchmarks), "ngram": config.decontamination_ngram,
                              "threshold": config.decontamination_threshold}  # fmt: skip
    if not config.benchmarks:
        return {}, {**report, "checked": False}
    index = BenchmarkIndex.from_files(config.benchmarks, config.decontamination_ngram)
    scenario_env = {t.scenario_id: t.env_id for t in trajectories}
    flagged_envs: dict[str, str] = {}
    for env_id in sorted(set(scenario_env.values())):
        env = environments.get(env_id)
        if env is not None:
            why = _check(index, f"{env.name.replace('_', ' ')}: {env.description}", config.decontamination_threshold)
            if why:
                flagged_envs[env_id] = f"environment {why}"
    flagged: dict[str, str] = {}
    for scenario_id, env_id in sorted(scenario_env.items()):
        texts = _scenario_texts(scenario_id, scenarios, trajectories)
        why = next((w for text in texts if (w := _check(index, text, config.decontamination_threshold))), None)
        if why or env_id in flagged_envs:
            flagged[scenario_id] = why or flagged_envs[env_id]
    report.update(
        checked=True,
        benchmark_texts=len(index.texts),
        environments_checked=len(set(scenario_env.values())),
        scenarios_checked=len(scenario_env),
        environments_dropped=dict(sorted(flagged_envs.items())),
        scenarios_dropped=dict(sorted(flagged.items())),
    )
    return flagged, report


def _scenario_texts(scenario_id: str, scenarios: dict[str, Scenario], trajectories: Sequence[Trajectory]) -> list[str]:
    """The texts a benchmark could have been copied into: the task and the user script's lines, each on its own
    (a copied task must not be diluted by the rest); the trajectories' user messages if it is not in the store."""
    scenario = scenarios.get(scenario_id)
    if scenario is not None:
        script = scenario.user
        return [scenario.task, *([script.known_up_front, script.reveal_when_asked] if script else [])]
    return [
        message.content or ""
        for t in trajectories
        if t.scenario_id == scenario_id
        for message in t.messages
        if message.role == "user"
    ]


def _check(index: BenchmarkIndex, text: str, threshold: float) -> str | None:
    """Why a text is contaminated (which benchmark text it overlaps), or None."""
    match = index.match(text)
    if match.benchmark is None or match.overlap < threshold:
        return None
    return f"overlaps {match.overlap:.2f} with {match.benchmark.source}#{match.benchmark.index}"


# ------------------------------------------------------------------------------------------------- report


def _distribution(values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "min": ordered[0], "median": statistics.median(ordered), "mean": round(statistics.fmean(ordered), 3),
        "p90": ordered[int(0.9 * (len(ordered) - 1))], "max": ordered[-1],
    }  # fmt: skip


def _split_sizes(env_ids: set[str], fraction: float, declared: dict[str, str | None]) -> dict[str, Any]:
    """Environments per split, with a warning when one split is empty (few environments, a small fraction).

    The split is a pure function of each id so that environments keep their split across releases; forcing an
    environment into an empty split would break that, so the operator is told instead.
    """
    rl = sum(is_rl_environment(env_id, fraction, declared.get(env_id)) for env_id in env_ids)
    sizes: dict[str, Any] = {"train_envs": len(env_ids) - rl, "rl_envs": rl}
    empty = [split for split in ("train", "rl") if env_ids and sizes[f"{split}_envs"] == 0]
    if empty:
        sizes["warning"] = (
            f"the {empty[0]} split has no environment ({len(env_ids)} environments, select.rl_env_fraction="
            f"{fraction}); build more environments or change the fraction"
        )
        logger.warning("select: %s", sizes["warning"])
    return sizes


def _report(trajectories: Sequence[Trajectory], results: Sequence[Record], decontamination: dict) -> dict[str, Any]:
    solve: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for t in trajectories:
        if t.end_reason not in INFRA_END_REASONS:
            for key in (f"{t.env_id}/{t.mode}", f"*/{t.mode}"):
                solve[key][0] += t.solved
                solve[key][1] += 1
    kept_sft = [r for r in results if isinstance(r, Selection) and r.kind == "sft"]
    tokens = sum(t.usage.prompt_tokens + t.usage.completion_tokens for t in trajectories)
    return {
        "trajectories": len(trajectories),
        "end_reasons": dict(sorted(Counter(t.end_reason for t in trajectories).items())),
        "solve_rate": {key: round(s / n, 4) for key, (s, n) in sorted(solve.items())},
        "turns": _distribution([t.num_turns for t in trajectories]),
        "tool_calls": _distribution([t.num_tool_calls for t in trajectories]),
        "sft_kept": len(kept_sft),
        "rl_kept": sum(isinstance(r, Selection) and r.kind == "rl" for r in results),
        "sft_yield": round(len(kept_sft) / len(trajectories), 4) if trajectories else 0.0,
        "tokens_per_sft_trajectory": round(tokens / len(kept_sft), 1) if kept_sft else None,
        "decontamination": decontamination,
    }
