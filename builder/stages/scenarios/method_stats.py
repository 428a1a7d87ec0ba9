"""The scenarios stage's figures per method (`ctx.stats.report.methods`, `builder.reports.MethodFigures`, in
stats.json): what each method costs and gives per verified slot, so `llm` and `graph` can be compared in one run.

Per method: `slots` tried and `verified` (of them `template_worded`: the graph method's words written by the
template, `scenarios.wording`), `yield` (verified / slots), model `calls`, `prompt_tokens` and
`completion_tokens` with `per_verified` (each divided by verified slots; a slot is emitted once per mode),
`mean_chain_length` (gold calls per verified slot), `tools_covered` (distinct tools the verified golds call,
summed over environments) and `tool_coverage` (over the tools of the environments the method ran on); for graph
also `chains_dropped` (the sampler's and verifier's reasons). The graph method's usage is what its own requests
cost; the llm method's is the rest of the stage's (the stage makes no other model calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from builder.records import Environment, Rejection, Scenario
from builder.reports import MethodFigures, ScenariosReport
from builder.run.stage import StageContext
from builder.stages.scenarios.family_stats import derive_families
from builder.stats import StageStats
from builder.usage import Usage

USAGE = ("calls", "prompt_tokens", "completion_tokens")


def report_methods(
    ctx: StageContext,
    env: Environment,
    outcomes: Sequence[tuple[str, list[Scenario] | Rejection]],
    graph_usage: Usage,
    chains_dropped: Mapping[str, int],
    fell_back: Sequence[list[Scenario] | Rejection] = (),
) -> None:
    """Count one environment's slots (method, what the slot made) in the report; `graph_usage` is what its graph
    requests cost. `fell_back` are what the llm method made for graph slots that had no chain (method both): each
    counts as a graph slot not verified (`fell_back_to_llm`) and as an llm slot with its own outcome. The rates
    and costs per verified slot are `derive_report`'s."""
    methods = ctx.stats.report.methods
    for method in ("llm", "graph"):
        made = [result for name, result in outcomes if name == method]
        if method == "graph":
            made = [result for result in made if not any(result is other for other in fell_back)]
        if method == "llm":
            made += list(fell_back)
        if made:
            _count(methods.setdefault(method, MethodFigures()), made, env)
    if fell_back:
        graph = methods.setdefault("graph", MethodFigures())
        graph.slots += len(fell_back)
        graph.fell_back_to_llm += len(fell_back)
        graph.fell_back_verified += sum(not isinstance(result, Rejection) for result in fell_back)
    if "graph" in methods:
        graph = methods["graph"]
        for name in USAGE:
            setattr(graph, name, getattr(graph, name) + getattr(graph_usage, name))
        for reason, count in chains_dropped.items():
            graph.chains_dropped[reason] = graph.chains_dropped.get(reason, 0) + count


def _count(entry: MethodFigures, made: Sequence[list[Scenario] | Rejection], env: Environment) -> None:
    verified = [result[0] for result in made if not isinstance(result, Rejection)]
    entry.slots += len(made)
    entry.verified += len(verified)
    entry.template_worded += sum(scenario.wording == "template" for scenario in verified)
    entry.gold_calls += sum(len(scenario.gold_actions) for scenario in verified)
    entry.tools_covered += len({action.name for scenario in verified for action in scenario.gold_actions})
    entry.tools_offered += len(env.tools)


def derive_report(stats: StageStats) -> None:
    """The stage's derived figures from its counters (`ItemStage.derive`): `per_verified_slot` (the stage's model
    usage per verified slot: the figure the prompt budget is sized against), the llm method's usage (the stage's
    less the graph method's) and each method's rates and costs per verified slot."""
    report: ScenariosReport = stats.report  # type: ignore[assignment]
    if slots := report.verified_slots:
        report.per_verified_slot = {
            name: round(getattr(stats.usage, name) / slots, 2 if name == "calls" else 1) for name in USAGE
        }
    methods = report.methods
    if "llm" in methods:
        spent_by_graph = methods.get("graph", MethodFigures())
        for name in USAGE:
            setattr(methods["llm"], name, max(0, getattr(stats.usage, name) - getattr(spent_by_graph, name)))
    for entry in methods.values():
        _derive(entry)
    derive_families(report)


def _derive(entry: MethodFigures) -> None:
    verified = entry.verified
    entry.yield_ = round(verified / entry.slots, 4) if entry.slots else None
    entry.per_verified = {name: round(getattr(entry, name) / verified, 1) for name in USAGE} if verified else None
    entry.mean_chain_length = round(entry.gold_calls / verified, 2) if verified else None
    offered = entry.tools_offered
    entry.tool_coverage = round(entry.tools_covered / offered, 4) if offered else None
