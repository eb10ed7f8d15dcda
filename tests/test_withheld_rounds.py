"""No release without contributions: a round whose sampled clients sent nothing acceptable does not move the model
(no noise is drawn, the server optimizer keeps its state), is still accounted, and three in a row stop the run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedhog.checkpoint import load_checkpoint
from fedhog.config import RunConfig
from fedhog.engine import run_in_process
from fedhog.server_app import app as server_app
from fedhog.server_optimizer import ServerOptimizer, ServerOptimizerSettings
from fedhog.strategy import MAX_WITHHELD_IN_A_ROW

from test_strategy_replies import (GLOBAL_FLAT, NODES, as_record, bad_record, flat_of, make_aggregator,  # noqa: F401
                                   reply, server_identity)


def _all_bad(aggregator, sent):
    return aggregator.aggregate_train(1, [reply(sent[node], records=bad_record("nan")) for node in sent])


def test_a_round_of_rejected_replies_keeps_the_model_and_is_still_accounted():
    aggregator, sent = make_aggregator(sigma=1.0, eta=1.0)
    arrays, metrics = _all_bad(aggregator, sent)
    np.testing.assert_array_equal(flat_of(arrays), GLOBAL_FLAT)  # exactly: no noise was added (σ = 1)
    record = aggregator.current
    assert record.clients_sampled == 4 and record.clients_accepted == 0 and record.clients_rejected == 4
    assert record.failure.startswith("no accepted contribution (4 sampled, rejected: non-finite values ×4")
    assert record.noise_std == 0.0
    assert aggregator.accountant.releases == 1 and metrics["epsilon"] == pytest.approx(aggregator.accountant.epsilon())


def test_the_same_round_with_one_good_reply_releases_noise():
    """The reference for the test above: one accepted reply and σ = 1 move the model by far more than rounding."""
    aggregator, sent = make_aggregator(sigma=1.0, eta=1.0)
    replies = [reply(sent[node], records=bad_record("nan")) for node in NODES[1:4]]
    arrays, _ = aggregator.aggregate_train(1, [reply(sent[NODES[0]], np.full(9, 0.01)), *replies])
    assert aggregator.current.clients_accepted == 1 and not aggregator.current.failure
    assert np.abs(flat_of(arrays) - GLOBAL_FLAT).max() > 0.01


def test_a_withheld_round_leaves_the_server_momentum_as_it_was():
    aggregator, sent = make_aggregator(sigma=0.0)
    aggregator.server_optimizer = ServerOptimizer(ServerOptimizerSettings("momentum", 1.0, 0.9))
    aggregator.aggregate_train(1, [reply(sent[NODES[0]], np.full(9, 0.1))])
    momentum = aggregator.server_optimizer.first_moment.clone()
    messages = list(aggregator.configure_train(2, as_record(GLOBAL_FLAT), ConfigRecord(), grid=None))
    arrays, _ = aggregator.aggregate_train(2, [reply(m, records=bad_record("no update")) for m in messages])
    np.testing.assert_array_equal(flat_of(arrays), GLOBAL_FLAT)  # FedAvgM would have moved by β·m ≠ 0
    assert torch.equal(aggregator.server_optimizer.first_moment, momentum)


def test_a_poisson_round_that_samples_nobody_still_releases_the_noise():
    """Not withheld: the empty cohort is the sampler's coin, and the Poisson analysis counts its noise-only release."""
    for seed in range(100):  # a privacy seed whose round 1 samples nobody (P = 0.75⁴ ≈ 0.32 each)
        aggregator, _ = make_aggregator(sigma=1.0, sampling="poisson", rate=0.25, population=4, seed=seed)
        if not aggregator.begin_round(1, as_record(GLOBAL_FLAT)):
            break
    assert aggregator.current.clients_sampled == 0
    arrays, _ = aggregator.finish_round(1, [])
    assert not aggregator.current.failure
    assert np.abs(flat_of(arrays) - GLOBAL_FLAT).max() > 0


unusable = ClientApp()


@unusable.train()
def _train(msg: Message, context: Context) -> Message:
    """A client that trains but sends its result under a name fedhog does not read."""
    return Message(RecordDict({"weights": msg.content["arrays"], "metrics": MetricRecord({"num-examples": 5})}),
                   reply_to=msg)


@unusable.query()
def _query(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"partition-id": context.node_config["partition-id"]})}),
                   reply_to=msg)


def test_a_run_whose_rounds_release_nothing_stops_after_three_with_the_reasons(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    config = RunConfig().with_overrides({
        "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 1.0, "sampling": "fixed",
        "rounds": 10, "partitioner": "iid", "mechanism": "gaussian", "noise-multiplier": 1.0, "privacy-seed": 1,
        "results-dir": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match=f"rounds 1–{MAX_WITHHELD_IN_A_ROW} released nothing"):
        run_in_process(server_app, unusable, config.population, config.to_mapping())
    document = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert document["status"] == "failed"
    assert "malformed: no ArrayRecord 'update'" in document["error"]
    rounds = document["rounds"]
    assert len(rounds) == MAX_WITHHELD_IN_A_ROW and all(r["failure"] for r in rounds)
    assert rounds[-1]["epsilon"] > rounds[0]["epsilon"] > 0  # accounted as if released
    checkpoint = load_checkpoint(tmp_path / "run")
    assert checkpoint.round == MAX_WITHHELD_IN_A_ROW
    torch.manual_seed(config.seed)  # the ServerApp's initial model: nothing ever moved it
    from fedhog.data import dataset_info
    from fedhog.models import build_model

    initial = build_model(config.model, *dataset_info(config.data_spec)).state_dict()
    for key, value in initial.items():
        assert torch.equal(checkpoint.model[key], value), key
