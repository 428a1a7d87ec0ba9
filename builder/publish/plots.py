"""PNG plots for the dataset card: domains, tools per environment, tool dependency graphs, pass rates, rewards, turns
and token lengths.

Counts and rates that take few values (a pass rate of k rollouts, tools, turns) get one bar per value, so no
bin merges two of them; token lengths, which take many, a histogram.

Uses matplotlib's object API (`Figure` with the Agg canvas), never `pyplot`, so nothing global is touched and
no display is needed. PNGs are written without a software/date stamp, so equal data gives equal files.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from builder.publish.tokens import TokenStats

ASSETS = "assets"


def write_plots(
    tables: dict[str, dict[str, pl.DataFrame]], root: Path, tokens: TokenStats | None = None
) -> dict[str, str]:
    """Write the plots under `root/assets/`; returns `{title: relative path}` for the card, in display order. The
    token-length plot is there when `tokens` (the `sft` rows' lengths) is."""
    environments = pl.concat(list(tables["environments"].values()))
    scenarios = pl.concat(list(tables["scenarios"].values()))
    sft = tables["sft"]["train"]
    folder = root / ASSETS
    folder.mkdir(parents=True, exist_ok=True)
    plots = {
        "Environments per domain": ("domains.png", _bars(Counter(environments["domain"].to_list()), "environments")),
        "Tools per environment": ("tools_per_environment.png", _value_bars(environments["num_tools"], "tools")),
        "Tool dependency graphs": ("tool_graphs.png", _graphs(environments["graph"].drop_nulls().to_list())),
        "Scenario pass rate of the rollouts": (
            "pass_rates.png",
            _value_bars(scenarios["pass_rate"], "pass rate (share of rollouts solved)"),
        ),
        "Reward of SFT trajectories": ("rewards.png", _value_bars(sft["reward"], "reward")),
        "Assistant turns per SFT trajectory": ("turns.png", _value_bars(sft["num_turns"], "assistant turns")),
    }
    if tokens is not None:
        xlabel = f"tokens ({tokens.tokenizer} tokenizer, packaged chat template)"
        plots["Token length of SFT rows"] = ("token_lengths.png", _histogram(pl.Series(tokens.lengths), xlabel))
    written = {}
    for title, (name, figure) in plots.items():
        figure.suptitle(title)
        FigureCanvasAgg(figure).print_png(folder / name, metadata={"Software": None})
        written[title] = f"{ASSETS}/{name}"
    return written


def _bars(counts: Counter, ylabel: str) -> Figure:
    figure = Figure(figsize=(6, 3.2), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    labels = sorted(counts, key=lambda label: (-counts[label], label))[:30]
    axes.bar(range(len(labels)), [counts[label] for label in labels])
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    axes.set_ylabel(ylabel)
    if not labels:
        _no_data(axes)
    return figure


def _value_bars(values: pl.Series, xlabel: str) -> Figure:
    """One bar per distinct value (rounded to 4 places, so 1/3 from two runs is one value), in value order."""
    figure = Figure(figsize=(6, 3.2), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    counts = Counter(round(float(value), 4) for value in values.drop_nulls().to_list())
    keys = sorted(counts)
    axes.bar(range(len(keys)), [counts[key] for key in keys], width=0.6)
    axes.set_xticks(range(len(keys)), [value_label(key) for key in keys], fontsize=8)
    axes.set_xlim(-0.75, max(len(keys), 4) - 0.25)  # a lone value stays a bar, not a slab
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not keys:
        _no_data(axes)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("count")
    return figure


TOOL_ROLES = ("feeds and is fed", "feeds only", "is fed only", "no data edge")


def tool_roles(graph: dict) -> Counter:
    """The tools of one graph by their data edges: whether a result of theirs feeds another tool's parameter,
    whether one of their parameters is fed by another tool's result, both, or neither."""
    data = [edge for edge in graph["edges"] if edge["kind"] == "data"]
    roles: Counter = Counter()
    for node in graph["nodes"]:
        feeds = any(edge["source"] == node["name"] for edge in data)
        fed = any(edge["target"] == node["name"] for edge in data)
        roles[{(True, True): TOOL_ROLES[0], (True, False): TOOL_ROLES[1], (False, True): TOOL_ROLES[2],
               (False, False): TOOL_ROLES[3]}[(feeds, fed)]] += 1  # fmt: skip
    return roles


def _graphs(graphs: list[str]) -> Figure:
    """Left: the graphs' edges by kind; right: their tools by data edges (what chains of calls can be made of)."""
    figure = Figure(figsize=(8, 3.2), dpi=100, layout="constrained")
    edges_axes, tools_axes = figure.subplots(1, 2)
    decoded = [json.loads(text) for text in graphs]
    kinds = Counter(edge["kind"] for graph in decoded for edge in graph["edges"])
    roles = sum((tool_roles(graph) for graph in decoded), Counter())
    edges_axes.bar(range(2), [kinds["data"], kinds["state"]], width=0.6)
    edges_axes.set_xticks(range(2), ["data (result → parameter)", "state (write → read)"], fontsize=8)
    edges_axes.set_ylabel("edges")
    tools_axes.bar(range(len(TOOL_ROLES)), [roles[role] for role in TOOL_ROLES], width=0.6)
    tools_axes.set_xticks(range(len(TOOL_ROLES)), TOOL_ROLES, rotation=20, ha="right", fontsize=8)
    tools_axes.set_ylabel("tools")
    for axes in (edges_axes, tools_axes):
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        if not decoded:
            _no_data(axes)
    return figure


def value_label(value: float) -> str:
    """`1`, `0.5`, `0.3333`: a value as short as it is exact to 4 places."""
    return f"{value:.4f}".rstrip("0").rstrip(".")


def _histogram(values: pl.Series, xlabel: str) -> Figure:
    figure = Figure(figsize=(6, 3.2), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    data = [float(value) for value in values.drop_nulls().to_list()]
    if data:
        axes.hist(data, bins=min(20, max(1, len(set(data)))))
    else:
        _no_data(axes)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("count")
    return figure


def _no_data(axes) -> None:
    axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
