"""simulations/sweep_finals.py reads a sweep's results.csv: each cell's last round, pooled over seeds, and its share
of a reference variant paired on seed."""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

import pytest
from helpers import load_simulation


@pytest.fixture(scope="module")
def sweep_finals():
    return load_simulation("sweep_finals")


ROWS = [  # cell_id, seed, round, accuracy: rows out of order, round 0 included, as results.csv may hold them
    ("dp__model=cnn__eps=3__seed=0", 0, 2, 0.60), ("dp__model=cnn__eps=3__seed=0", 0, 0, 0.10),
    ("dp__model=cnn__eps=3__seed=0", 0, 1, 0.50), ("dp__model=cnn__eps=3__seed=1", 1, 2, 0.40),
    ("dp__model=cnn__eps=3__seed=1", 1, 1, 0.45), ("none__model=cnn__seed=0", 0, 2, 0.90),
    ("none__model=cnn__seed=1", 1, 2, 0.80), ("none__model=mlp__seed=0", 0, 2, 0.70),
]


def _write(folder: Path) -> Path:
    path = folder / "results.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["cell_id", "seed", "round", "accuracy"])
        writer.writerows(ROWS)
    return path


def test_each_cell_ends_at_its_last_round_and_seeds_pool_by_condition(tmp_path, sweep_finals):
    groups = sweep_finals.finals(_write(tmp_path), "accuracy")
    assert groups == {"dp__model=cnn__eps=3": {0: 0.60, 1: 0.40}, "none__model=cnn": {0: 0.90, 1: 0.80},
                      "none__model=mlp": {0: 0.70}}
    # the reference's condition must be part of the row's: the CNN's ceiling, not the MLP's
    assert sweep_finals.reference_of("dp__model=cnn__eps=3", "none", groups) == "none__model=cnn"
    assert sweep_finals.reference_of("none__model=cnn", "none", groups) is None  # its own variant: no share


def test_the_table_gives_paired_shares_and_the_ratio_of_means(tmp_path, sweep_finals, monkeypatch, capsys):
    _write(tmp_path)
    monkeypatch.setattr(sys, "argv", ["sweep_finals.py", str(tmp_path), "--reference", "none"])
    sweep_finals.main()
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| dp__"))
    shares = [0.60 / 0.90, 0.40 / 0.80]
    assert f"{statistics.mean(shares):.4f} ± {statistics.stdev(shares):.4f} (n = 2)" in row
    assert f"{0.50 / 0.85:.4f}" in row and "0: 0.600, 1: 0.400" in row
