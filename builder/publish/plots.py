"""PNG plots for the dataset card: domains, tools per environment, rewards and turns.

Uses matplotlib's object API (`Figure` with the Agg canvas), never `pyplot`, so nothing global is touched and
no display is needed. PNGs are written without a software/date stamp, so equal data gives equal files.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

ASSETS = "assets"


def write_plots(tables: dict[str, dict[str, pl.DataFrame]], root: Path) -> dict[str, str]:
    """Write the plots under `root/assets/`; returns `{title: relative path}` for the card, in display order."""
    environments = pl.concat(list(tables["environments"].values()))
    scenarios = pl.concat(list(tables["scenarios"].values()))
    sft = tables["sft"]["train"]
    folder = root / ASSETS
    folder.mkdir(parents=True, exist_ok=True)
    plots = {
        "Environments per domain": ("domains.png", _bars(Counter(environments["domain"].to_list()), "environments")),
        "Tools per environment": ("tools_per_environment.png", _histogram(environments["num_tools"], "tools")),
        "Scenario pass rate of the rollouts": (
            "pass_rates.png",
            _histogram(scenarios["pass_rate"].drop_nulls(), "pass rate (share of rollouts solved)"),
        ),
        "Reward of SFT trajectories": ("rewards.png", _histogram(sft["reward"], "reward")),
        "Assistant turns per SFT trajectory": ("turns.png", _histogram(sft["num_turns"], "assistant turns")),
    }
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
