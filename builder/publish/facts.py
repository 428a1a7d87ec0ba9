"""What the dataset card says about how a release was made: tasks and rows, who played which role, the reward, the
RL band, decontamination and the reward audit.

Each renderer takes the run's config (the one whose hash the release carries), the run's per-stage stats
(`RUN/stats.json`, empty when the export was given none) and the release tables, and says plainly what it cannot
know: a figure the stats would hold is never guessed from the config.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import polars as pl

from builder.config import BuildConfig
from builder.envs.audit import CASES
from builder.envs.guard import GUARD_ITEM
from builder.llm.roles import role_models
from builder.publish.plots import value_label
from builder.splits import rl_band
from builder.stats import StageStats

# docs/rollouts.md §4, briefly: the rule `builder.envs.checks.published_reward` computes.
REWARD = f"""Every path that grades an episode uses one reward (`builder.envs.checks.published_reward`: builder's
rollouts, `trl_environment_factories` and `LiveEnvironment`, the OpenEnv and verifiers adapters,
`python -m builder reward`). For a scenario's `checks` run on (initial state, final state), in a fresh sandbox
at the scenario's `now` and seed:

- **solved** = every check passes, the collateral guard included (the last check of every scenario with a gold
  solution, checklist item "{GUARD_ITEM.removesuffix(".")}": it fails when any state path changed that the gold
  solution does not change, or a record the gold creates gets a value in a field the gold leaves empty), and, when
  the task asks to be told something, the agent's answer (everything it said in text or through `reply_to_user`)
  states each of the scenario's `answer_facts`, each also returned by a tool during the episode (a guess earns
  nothing; values compared regardless of case and punctuation, numbers in digits in any notation, cents also as a
  currency amount, dates as ISO or month names: `builder.envs.answer`); an `infeasible` task's answer (and a
  `policy_trap` task's one-shot answer) declines instead, after tools returned its facts (what makes the request
  impossible), which it need not repeat; a `missing_info` task's one-shot answer names the missing value (its name,
  head word, or a question for that kind of value: "which day" for a date); neither may claim success ("all set",
  "I've booked", ...);
- **reward** = 1.0 when solved; **0.0** when the guard fails, when a check that already held on the initial state no
  longer holds, or when no counted item passes; else the share of the **counted** items that pass, a counted item
  being a check that is false on the initial state, or the answer check.

So an agent that makes no call scores 0 (except on a `missing_info` task's one-shot row, where asking for the
missing value without a call is the right answer), collateral damage scores 0, and partial credit stays below 1.
With TRL, pass `reward_funcs=trl_reward`: it hands each environment the completion's answer."""

AUDIT_CASES = {
    "nothing": ("no call", "0"),
    "gold": ("the gold actions", "1"),
    "collateral": ("the gold plus a write to a record the task does not touch", "< 1"),
    "order": ("the gold with two independent calls swapped", "1"),
    "spelling": (
        'the gold with equivalent spellings of its values (date-times without `:00`, `""`/`null`; an '
        "answer's dates and numbers in words)",
        "1",
    ),
}


def _report(stats: dict[str, StageStats], stage: str) -> dict[str, Any]:
    """A stage's report as stats.json holds it ({} when the stage is not in the stats)."""
    return stats[stage].report.model_dump(by_alias=True) if stage in stats else {}


# ------------------------------------------------------------------------------------------- tasks and rows


def task_count(frame: pl.DataFrame) -> int:
    """Distinct tasks among scenario rows: the modes of one task (conversational and non-conversational, made
    from one slot) share `verification.scenario_group`, so they count once; a row without a group is a task."""
    tasks = set()
    for row in frame.select("scenario_id", "env_id", "verification").to_dicts():
        group = json.loads(row["verification"]).get("scenario_group") if row["verification"] else None
        tasks.add((row["env_id"], group) if group else row["scenario_id"])
    return len(tasks)


def contents(tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    scenarios = tables["scenarios"]
    every = pl.concat(list(scenarios.values()))
    per_split = "; ".join(
        f"`{split}`: {_tasks_rows(task_count(frame), frame.height)}" for split, frame in scenarios.items()
    )
    environments = sum(frame.height for frame in tables["environments"].values())
    return (
        f"**{_tasks_rows(task_count(every), every.height)}** of `scenarios` ({per_split}), in {environments} "
        f"environments, and {tables['sft']['train'].height} `sft` trajectories. A task published in both modes "
        "(conversational and non-conversational: the same state, sharing `verification.scenario_group`) is one task "
        "in two rows; its checks and gold are the same in both, except a `missing_info` task's non-conversational "
        "row, which the user's missing value leaves with nothing to do but say what is missing."
    )


def _tasks_rows(tasks: int, rows: int) -> str:
    return f"{tasks} task{'s' * (tasks != 1)}, {rows} row{'s' * (rows != 1)}"


# -------------------------------------------------------------------------------------------------- roles


def roles(config: BuildConfig, stats: dict[str, StageStats], tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """Which model wrote, judged, played the user and played the agent, from the config; the rollouts each agent
    model played, from the stats."""
    models = role_models(config)
    name = "`llm.served_model_name` at `llm.url`" if config.llm.url or config.llm.urls else "`llm.model`"
    rl_agent = "`rollout.rl_agent_model`"
    if config.rollout.rl_agent_model is None:
        rl_agent = "the synthesis model: no `rollout.rl_agent_model`"
    user = "`rollout.user_model`" if config.rollout.user_model else "the synthesis model"
    rows = [
        ("wrote the environments and scenarios (plans, code, states, tasks, checks, gold actions)",
         models["synthesis"], f"the synthesis model, {name}"),
        ("judged the environments (evaluate's tester and checker agents)", models["synthesis"], "the synthesis model"),
        ("played the user (conversational scenarios)", models["user"], user),
        ("played the agent in `train` environments (the `sft` trajectories)", models["train_agent"],
         "the synthesis model"),
        ("played the agent in `rl` environments (their `pass_rate`)", models["rl_agent"], rl_agent),
    ]  # fmt: skip
    lines = ["| role | model | set by |", "|---|---|---|"]
    lines += [f"| {role} | `{model}` | {source} |" for role, model, source in rows]
    imported = sum(_imported(row) for frame in tables["environments"].values() for row in frame["provenance"])
    if imported:
        lines.append(
            f"\n{imported} environment(s) were imported (their `provenance.origin` names the source): written "
            "elsewhere, and only re-verified here."
        )
    by_model = _report(stats, "rollout").get("by_model") or {}
    if by_model:
        lines += [
            "",
            "Rollouts of the run that exported this release, by agent model and split (graded rollouts exclude "
            "infrastructure failures; the release also holds what earlier runs kept in the store):",
            "",
            "| model | split | scenarios | rollouts | graded | solved | pass rate |",
            "|---|---|---|---|---|---|---|",
        ]
        for model, splits in sorted(by_model.items()):
            for split, figures in sorted(splits.items()):
                rate = figures.get("pass_rate")
                counts = [figures.get(key, 0) for key in ("scenarios", "rollouts", "graded", "solved")]
                cells = [f"`{model}`", f"`{split}`", *counts, "–" if rate is None else value_label(rate)]
                lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


def _imported(provenance: Any) -> bool:
    provenance = json.loads(provenance) if isinstance(provenance, str) else provenance
    return bool(isinstance(provenance, dict) and provenance.get("origin"))


# ---------------------------------------------------------------------------------------------------- band


def band(config: BuildConfig, stats: dict[str, StageStats], tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """The policy behind the `rl` split: whose pass rates the band cut, or that no band was applied and why."""
    policy = _report(stats, "select").get("rl_band") or rl_band(config)
    low, high = (value_label(value) for value in policy["band"])
    k = config.rollout.samples_per_scenario
    if policy["applied"]:
        text = (
            f"The `rl` split holds the scenarios of `rl` environments whose pass rate, measured with "
            f"`{policy['measured_with']}` (`rollout.rl_agent_model`) playing the agent in {k} rollouts each, lay "
            f"strictly inside `select.rl_pass_band` = ({low}, {high}): scenarios that policy solves sometimes but "
            "not always, so a GRPO group of them has a reward spread. Their `pass_rate` is that model's."
        )
    else:
        text = (
            f"**No pass-rate band was applied.** `rollout.rl_agent_model` was not set, so the `rl` environments "
            f"were played by the synthesis model `{policy['measured_with']}`, the teacher of the `sft` data. Its "
            "pass rates say nothing about how often your policy solves a scenario, and a strong teacher solves "
            f"nearly every one, so the band ({low}, {high}) would empty the split. Every `rl` scenario with a "
            "graded rollout is published with the synthesis model's `pass_rate` "
            f"({k} rollout{'s' * (k != 1)} each: a rate from so few samples is a hint, not a measurement). "
            "Measure your policy's pass rates and keep the scenarios it solves sometimes before GRPO: a group "
            "that is all solved or all failed carries no signal."
        )
    rl = tables["scenarios"]["rl"]
    if rl.height:
        rates = sorted(Counter(rl["pass_rate"].to_list()).items(), key=lambda item: (item[0] is None, item[0] or 0))
        shown = "; ".join(
            f"{'none' if rate is None else value_label(rate)} in {count} row{'s' * (count != 1)}"
            for rate, count in rates
        )
        return f"{text}\n\n`pass_rate` of the `rl` rows: {shown}."
    return f"{text}\n\nThis release has no `rl` scenarios: {missing_rl(config, stats, tables)}."


def missing_rl(config: BuildConfig, stats: dict[str, StageStats], tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """Why a release has no `rl` scenarios, as far as the config, the stats and the tables tell."""
    fraction = config.select.rl_env_fraction
    if tables["environments"]["rl"].height == 0:
        total = tables["environments"]["train"].height
        return (
            f"none of its {total} environments falls into the `rl` split at `select.rl_env_fraction` = {fraction} "
            "(the split is a fixed function of each environment's id, so that it keeps its split across releases)"
        )
    select = stats.get("select")
    if select is None:
        return "select kept none of the `rl` environments' scenarios (the run's stats were not given to the export)"
    rl_reasons = ("contaminated", "too_few_rollouts", "pass_rate_out_of_band")
    dropped = {reason: select.dropped[reason] for reason in rl_reasons if select.dropped.get(reason)}
    reasons = ", ".join(f"{reason}: {count}" for reason, count in dropped.items()) or "none dropped"
    return f"select kept none of the `rl` environments' scenarios (select's drops that apply to rl: {reasons})"


# -------------------------------------------------------------------------------------- decontamination


def decontamination(config: BuildConfig, stats: dict[str, StageStats]) -> str:
    report = _report(stats, "select").get("decontamination") or {}
    # select decontaminates exactly when benchmarks are given, so the config answers when no report does.
    checked = report["checked"] if "checked" in report else bool(config.select.benchmarks)
    if not checked:
        return (
            "**No decontamination ran**: `select.benchmarks` was empty, so no task, user script or environment "
            "was compared with any benchmark (BFCL, tau-bench, ACEBench, …). Do not assume this release is "
            "disjoint from the benchmark you evaluate on."
        )
    if not report:
        return (
            f"Select decontaminated against {', '.join(f'`{b}`' for b in config.select.benchmarks)}; the run's "
            "stats were not given to the export, so what it checked and dropped is not shown here."
        )
    dropped_envs, dropped = report.get("environments_dropped", {}), report.get("scenarios_dropped", {})
    return (
        f"Select compared every task, user script and environment with {report.get('benchmark_texts', 0)} "
        f"benchmark texts from {', '.join(f'`{b}`' for b in report.get('benchmarks', []))} (word "
        f"{report.get('ngram')}-grams; dropped at an overlap of {report.get('threshold')} or more with one text): "
        f"{report.get('environments_checked', 0)} environments and {report.get('scenarios_checked', 0)} "
        f"scenarios checked, {len(dropped_envs)} environments and {len(dropped)} scenarios dropped."
    )


# ------------------------------------------------------------------------------------------------- families

FAMILY_MEANING = {
    "plain": "a fully specified multi-step request",
    "missing_info": "the user leaves out a value: ask for it (conversational), or change nothing and say what is "
    "missing (non-conversational)",
    "infeasible": "the rules forbid the request: change nothing and say why",
    "policy_trap": "the request is forbidden, an allowed alternative meets the need: offer it and do it once the "
    "user agrees (conversational); decline, say why and do nothing in its place (non-conversational)",
    "error_recovery": "a stale detail makes the natural first call fail: find the right record",
    "long_context": "hundreds of distractor records: find the task's records by search",
}


def families(stats: dict[str, StageStats], tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """Per task family: tasks and rows published, the measured pass rate of its rows, and how its slots fared
    when they were made (`stages.scenarios.report.families`)."""
    every = pl.concat(list(tables["scenarios"].values()))
    made = _report(stats, "scenarios").get("families") or {}
    names = sorted(set(every["family"].to_list()) | set(made), key=lambda f: list(FAMILY_MEANING).index(f)
                   if f in FAMILY_MEANING else len(FAMILY_MEANING))  # fmt: skip
    if not names:
        return "No scenarios."
    lines = [
        "Each scenario is of one family (the `family` column; docs/scenarios.md, Task families). Pass rate: the "
        "mean of the rows' `pass_rate` where rollouts measured it. Made: slots tried, their yield, and the model "
        "calls and prompt tokens per verified slot of that family.",
        "",
        "| family | what it teaches | tasks, rows | pass rate | slots | yield | calls / verified "
        "| prompt tokens / verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        rows = every.filter(pl.col("family") == name)
        rates = rows.filter(pl.col("pass_rate").is_not_null())["pass_rate"]
        rate = f"{rates.mean():.2f}" if len(rates) else "–"
        figures = made.get(name, {})
        per = figures.get("per_verified") or {}
        cells = [
            f"`{name}`", FAMILY_MEANING.get(name, ""), _tasks_rows(task_count(rows), rows.height), rate,
            figures.get("slots", "–"), figures.get("yield") if figures.get("yield") is not None else "–",
            per.get("calls", "–"), per.get("prompt_tokens", "–"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- audit


def audit(stats: dict[str, StageStats]) -> str:
    """The reward audit's outcomes per case (`stages.scenarios.report.audit`: one count per verified slot)."""
    figures = _report(stats, "scenarios").get("audit") or {}
    if not figures:
        why = (
            "the run's stats were not given to the export"
            if not stats
            else "the run's scenarios stage recorded none (its scenarios were made before the audit, or imported)"
        )
        return f"No reward-audit figures for this release: {why}."
    lines = [
        "Before a scenario is kept, its reward is tried on call sequences whose right reward is known, in the "
        "sandbox (`builder.envs.audit`); a scenario failing a case is rejected with a reason code (see the "
        "`scenarios` row of the table below). Outcomes per task (both modes of a task share one audit):",
        "",
        "| case | calls | reward must be | pass | fail | n/a |",
        "|---|---|---|---|---|---|",
    ]
    for case in [*CASES, *sorted(set(figures) - set(CASES))]:
        if case in figures:
            calls, expected = AUDIT_CASES.get(case, (case, "–"))
            counts = figures[case]
            cells = [f"`{case}`", calls, expected, counts.get("pass", 0), counts.get("fail", 0), counts.get("n/a", 0)]
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(lines + ["", "`n/a`: the case cannot be built for that scenario (e.g. no other record to touch)."])
