"""rollout: k sampled episodes of the agent model per scenario against the sandboxed environment, each graded.

Per scenario: the environment's code comes from this run's accepted environments (by id; the stage declares it
needs `Environment` records and the executor hands in those of the stage that accepted them), the gold solution
is replayed once to learn which state paths the task may touch, then `rollout.samples_per_scenario` episodes run
concurrently (`builder.rollout.episode.run_episode`), each in its own sandbox session, with the user simulator in
conversational mode. Each final state is graded by the scenario's checks (`builder.rollout.reward.grade`). Trajectories
are the stage's records (the runner upserts them into the store); the scenario's pass rate is logged (select
computes it from the trajectories).

Who plays the agent depends on the environment's split (`builder.splits.is_rl_environment`, select's): the
synthesis model (the teacher of the SFT set) in `train` environments, and `rollout.rl_agent_model` (the policy
the RL set is for) in `rl` environments when it is set, so select's RL band holds the policy's pass rates. The
user simulator stays on the synthesis model (or `rollout.user_model`) either way. Models, the sandbox and the
threads blocking sandbox calls run in all come from the process running the stage (`StageResources`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TypeVar

from builder.config import BuildConfig, LLMConfig, RolloutConfig
from builder.envs.answer import agent_answer, answer_check, tool_text
from builder.envs.lint import ContractError
from builder.envs.session import Session, SessionError
from builder.errors import ConfigError, ItemError, OperatorError, RunError
from builder.limits import DETAIL_CHARS
from builder.llm import StageModel
from builder.llm.roles import rl_agent_config
from builder.prompts import prompt_version
from builder.records import ChatMessage, Environment, Record, Sampling, Scenario, Trajectory
from builder.reports import RolloutReport, SplitFigures
from builder.rollout.episode import ENV_ERROR, INFRA_END_REASONS, Episode, Limits, run_episode
from builder.rollout.reward import Grade, gold_paths, grade
from builder.rollout.runner import SandboxRunner
from builder.rollout.user_sim import UserSimulator
from builder.run.stage import Rejected, StageContext
from builder.sandbox.world import DEFAULT_NOW
from builder.splits import declared_split, is_rl_environment
from builder.stats import StageStats
from builder.usage import Usage
from builder.views.agent import agent_system_prompt
from builder.views.code import policy_text

logger = logging.getLogger(__name__)

T = TypeVar("T")
REASONS = ("no_user_script", "env_missing", "env_load_failed")  # rejections of a whole scenario (stable codes)


def rollout_concurrency(config: BuildConfig) -> int:
    """Scenarios in flight, so that about `rollout.episodes_in_flight` episodes run at once."""
    return max(1, -(-config.rollout.episodes_in_flight // config.rollout.samples_per_scenario))


def user_model(ctx: StageContext) -> StageModel:
    """The user simulator's model: `rollout.user_model` (the pipeline's client for it, counted and closed like
    the others), else the agent's.

    Raises:
        RunError: `rollout.user_model` is set, but the pipeline gave the stage no model for it.
    """
    if ctx.config.rollout.user_model is None:
        return ctx.llm
    if ctx.user_model is None:
        raise RunError("rollout.user_model is set, but this pipeline has no user model")
    return ctx.user_model


@dataclass(frozen=True)
class Player:
    """Who plays the agent in a scenario: the model, the split it plays for, and the conversation limit that
    fits the model's context."""

    model: StageModel  # the synthesis model (ctx.llm) or the RL agent (ctx.rl_agent)
    split: str  # "train" or "rl"
    max_tokens: int


def player(ctx: StageContext, env_id: str, declared: str | None = None) -> Player:
    """The agent of `env_id`'s scenarios: the RL agent in `rl` environments when `rollout.rl_agent_model` is
    set, else the synthesis model.

    Raises:
        RunError: `rollout.rl_agent_model` is set, but the pipeline gave the stage no RL agent model.
        ConfigError: the model's context has no room for a reply (see `conversation_limit`).
    """
    rl = is_rl_environment(env_id, ctx.config.select.rl_env_fraction, declared)
    rl_llm = rl_agent_config(ctx.config) if rl else None
    if rl_llm is None:
        return Player(ctx.llm, "rl" if rl else "train", conversation_limit(ctx.config.rollout, ctx.config.llm))
    if ctx.rl_agent is None:
        raise RunError("rollout.rl_agent_model is set, but this pipeline has no RL agent model")
    return Player(ctx.rl_agent, "rl", conversation_limit(ctx.config.rollout, rl_llm))


def conversation_limit(rollout: RolloutConfig, llm: LLMConfig) -> int:
    """Tokens at which an episode is cut (`max_tokens`): `rollout.max_tokens`, or less when the agent's context
    could not hold a conversation that long plus the next reply's budget (e.g. the RL agent's 8192-token
    SmolLM2 under the built-in 24000).

    Raises:
        ConfigError: the context has no room for a reply at all.
    """
    reply = rollout.max_reply_tokens + (llm.reasoning_budget if llm.thinking == "on" else 0)
    room = llm.max_model_len - reply
    if room <= 0:
        raise ConfigError(
            f"the agent model {llm.model!r} has a context of {llm.max_model_len} tokens, no room for a reply of "
            f"{reply} (rollout.max_reply_tokens, plus llm.reasoning_budget with thinking on): raise the context "
            "(llm.max_model_len, or rollout.rl_agent_max_model_len for the RL agent) or lower the reply budget"
        )
    return min(rollout.max_tokens, room)


def system_prompt(env: Environment, mode: str, now: str = DEFAULT_NOW) -> tuple[str, str]:
    """The agent's system prompt for `mode` at the scenario's date-time `now`, and its prompt version."""
    name = "rollout_task" if mode == "non_conversational" else "rollout_conversation"
    text = agent_system_prompt(
        name, name=env.name, domain=env.domain, description=env.description, now=now, policy=policy_text(env.code)
    )
    return text, prompt_version(name)


def agent_sampling(ctx: StageContext, sample_index: int) -> Sampling:
    config = ctx.config.rollout
    return Sampling(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_reply_tokens,
        seed=ctx.config.run.seed + sample_index,
    )


def load_environment(ctx: StageContext, scenario: Scenario) -> Environment:
    """The scenario's environment, as this run accepted it."""
    env = ctx.earlier_record(Environment, scenario.env_id)
    if env is None:
        detail = f"environment {scenario.env_id} is not among this run's accepted environments"
        raise Rejected(ctx.reject(scenario, "env_missing", detail))
    return env


async def rollout(scenario: Scenario, ctx: StageContext) -> list[Record]:
    """`rollout.samples_per_scenario` graded trajectories of one scenario, or a rejection (no_user_script,
    env_missing, env_load_failed: the environment or the gold replay does not load)."""
    if scenario.mode == "conversational" and scenario.user is None:
        raise Rejected(ctx.reject(scenario, "no_user_script", "a conversational scenario needs a user script"))
    env = await ctx.blocking(load_environment, ctx, scenario)
    try:
        # No gold (an imported scenario): nothing to compare the agent's writes with, so no collateral guard.
        allowed = None if not scenario.gold_actions else await ctx.blocking(
            gold_paths, ctx.sandbox, env.code, scenario.initial_state, scenario.gold_actions,
            now=scenario.now, seed=scenario.seed, contract=env.contract,
        )  # fmt: skip
    except (SessionError, ContractError) as error:
        raise Rejected(ctx.reject(scenario, "env_load_failed", str(error)[:DETAIL_CHARS])) from None
    agent = player(ctx, scenario.env_id, declared_split(env.provenance))
    samples = range(ctx.config.rollout.samples_per_scenario)
    trajectories = list(await asyncio.gather(*(_isolated(ctx, scenario, env, allowed, i, agent) for i in samples)))
    solved = sum(t.solved for t in trajectories)
    logger.info("rollout: %s (%s, %s) pass rate %d/%d", scenario.id, agent.split, agent.model.model_id, solved,
                len(trajectories))  # fmt: skip
    # How many scenarios were solved by 0, 1, ..., k of their k samples: the shape select's RL band cuts from.
    histogram = ctx.stats.report.pass_counts
    histogram[f"{solved}/{len(trajectories)}"] = histogram.get(f"{solved}/{len(trajectories)}", 0) + 1
    _count_by_model(ctx, agent, trajectories)
    return trajectories


def _count_by_model(ctx: StageContext, agent: Player, trajectories: list[Trajectory]) -> None:
    """`report.by_model[model][split]`: scenarios, rollouts, graded rollouts and solved, so the stats say which
    model's pass rates the RL band was cut from (`derive_report` adds the pass rate: solved / graded, as select
    counts it)."""
    by_model = ctx.stats.report.by_model.setdefault(agent.model.model_id, {})
    entry = by_model.setdefault(agent.split, SplitFigures())
    graded = [t for t in trajectories if t.end_reason not in INFRA_END_REASONS]
    entry.scenarios += 1
    entry.rollouts += len(trajectories)
    entry.graded += len(graded)
    entry.solved += sum(t.solved for t in graded)


def derive_report(stats: StageStats) -> None:
    """`pass_rate` of each model and split in `report.by_model` from its counters (`ItemStage.derive`)."""
    report: RolloutReport = stats.report  # type: ignore[assignment]
    for splits in report.by_model.values():
        for entry in splits.values():
            entry.pass_rate = round(entry.solved / entry.graded, 4) if entry.graded else None


async def _isolated(
    ctx: StageContext,
    scenario: Scenario,
    env: Environment,
    allowed: tuple[str, ...] | None,
    index: int,
    agent: Player,
) -> Trajectory:
    """`_sample`, whose failure (a sandbox session that broke, say) is that sample's: a void trajectory with the
    reason, never the loss of the scenario's other samples."""
    try:
        return await _sample(ctx, scenario, env, allowed, index, agent)
    except ItemError as error:
        if isinstance(error, OperatorError):
            raise
        logger.warning("rollout: %s sample %d failed: %s: %s", scenario.id, index, error.reason, error)
        system, version = system_prompt(env, scenario.mode, scenario.now)
        failed = Episode(
            messages=(ChatMessage(role="system", content=system),), end_reason=ENV_ERROR, agent_usage=Usage(),
            user_usage=Usage(), num_turns=0, num_tool_calls=0, tool_errors=0, flags=("sample_failed",),
            detail=f"{error.reason}: {error}"[:DETAIL_CHARS],
        )  # fmt: skip
        sampling = agent_sampling(ctx, index)
        return _trajectory(ctx, scenario, env, failed, None, sampling, index, version, agent.model.model_id)


async def _sample(
    ctx: StageContext,
    scenario: Scenario,
    env: Environment,
    allowed: tuple[str, ...] | None,
    index: int,
    agent: Player,
) -> Trajectory:
    config = ctx.config.rollout
    sampling = agent_sampling(ctx, index)
    system, version = system_prompt(env, scenario.mode, scenario.now)
    tools = list(env.tools)
    user = None
    if scenario.mode == "conversational":
        user_sampling = Sampling(
            temperature=config.user_temperature, max_tokens=config.max_reply_tokens, seed=ctx.config.run.seed + index
        )
        names = [tool["function"]["name"] for tool in tools]
        user = UserSimulator(
            user_model(ctx), scenario, names, sampling=user_sampling, retries=config.user_retries, sample_index=index
        )
    limits = Limits(config.max_turns, config.max_tool_calls, agent.max_tokens)
    state, now, seed = scenario.initial_state, scenario.now, scenario.seed
    session = await ctx.blocking(Session, ctx.sandbox, env.code, state, now=now, seed=seed, contract=env.contract)
    try:
        episode = await run_episode(
            agent.model, tools, SandboxRunner(session, ctx.blocking), system=system,
            opening=scenario.task if user is None else None, limits=limits, sampling=sampling,
            sample_index=index, user=user,
        )  # fmt: skip
        try:
            final = await ctx.blocking(session.snapshot)
        except SessionError as error:
            final = None
            episode = _void(episode, f"final state unreadable: {error}")
    finally:
        await ctx.blocking(session.close)
    verdict = None
    messages = [message.model_dump() for message in episode.messages]
    if final is not None:
        verdict = await ctx.blocking(
            grade, ctx.sandbox, scenario.checks, scenario.initial_state, final, allowed,
            now=scenario.now, seed=scenario.seed, check=answer_check(scenario), answer=agent_answer(messages),
            seen=tool_text(messages),
        )  # fmt: skip
    return _trajectory(ctx, scenario, env, episode, verdict, sampling, index, version, agent.model.model_id)


def _void(episode: Episode, detail: str) -> Episode:
    return Episode(
        messages=episode.messages, end_reason=ENV_ERROR, agent_usage=episode.agent_usage,
        user_usage=episode.user_usage, num_turns=episode.num_turns, num_tool_calls=episode.num_tool_calls,
        tool_errors=episode.tool_errors, flags=episode.flags, detail=detail,
    )  # fmt: skip


def _trajectory(
    ctx: StageContext,
    scenario: Scenario,
    env: Environment,
    episode: Episode,
    verdict: Grade | None,
    sampling: Sampling,
    index: int,
    version: str,
    model: str,
) -> Trajectory:
    flags = list(episode.flags)
    if verdict is not None and verdict.collateral:
        flags.append("collateral")
    if verdict is not None and verdict.check_errors:
        flags.append("check_error")
    return Trajectory(
        provenance=ctx.provenance([scenario, env.id], model=model, sampling=sampling, prompt_version=version),
        scenario_id=scenario.id,
        env_id=scenario.env_id,
        mode=scenario.mode,
        model=model,
        sampling=sampling,
        sample_index=index,
        messages=episode.messages,
        tools=list(env.tools),
        reward=verdict.reward if verdict else 0.0,
        solved=verdict.solved if verdict else False,
        checks_passed=verdict.checks_passed if verdict else (),
        answer_stated=verdict.answer_stated if verdict else None,
        end_reason=episode.end_reason,
        usage=episode.agent_usage + episode.user_usage,
        num_turns=episode.num_turns,
        num_tool_calls=episode.num_tool_calls,
        tool_errors=episode.tool_errors,
        check_fraction=verdict.check_fraction if verdict else 0.0,
        collateral=verdict.collateral if verdict else (),
        flags=tuple(flags),
    )
