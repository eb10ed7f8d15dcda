"""The sweep's plots (matplotlib, imported when plotting): accuracy against round, final accuracy against ε."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .spec import PRIVACY_KEYS, key_values
from .stats import final_rows, group_rows, mean_std


def plot_accuracy_vs_round(rows: Sequence[dict[str, Any]], condition_keys: Sequence[str], path: Path,
                           metric: str = "accuracy") -> None:
    """One panel per condition, one line per variant: the mean test ``metric`` over seeds, band = ± std."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    conditions = group_rows(rows, condition_keys)
    columns = min(len(conditions), 3) or 1
    lines = -(-max(len(conditions), 1) // columns)
    figure = Figure(figsize=(4.5 * columns, 3.4 * lines), layout="constrained")
    figure.suptitle(f"test {metric}: mean over seeds, band ± std", fontsize=10)
    axes = figure.subplots(lines, columns, squeeze=False, sharey=True).ravel()
    for axis, (values, group) in zip(axes, conditions.items(), strict=False):
        for variant, variant_rows in group_rows(group, ["variant"]).items():
            by_round = group_rows(variant_rows, ["round"])
            rounds = sorted(r for (r,) in by_round)
            mean, std = np.array([mean_std([row[metric] for row in by_round[(r,)]]) for r in rounds]).T
            axis.plot(rounds, mean, marker=".", label=variant[0])
            axis.fill_between(rounds, mean - np.nan_to_num(std), mean + np.nan_to_num(std), alpha=0.2)
        axis.set_title(", ".join(key_values(condition_keys, values)) or "all cells", fontsize=9)
        axis.set_xlabel("round")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel(f"test {metric}")
        axis.legend(fontsize=7)
    for axis in axes[len(conditions):]:
        axis.set_axis_off()
    figure.savefig(path, dpi=110)


def plot_accuracy_vs_epsilon(rows: Sequence[dict[str, Any]], condition_keys: Sequence[str], path: Path,
                             metric: str = "accuracy") -> None:
    """The final test ``metric`` against the final ε (means over seeds), error bars = std over seeds.

    One line per variant and per value of the condition keys that do not set ε
    (all but ``target-epsilon`` and ``noise-multiplier``); one point per condition.
    A variant without a DP guarantee (ε = ∞) is a horizontal line, band ± std.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    series_keys = [key for key in condition_keys if key not in PRIVACY_KEYS]

    figure = Figure(figsize=(5.5, 4), layout="constrained")
    axis = figure.subplots()
    last = final_rows(rows)
    finals = [row for row in last if math.isfinite(row["epsilon"])]
    unbounded = [row for row in last if not math.isfinite(row["epsilon"])]
    ticks: set[float] = set()
    for index, (series, group) in enumerate(group_rows(unbounded, ["variant", *series_keys]).items()):
        mean, std = mean_std([row[metric] for row in group])
        label = ", ".join([f"{series[0]} (ε = ∞)", *key_values(series_keys, series[1:])])
        axis.axhline(mean, linestyle=("--", ":", "-.")[index % 3], linewidth=1, color="0.2", label=label)
        axis.axhspan(mean - np.nan_to_num(std), mean + np.nan_to_num(std), color="0.2", alpha=0.08)
    for series, group in group_rows(finals, ["variant", *series_keys]).items():
        points = []
        for condition in group_rows(group, condition_keys).values():
            mean, std = mean_std([row[metric] for row in condition])
            points.append((float(np.mean([row["epsilon"] for row in condition])), mean, std))
        x, y, error = np.array(sorted(points)).T
        ticks.update(round(float(value), 2) for value in x)
        label = ", ".join([series[0], *key_values(series_keys, series[1:])])
        axis.errorbar(x, y, yerr=np.nan_to_num(error), marker="o", capsize=3, label=label)
    if finals or unbounded:
        axis.legend(fontsize=7)
    if finals:
        axis.set_xscale("log")
        axis.set_xticks(sorted(ticks))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
    else:
        axis.text(0.5, 0.5, "no finished cell with a finite ε", ha="center", transform=axis.transAxes)
    axis.set_xlabel("ε (client-level, after the last round)")
    axis.set_ylabel(f"final test {metric} (mean ± std over seeds)")
    figure.savefig(path, dpi=110)
