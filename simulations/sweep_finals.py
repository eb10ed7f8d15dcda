"""Each seed's final value in a finished sweep, and a variant's share of a reference variant (e.g. of no DP).

Reads ``results.csv`` of a sweep's output folder (``fedhog sweep`` writes it)
and prints one Markdown row per variant and condition: the final value of
``--metric`` (the last round's, on the test set) of every seed, their mean ±
sample std (n − 1), and with ``--reference`` the share of the reference
variant's value — per seed (paired: the same data, initial model, cohorts and
noise draws) and as the ratio of the means. A reference cell matches a row
when its condition is part of the row's (``no-dp__model=cnn1d`` is the
reference of ``dp-fedavgm__model=cnn1d__target-epsilon=3.0``). It runs
nothing: the goals of issue 21 (≥ 85 % of the non-private accuracy at ε = 8)
are read from here.

Usage::

    python simulations/sweep_finals.py results/sweeps/convergence --reference no-dp
    python simulations/sweep_finals.py results/sweeps/fraud --metric auprc --reference no-dp
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from pathlib import Path


def finals(results: Path, metric: str) -> dict[str, dict[int, float]]:
    """``{cell id without its seed: {seed: the metric after the cell's last round}}``."""
    last: dict[str, tuple[int, dict[str, str]]] = {}
    for row in csv.DictReader(results.open()):
        round_ = int(row["round"])
        if row["cell_id"] not in last or round_ > last[row["cell_id"]][0]:
            last[row["cell_id"]] = (round_, row)
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for cell_id, (_, row) in last.items():
        group = "__".join(part for part in cell_id.split("__") if not part.startswith("seed="))
        out[group][int(row["seed"])] = float(row[metric])
    return dict(out)


def reference_of(group: str, reference: str, groups: dict[str, dict[int, float]]) -> str | None:
    """The ``reference`` variant's group whose condition is part of ``group``'s, if exactly one."""
    parts = set(group.split("__")[1:])
    matches = [name for name in groups
               if name.split("__")[0] == reference and set(name.split("__")[1:]) <= parts and name != group]
    return matches[0] if len(matches) == 1 else None


def _mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else float("nan")
    return f"{statistics.mean(values):.4f} ± {std:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep's output folder (holding results.csv)")
    parser.add_argument("--metric", default="accuracy", help="a column of results.csv (default: accuracy)")
    parser.add_argument("--reference", help="a variant to divide by, e.g. no-dp")
    args = parser.parse_args()
    groups = finals(args.folder / "results.csv", args.metric)
    header = ["cell (seeds pooled)", "n", f"final {args.metric} per seed", "mean ± std"]
    if args.reference:
        header += [f"share of {args.reference}, per seed (mean ± std)", "ratio of the means"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for group, by_seed in sorted(groups.items()):
        seeds = sorted(by_seed)
        values = [by_seed[seed] for seed in seeds]
        cells = [group, str(len(values)), ", ".join(f"{seed}: {by_seed[seed]:.3f}" for seed in seeds),
                 _mean_std(values)]
        if args.reference:
            ref = reference_of(group, args.reference, groups)
            paired = [seed for seed in seeds if ref is not None and seed in groups[ref]]
            if ref is None or not paired:
                cells += ["–", "–"]
            else:
                shares = [by_seed[seed] / groups[ref][seed] for seed in paired]
                cells += [f"{_mean_std(shares)} (n = {len(shares)})",
                          f"{statistics.mean(values) / statistics.mean(groups[ref].values()):.4f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
