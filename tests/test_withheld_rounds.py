"""A round whose sampled clients sent nothing acceptable releases the noise alone (withholding it would disclose,
beyond any ε, whether one good client was sampled), is accounted and marked, and three in a row stop the run."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from helpers import read_metrics
from test_strategy_replies import GLOBAL_FLAT, NODES, bad_record, flat_of, make_aggregator, reply, round_noise

from fedhog.checkpoint import load_checkpoint
from fedhog.config import RunConfig
from fedhog.engines.inprocess import run_in_process
from fedhog.server_app import app as server_app
from fedhog.strategy import MAX_EMPTY_IN_A_ROW


def _all_bad(aggregator, sent):
    return aggregator.aggregate_train(1, [reply(sent[node], records=bad_record("nan")) for node in sent])


def test_a_round_of_rejected_replies_releases_the_noise_alone_and_is_accounted(server_identity):
    """Exactly what a round whose sum is zero releases: the mechanism's output does not depend on the rejections."""
    sigma, clip, seed = 1.0, 1.0, 11
    aggregator, sent = make_aggregator(sigma=sigma, clip=clip, eta=1.0, seed=seed)
    arrays, metrics = _all_bad(aggregator, sent)
    expected = GLOBAL_FLAT + (round_noise(seed, 1, sigma, clip) / 4).astype(np.float32)
    np.testing.assert_allclose(flat_of(arrays), expected, rtol=0, atol=1e-6)
    record = aggregator.current
    assert record.clients_sampled == 4 and record.clients_accepted == 0 and record.clients_rejected == 4
    assert record.failure.startswith("no accepted contribution (4 sampled, rejected: non-finite values ×4")
    assert record.failure.endswith("the noise alone was released")
    assert record.noise_std == pytest.approx(sigma * clip / 4, rel=1e-9)
    assert aggregator.accountant.releases == 1 and metrics["epsilon"] == pytest.approx(aggregator.accountant.epsilon())


def test_one_good_reply_among_rejected_ones_is_an_ordinary_round(server_identity):
    aggregator, sent = make_aggregator(sigma=1.0, eta=1.0)
    replies = [reply(sent[node], records=bad_record("nan")) for node in NODES[1:4]]
    arrays, _ = aggregator.aggregate_train(1, [reply(sent[NODES[0]], np.full(9, 0.01)), *replies])
    assert aggregator.current.clients_accepted == 1 and not aggregator.current.failure
    assert np.abs(flat_of(arrays) - GLOBAL_FLAT).max() > 0.01


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


def test_a_run_without_accepted_contributions_stops_after_three_rounds_with_the_reasons(tmp_path, fresh_cache):
    config = RunConfig().with_overrides({
        "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 1.0, "sampling": "fixed",
        "rounds": 10, "partitioner": "iid", "mechanism": "gaussian", "noise-multiplier": 1.0, "privacy-seed": 1,
        "results-dir": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match=f"rounds 1–{MAX_EMPTY_IN_A_ROW} had no accepted contribution"):
        run_in_process(server_app, unusable, config.population, config.to_mapping())
    document = read_metrics(tmp_path / "run")
    assert document["status"] == "failed"
    assert "malformed: no ArrayRecord 'update'" in document["error"]
    rounds = document["rounds"]
    assert len(rounds) == MAX_EMPTY_IN_A_ROW and all(r["failure"] for r in rounds)
    assert rounds[-1]["epsilon"] > rounds[0]["epsilon"] > 0  # each noise-only release is accounted
    assert load_checkpoint(tmp_path / "run").round == MAX_EMPTY_IN_A_ROW
