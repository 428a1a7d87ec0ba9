"""PNG plots for the dataset card: domains, tools per environment, pass rates, rewards, turns and token lengths.

Counts and rates that take few values (a pass rate of k rollouts, tools, turns) get one bar per value, so no
bin merges two of them; token lengths, which take many, a histogram.

Uses matplotlib's object API (`Figure` with the Agg canvas), never `pyplot`, so nothing global is touched and
no display is needed. PNGs are written without a software/date stamp, so equal data gives equal files.
"""

from __future__ import annotations

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
