"""SecureAggregator in one's own ServerApp, with one's own ClientApp (the README's recipe, with its properties)."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedhog import protocol
from fedhog.config import RunConfig
from fedhog.engines.inprocess import run_in_process
from fedhog.server_app import build_strategy

POPULATION = 4


def _apps(config: RunConfig, rounds: int, finished: dict, evaluate_fn=None) -> tuple[ServerApp, ClientApp]:
    """A ClientApp replying Δ = (partition + 1)·1 for partition + 1 examples; a ServerApp around SecureAggregator."""
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        state = msg.content["arrays"].to_torch_state_dict()
        update = {k: torch.full_like(v, partition + 1.0) for k, v in state.items()}
        if partition == 3:  # a broken client: no MetricRecord, so the aggregator rejects its reply
            return Message(RecordDict({protocol.UPDATE: ArrayRecord(update)}), reply_to=msg)
        metrics = MetricRecord({protocol.PARTITION_ID: partition, protocol.NUM_EXAMPLES: partition + 1})
        return Message(RecordDict({protocol.UPDATE: ArrayRecord(update), protocol.METRICS: metrics}), reply_to=msg)

    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = build_strategy(config)
        strategy.discover(grid, POPULATION, timeout=60, identify=False)
        initial = ArrayRecord({"w": torch.zeros(3)})
        finished["records"] = []
        result = strategy.start(grid, initial, num_rounds=rounds, evaluate_fn=evaluate_fn,
                                on_round=lambda record, arrays: finished["records"].append(record))
        finished["w"] = result.arrays.to_torch_state_dict()["w"]
        finished["evaluated"] = result.evaluate_metrics_serverapp

    return server, client


def _config(**keys) -> RunConfig:
    return RunConfig.from_mapping({"population": POPULATION, "sampling": "fixed", "sampling-rate": 1.0,
                                   "delta": 1e-3, "privacy-seed": 3, **keys})


def test_without_noise_the_release_is_the_example_weighted_mean_of_the_accepted_updates():
    finished: dict = {}
    server, client = _apps(_config(mechanism="none", **{"noise-multiplier": 0.0}), 1, finished)
    run_in_process(server, client, POPULATION, {})
    # partitions 0, 1, 2 reply 1, 2, 3 with 1, 2, 3 examples (partition 3's reply is malformed)
    torch.testing.assert_close(finished["w"], torch.full((3,), (1 * 1 + 2 * 2 + 3 * 3) / 6))
    record = finished["records"][0]
    assert (record.clients_sampled, record.clients_accepted, record.clients_rejected) == (4, 3, 1)
    assert record.rejections == {"malformed": 1}


def test_the_gaussian_mechanism_clips_each_update_and_accounts_every_round():
    finished: dict = {}
    server, client = _apps(_config(mechanism="gaussian", **{"noise-multiplier": 0.0, "clipping-norm": 0.5}), 2,
                           finished)
    run_in_process(server, client, POPULATION, {})
    # every update is longer than C = 0.5: each becomes 0.5·(1,1,1)/√3, summed and divided by K = 4
    per_round = 3 * 0.5 / 3 ** 0.5 / 4
    torch.testing.assert_close(finished["w"], torch.full((3,), 2 * per_round))
    noisy: dict = {}
    server, client = _apps(_config(mechanism="gaussian", **{"noise-multiplier": 2.0}), 2, noisy)
    run_in_process(server, client, POPULATION, {})
    epsilons = [r.epsilon for r in noisy["records"]]
    assert 0 < epsilons[0] < epsilons[1] < float("inf")


def test_an_evaluation_that_returns_nothing_leaves_the_round_unevaluated():
    """Flower's evaluate_fn may return None: that round has no test metrics, the next one has its own."""
    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        return None if server_round == 1 else MetricRecord({"accuracy": 0.25, "loss": 2.0})

    finished: dict = {}
    server, client = _apps(_config(mechanism="none", **{"noise-multiplier": 0.0}), 2, finished, evaluate)
    run_in_process(server, client, POPULATION, {})
    first, second = finished["records"]
    assert math.isnan(first.accuracy) and (second.accuracy, second.loss) == (0.25, 2.0)
    assert list(finished["evaluated"]) == [2]


def test_a_node_that_states_no_integer_partition_id_counts_as_not_answering():
    """discover(identify=True): a partition id sent as a list is no partition id (not a crash of the ServerApp)."""
    client = ClientApp()

    @client.query()
    def query(msg: Message, context: Context) -> Message:
        partition = int(context.node_config["partition-id"])
        stated = [partition] if partition == 3 else partition
        return Message(RecordDict({protocol.METRICS: MetricRecord({protocol.PARTITION_ID: stated})}), reply_to=msg)

    server = ServerApp()
    refused: list[str] = []

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = build_strategy(_config(mechanism="none", **{"noise-multiplier": 0.0}))
        with pytest.raises(RuntimeError, match="the 3 nodes that answered hold 3 distinct partition ids") as error:
            strategy.discover(grid, POPULATION, timeout=60, identify=True)
        refused.append(str(error.value))

    run_in_process(server, client, POPULATION, {})
    assert len(refused) == 1
