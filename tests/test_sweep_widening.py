"""Tuning a user can trust: a grid widened past every choice that sits on its edge, and said when it still does.

The tuning runs are replaced by a fake objective (a validation score from the setting alone, written as a
finished run), so these tests take no training; ``test_sweep.py``'s tuned sweep widens with real runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fedhog.results import config_to_toml
from fedhog.sweep import runner as sweep_runner
from fedhog.sweep.spec import SweepError, load_sweep
from fedhog.sweep.stats import beyond_edge

SWEEP = """
output = "out"
[base]
dataset = "digits"
model = "logreg"
population = 10
sampling-rate = 0.5
rounds = 2
server-validation-fraction = 0.2
[grid]
target-epsilon = [3.0]
seed = [0]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[tune]
seeds = [7, 8]
last-rounds = 1
[tune.grid]
learning-rate = [0.1, 0.3]
local-epochs = [2, 3]
"""


@pytest.mark.parametrize("tried, value, expected", [
    ([0.1, 0.3], 0.3, 0.9), ([0.1, 0.3], 0.1, 0.0333333333333), ([0.1, 0.3, 0.9], 0.3, None),
    ([1, 2], 2, 4), ([2, 3], 2, 1), ([1, 2], 1, 0), ([-1.0, 0.0], 0.0, 1.0), ([0, 5], 0, -5), ([0.5], 0.5, None),
])
def test_one_step_beyond_the_edge_is_geometric_for_positive_values(tried, value, expected):
    result = beyond_edge(tried, value)
    assert result == (pytest.approx(expected) if isinstance(expected, float) else expected)
    assert type(result) is type(expected)  # integers stay integers


def _fake_tuning(monkeypatch, best_learning_rate: float, best_epochs: int) -> list[str]:
    """Tuning runs scored by −(log lr − log best)² − (epochs − best)²/10, a peak the grid may miss; the cells
    are not run. The ids run are returned."""
    ran = []

    def run(cell, engine):
        ran.append(cell.cell_id)
        if cell.directory.parent.name != "tuning":
            return
        config = cell.config
        score = (-math.log(config.learning_rate / best_learning_rate) ** 2
                 - (config.local_epochs - best_epochs) ** 2 / 10)
        cell.directory.mkdir(parents=True)
        (cell.directory / "config.toml").write_text(config_to_toml(config))
        (cell.directory / "metrics.json").write_text(json.dumps(
            {"status": "finished", "rounds": [{"validation_accuracy": score + 0.01 * (config.seed - 7)}]}))

    monkeypatch.setattr(sweep_runner, "_run_cell", run)
    return ran


def _sweep(tmp_path: Path, text: str = SWEEP):
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return load_sweep(path, tmp_path / "out")


def test_a_choice_on_the_edge_is_widened_until_inside(tmp_path, monkeypatch):
    """The best learning rate, 0.9, lies past the grid's edge 0.3: one geometric step reaches it, and a step
    further (2.7) confirms it is inside. local-epochs = 2 stays chosen, its next value 1 then scored worse."""
    ran = _fake_tuning(monkeypatch, best_learning_rate=0.9, best_epochs=2)
    sweep = _sweep(tmp_path, SWEEP.replace("[tune]\n", "[tune]\nwiden = 3\n"))
    sweep_runner.run_sweep(sweep, show_progress=False)
    tuned = sweep_runner.apply_tuning(_sweep(tmp_path, SWEEP.replace("[tune]\n", "[tune]\nwiden = 3\n")))
    assert tuned.choices == {("gaussian", (("target-epsilon", 3.0),)): {"learning-rate": 0.9, "local-epochs": 2}}
    settings = {t.setting for t in tuned.trials}
    assert {(("learning-rate", 0.9), ("local-epochs", 2)), (("learning-rate", 2.7), ("local-epochs", 2))} <= settings
    assert (("learning-rate", 0.3), ("local-epochs", 1)) in settings  # the other key's edge, at the choice then
    assert len(ran) == len(tuned.trials) + len(tuned.cells)  # every trial run once
    table = (sweep.output / "tuning.md").read_text().split("## How stable each choice is")[1]
    (row,) = [line for line in table.splitlines() if line.startswith("| gaussian |")]
    assert "learning-rate: 0.9, 2.7" in row and "local-epochs: 1" in row and row.endswith("| – |")  # inside now
    before = len(ran)
    sweep_runner.run_sweep(_sweep(tmp_path, SWEEP.replace("[tune]\n", "[tune]\nwiden = 3\n")), show_progress=False)
    assert len(ran) - before == len(tuned.cells)  # resumed: the widened trials are finished, only cells rerun


def test_a_choice_still_on_the_edge_after_the_limit_is_reported(tmp_path, monkeypatch):
    ran = _fake_tuning(monkeypatch, best_learning_rate=100.0, best_epochs=1)
    sweep = _sweep(tmp_path)  # widen = 2, the default
    sweep_runner.run_sweep(sweep, show_progress=False)
    text = (sweep.output / "tuning.md").read_text()
    (row,) = [line for line in text.split("## How stable")[1].splitlines() if line.startswith("| gaussian |")]
    assert "learning-rate = 2.7" in row and "learning-rate: 0.9, 2.7" in row
    assert "learning-rate (still on the edge after 2 widenings ([tune] widen, the limit))" in row
    # local-epochs: 2 → 1 chosen; its next value, 0, is refused by the config (naming the key)
    assert "local-epochs (the next value local-epochs = 0 is refused:" in row
    tuned = sweep_runner.apply_tuning(_sweep(tmp_path))
    assert len(tuned.trials) == 4 * 3 * 2  # the widened grid, whole: 4 learning rates × 3 epochs × 2 seeds
    assert len(ran) == len(tuned.trials) + len(tuned.cells)


def test_no_widening_with_widen_zero_and_bad_widen_is_refused(tmp_path, monkeypatch):
    ran = _fake_tuning(monkeypatch, best_learning_rate=100.0, best_epochs=1)
    sweep = _sweep(tmp_path, SWEEP.replace("[tune]\n", "[tune]\nwiden = 0\n"))
    sweep_runner.run_sweep(sweep, show_progress=False)
    assert len(sweep.trials) == 4 * 2 and len(ran) == 4 * 2 + len(sweep.cells)
    assert "learning-rate (not widened ([tune] widen = 0))" in (sweep.output / "tuning.md").read_text()
    for value in ("-1", "11", "1.5", "true"):
        with pytest.raises(SweepError, match=f"\\[tune\\] widen={'True' if value == 'true' else value} is not "
                                             "allowed; expected an integer in 0..10"):
            _sweep(tmp_path, SWEEP.replace("[tune]\n", f"[tune]\nwiden = {value}\n"))


@pytest.mark.slow  # four real runs: ~10 s
def test_real_tuning_runs_widen_the_grid_end_to_end(tmp_path, monkeypatch):
    """Logistic regression on digits, 2 rounds: of learning rates 0.001 and 0.01 the larger wins, so 0.1 is tried."""
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    text = SWEEP.replace("seeds = [7, 8]", "seeds = [7]\nwiden = 1").replace(
        "learning-rate = [0.1, 0.3]\nlocal-epochs = [2, 3]", "learning-rate = [0.001, 0.01]")
    sweep = _sweep(tmp_path, text)
    outcome = sweep_runner.run_sweep(sweep, show_progress=False)
    assert not outcome.failed and len(outcome.ran) == 3 + 1  # 2 trials, 1 widened, 1 cell
    tuned = sweep_runner.apply_tuning(_sweep(tmp_path, text))
    scores = {}
    for trial in tuned.trials:
        rounds = json.loads((trial.cell.directory / "metrics.json").read_text())["rounds"]
        scores[dict(trial.setting)["learning-rate"]] = rounds[-1]["validation_accuracy"]
    assert set(scores) == {0.001, 0.01, 0.1} and scores[0.01] > scores[0.001]
    (chosen,) = tuned.choices.values()
    assert scores[chosen["learning-rate"]] == max(scores.values())
    row = next(line for line in (sweep.output / "tuning.md").read_text().split("## How stable")[1].splitlines()
               if line.startswith("| gaussian |"))
    assert "learning-rate: 0.1" in row
    assert ("still on the edge after 1 widening" in row) == (chosen["learning-rate"] == 0.1)
