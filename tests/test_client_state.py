"""A DP-SGD client's accountant on its own disk (``fedhog.client_state``) and the replies it sends."""

from __future__ import annotations

import json
import logging
import os
import stat
import uuid

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import MessageType

from fedhog import protocol
from fedhog.client_app import app as client_app
from fedhog.client_state import (
    accountant_path,
    load_accountant_state,
    save_accountant_state,
    state_dir,
)
from fedhog.config import RunConfig
from fedhog.data import dataset_info
from fedhog.dpsgd import record_privacy
from fedhog.engines.inprocess import InProcessGrid
from fedhog.models import build_model

logging.getLogger("absl").setLevel(logging.ERROR)

JOB = uuid.uuid4().hex
COUNTS = (protocol.NUM_EXAMPLES, "local-steps", "dpsgd-steps")


@pytest.mark.parametrize("job_id", [
    "../x", "../" + "0" * 29, "/tmp/" + "a" * 27, "A" * 32, "a" * 31, "a" * 33, "a" * 32 + "\n", "g" * 32,
    None, 123, b"a" * 32,
])
def test_a_job_id_that_could_leave_the_state_dir_is_refused(tmp_path, job_id):
    with pytest.raises(ValueError, match=r"job-id=.* is not allowed; expected 32 lowercase hex characters"):
        accountant_path(tmp_path, job_id, 0)


def test_the_accountant_file_is_named_by_job_and_partition_inside_the_state_dir(tmp_path):
    path = accountant_path(tmp_path, JOB, 3)
    assert path == tmp_path / JOB / "partition-3.json"
    assert path.resolve().is_relative_to(tmp_path.resolve())


@pytest.mark.parametrize("partition_id", [-1, True, "1", 1.0])
def test_a_bad_partition_id_is_refused(tmp_path, partition_id):
    with pytest.raises(ValueError, match="partition-id="):
        accountant_path(tmp_path, JOB, partition_id)


def test_the_node_config_state_dir_overrides_fedhog_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    assert state_dir({"partition-id": 0}) == tmp_path / "cache" / "client-state"
    assert state_dir({"partition-id": 0, "state-dir": str(tmp_path / "node")}) == tmp_path / "node"
    monkeypatch.delenv("FEDHOG_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert state_dir({}) == tmp_path / "home" / ".cache" / "fedhog" / "client-state"


@pytest.mark.parametrize("value", ["", "  ", 3, True])
def test_a_bad_state_dir_is_refused_by_name(value):
    with pytest.raises(ValueError, match=r"node config state-dir=.* is not allowed; expected a directory path"):
        state_dir({"state-dir": value})


def test_the_state_round_trips_atomically_in_a_private_directory(tmp_path):
    path = accountant_path(tmp_path, JOB, 0)
    assert load_accountant_state(path) is None
    state = {"mechanism": "prv", "history": [[1.0, 0.1, 10], [1.0, 0.1, 10]]}
    save_accountant_state(path, state)
    save_accountant_state(path, {**state, "history": state["history"][:1]})  # replaced, not appended
    assert load_accountant_state(path) == {**state, "history": state["history"][:1]}
    assert os.listdir(path.parent) == [path.name]  # no temporary file left behind
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0


def test_a_corrupt_state_is_an_error_naming_the_file(tmp_path):
    path = accountant_path(tmp_path, JOB, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"mechanism": "prv", "hist')
    with pytest.raises(ValueError, match=f"{path} is not valid JSON.*restore it"):
        load_accountant_state(path)


# --- the ClientApp -----------------------------------------------------------

CONFIG = RunConfig().with_overrides({
    "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 0.5, "partitioner": "iid",
    "mechanism": "gaussian", "client-dp": "dpsgd", "local-epochs": 1, "batch-size": 32, "privacy-seed": 5,
})


@pytest.fixture
def grid(fresh_cache) -> InProcessGrid:
    return InProcessGrid(client_app, CONFIG.population, CONFIG.to_mapping())


def _train(grid: InProcessGrid, node: int, server_round: int, job_id: str | None = JOB,
           config: RunConfig = CONFIG) -> Message:
    """One train instruction as the server sends it, answered by ``node``'s ClientApp (with ``config``)."""
    grid.contexts[node].run_config = config.to_mapping()
    torch.manual_seed(0)
    model = build_model(config.model, *dataset_info(config.data_spec))
    settings = ConfigRecord({protocol.SERVER_ROUND: server_round, **({protocol.JOB_ID: job_id} if job_id else {})})
    message = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": settings}),
                      dst_node_id=node, message_type=MessageType.TRAIN)
    return next(iter(grid.send_and_receive([message])))


def _fresh_context(grid: InProcessGrid, node: int) -> None:
    """Forget the node's in-memory state, as a restarted SuperNode or ClientApp process would."""
    old = grid.contexts[node]
    grid.contexts[node] = Context(run_id=old.run_id, node_id=old.node_id, node_config=dict(old.node_config),
                                  state=RecordDict(), run_config=dict(old.run_config))


def test_a_dpsgd_reply_carries_no_record_counts(grid):
    node = next(iter(grid.contexts))
    reply = _train(grid, node, 1)
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content[protocol.METRICS]
    assert set(metrics) == {protocol.PARTITION_ID, "dpsgd-epsilon"}
    assert not set(COUNTS) & set(metrics)
    assert 0 < metrics["dpsgd-epsilon"] < float("inf")


def test_a_reply_without_dpsgd_still_carries_its_record_count(grid):
    node = next(iter(grid.contexts))
    reply = _train(grid, node, 1, config=CONFIG.with_overrides({"client-dp": "none"}))
    assert not reply.has_error(), reply.error.reason
    metrics = reply.content[protocol.METRICS]
    assert metrics[protocol.NUM_EXAMPLES] > 0 and metrics["local-steps"] > 0


def test_the_accountant_survives_a_restarted_client_and_is_kept_per_job(grid, tmp_path):
    node = next(iter(grid.contexts))
    partition = int(grid.contexts[node].node_config["partition-id"])
    first = _train(grid, node, 1).content[protocol.METRICS]["dpsgd-epsilon"]
    path = accountant_path(tmp_path / "cache" / "client-state", JOB, partition)
    one_round = json.loads(path.read_text())
    _fresh_context(grid, node)
    second = _train(grid, node, 2).content[protocol.METRICS]["dpsgd-epsilon"]
    two_rounds = json.loads(path.read_text())

    assert len(two_rounds["history"]) == 1 and two_rounds["history"][0][2] == 2 * one_round["history"][0][2]
    assert second > first
    assert second == record_privacy(CONFIG.dpsgd_settings, two_rounds).epsilon
    another_run = InProcessGrid(client_app, CONFIG.population, CONFIG.to_mapping())  # the same node ids
    other_job = _train(another_run, node, 2, job_id=uuid.uuid4().hex).content[protocol.METRICS]["dpsgd-epsilon"]
    assert other_job == first  # a new job starts a new accountant


def test_the_node_config_state_dir_receives_the_accountant(grid, tmp_path):
    node = next(iter(grid.contexts))
    grid.contexts[node].node_config["state-dir"] = str(tmp_path / "node-state")
    assert not _train(grid, node, 1).has_error()
    partition = int(grid.contexts[node].node_config["partition-id"])
    assert accountant_path(tmp_path / "node-state", JOB, partition).is_file()
    assert not (tmp_path / "cache" / "client-state").exists()


@pytest.mark.parametrize("job_id", [None, "../escape"])
def test_a_dpsgd_instruction_without_a_valid_job_id_is_refused(grid, tmp_path, job_id):
    reply = _train(grid, next(iter(grid.contexts)), 1, job_id=job_id)
    expected = "lacks 'job-id'" if job_id is None else f"job-id={job_id!r} is not allowed"
    assert reply.has_error() and expected in reply.error.reason
    assert not any(tmp_path.rglob("*.json"))
