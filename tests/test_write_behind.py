"""A round's writes behind the next round's training: in order, stopped by the first failure, and really behind."""

from __future__ import annotations

import threading

import pytest

from fedhog import server_app
from fedhog.checkpoint import load_checkpoint, save_checkpoint
from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.engines.cohort import CohortTrainer
from fedhog.engines.vectorized import run_vectorized
from fedhog.results import ResultsWriter
from fedhog.write_behind import WriteBehind


def test_jobs_run_in_order_and_the_first_failure_stops_the_rest_and_is_raised():
    done: list[int] = []
    writes = WriteBehind(depth=1)
    for k in range(5):
        writes.submit(lambda k=k: done.append(k))
    writes.drain()
    assert done == [0, 1, 2, 3, 4]

    def fail() -> None:
        raise OSError("disk full")

    writes.submit(fail)
    writes.submit(lambda: done.append(5))  # queued before the failure was seen: skipped, not run
    with pytest.raises(OSError, match="disk full"):
        writes.drain()
    with pytest.raises(OSError, match="disk full"):
        writes.submit(lambda: done.append(6))
    with pytest.raises(OSError, match="disk full"):
        writes.close()
    assert done == [0, 1, 2, 3, 4]
    assert not writes._worker.is_alive()  # a sweep's runs leave no thread behind


def test_close_runs_what_was_submitted_then_ends_the_worker():
    done: list[int] = []
    writes = WriteBehind()
    writes.submit(lambda: done.append(1))
    writes.close()
    assert done == [1] and not writes._worker.is_alive()


def test_the_vectorized_engine_writes_a_round_while_the_next_one_trains_and_shows_it_after_its_checkpoint(
        tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    config = RunConfig().with_overrides({
        "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 1.0, "rounds": 3,
        "partitioner": "iid", "mechanism": "gaussian", "noise-multiplier": 1.0,
        "results-dir": str(tmp_path / "run")})
    events: list[str] = []
    trainings, second_round_trains = [0], threading.Event()
    train, add_round = CohortTrainer.train, ResultsWriter.add_round

    def training(self, *args, **kwargs):
        trainings[0] += 1
        events.append(f"train {trainings[0]}")
        if trainings[0] == 2:
            second_round_trains.set()
        return train(self, *args, **kwargs)

    def checkpointing(directory, checkpoint):
        if checkpoint.round == 1:  # round 1's checkpoint is written while round 2 trains (it would wait forever)
            assert second_round_trains.wait(timeout=120), "round 2 did not start before round 1 was written"
        save_checkpoint(directory, checkpoint)
        events.append(f"checkpoint {checkpoint.round}")

    def showing(writer, record):
        assert load_checkpoint(writer.directory).round == record.round
        events.append(f"show {record.round}")
        return add_round(writer, record)

    monkeypatch.setattr(CohortTrainer, "train", training)
    monkeypatch.setattr(server_app, "save_checkpoint", checkpointing)
    monkeypatch.setattr(ResultsWriter, "add_round", showing)
    run_vectorized(server_app.app, client_app, config)
    writes = [e for e in events if not e.startswith("train")]
    assert writes == ["checkpoint 1", "show 1", "checkpoint 2", "show 2", "checkpoint 3", "show 3"]
    assert events.index("train 2") < events.index("checkpoint 1")
