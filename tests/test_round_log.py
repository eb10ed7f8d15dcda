"""The round log and metrics.json: a round costs one short append, and nothing shows a round before its checkpoint."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

import pytest

from fedhog import results, server_app
from fedhog.checkpoint import Checkpoint, CheckpointError, checkpointed_rounds, load_checkpoint, save_checkpoint
from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.engines.inprocess import run_in_process
from fedhog.engines.vectorized import run_vectorized
from fedhog.results import ROUND_LOG, ResultsWriter, read_round_log


@dataclass
class _Round:
    round: int
    epsilon: float
    accuracy: float


def _writer(tmp_path, rounds=None) -> ResultsWriter:
    return ResultsWriter(tmp_path / "run", RunConfig(), rounds=rounds)


def test_each_round_is_appended_with_its_floats_exact(tmp_path):
    writer = _writer(tmp_path)
    writer.add_round(_Round(1, math.inf, math.nan))
    writer.add_round(_Round(2, 0.1 + 0.2, 1 / 3))
    rows = read_round_log(writer.directory, 2)
    assert rows[0]["epsilon"] == math.inf and math.isnan(rows[0]["accuracy"])
    assert rows[1] == {"round": 2, "epsilon": 0.1 + 0.2, "accuracy": 1 / 3}  # not rounded by any printing
    assert writer.rounds_logged == 2


def test_metrics_json_is_rewritten_at_its_cadence_and_at_every_status_change(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "FLUSH_SECONDS", 3600.0)
    writer = _writer(tmp_path)
    assert writer.add_round(_Round(1, 0.5, 0.1)) is False  # the first round after the writer's own first write
    assert writer.add_round(_Round(2, 0.6, 0.2)) is False
    assert json.loads(writer.metrics_path.read_text())["rounds"] == []
    assert len((writer.directory / ROUND_LOG).read_text().splitlines()) == 2
    writer.update(status="finished")
    assert [r["round"] for r in json.loads(writer.metrics_path.read_text())["rounds"]] == [1, 2]
    monkeypatch.setattr(results, "FLUSH_SECONDS", 0.0)
    assert writer.add_round(_Round(3, 0.7, 0.3)) is True
    assert len(json.loads(writer.metrics_path.read_text())["rounds"]) == 3


def test_a_resumed_writer_keeps_the_rounds_and_rewrites_the_log_with_them_alone(tmp_path):
    writer = _writer(tmp_path)
    for n in (1, 2, 3):
        writer.add_round(_Round(n, 0.1 * n, 0.5))
    kept = read_round_log(writer.directory, 2)  # a checkpoint after round 2: round 3 is not the run's
    resumed = _writer(tmp_path, rounds=kept)
    assert read_round_log(resumed.directory, 2) == kept
    assert len((resumed.directory / ROUND_LOG).read_text().splitlines()) == 2
    assert json.loads(resumed.metrics_path.read_text())["rounds"] == kept


def test_checkpointed_rounds_read_the_log_then_the_checkpoints_own(tmp_path):
    writer = _writer(tmp_path)
    for n in (1, 2):
        writer.add_round(_Round(n, 0.1 * n, 0.5))
    own = {"round": 3, "epsilon": 0.3, "accuracy": 0.5}
    checkpoint = Checkpoint(round=3, model={}, accountant={}, rounds=[own], rounds_logged=2)
    assert [r["round"] for r in checkpointed_rounds(writer.directory, checkpoint)] == [1, 2, 3]
    old_style = Checkpoint(round=1, model={}, accountant={}, rounds=[{"round": 1}])  # every round inside
    assert checkpointed_rounds(writer.directory, old_style) == [{"round": 1}]
    (writer.directory / ROUND_LOG).write_text((writer.directory / ROUND_LOG).read_text().splitlines()[0])
    lost = r"cannot resume round 4: .*rounds\.jsonl holds 0 whole rounds, 2 expected"
    with pytest.raises(CheckpointError, match=lost):
        checkpointed_rounds(writer.directory, checkpoint)


@pytest.mark.parametrize("engine", ["inprocess", "vectorized"])  # vectorized: the writes run behind the rounds
def test_nothing_shows_a_round_whose_checkpoint_was_not_written(tmp_path, monkeypatch, engine):
    """A resume draws a lost round's noise afresh: if anything had shown the lost draw, that round would be
    released twice and accounted once."""
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    config = RunConfig().with_overrides({
        "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 1.0, "rounds": 4,
        "partitioner": "iid", "mechanism": "gaussian", "noise-multiplier": 1.0,
        "results-dir": str(tmp_path / "run")})

    def failing(directory, checkpoint: Checkpoint):
        if checkpoint.round == 2:
            raise OSError("disk full")
        return save_checkpoint(directory, checkpoint)

    monkeypatch.setattr(server_app, "save_checkpoint", failing)
    run = ((lambda: run_in_process(server_app.app, client_app, config.population, config.to_mapping()))
           if engine == "inprocess" else lambda: run_vectorized(server_app.app, client_app, config))
    lines: list[str] = []
    seen = logging.Handler(logging.INFO)
    seen.emit = lambda record: lines.append(record.getMessage())  # Flower's logger, whatever its propagation
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.addHandler(seen)
    flower.setLevel(logging.INFO)
    try:
        with pytest.raises(OSError, match="disk full"):
            run()
    finally:
        flower.removeHandler(seen)
        flower.setLevel(level)
    folder = tmp_path / "run"
    assert load_checkpoint(folder).round == 1
    assert [r["round"] for r in json.loads((folder / "metrics.json").read_text())["rounds"]] == [1]
    assert len((folder / ROUND_LOG).read_text().splitlines()) == 1
    shown = "\n".join(lines)
    assert "round 1: accuracy" in shown and "round 2: accuracy" not in shown
