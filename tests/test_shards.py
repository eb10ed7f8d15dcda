"""The vectorized engine split into shards: the same release, bit for bit, however the cohort is split.

A cohort is trained in fixed blocks (:func:`fedhog.engines.shards.cohort_blocks`) whose composition depends on
the cohort alone; shards take whole blocks, check and reduce their clients' results to an exact int64 lattice sum,
and the strategy noises the sum of the sums once. The fast tests split cohorts among shards in this process
(:class:`~fedhog.engines.shards.LocalShards`); the slow one runs Ray actors.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from helpers import read_run, same_state

from fedhog.client_app import app as client_app
from fedhog.config import ConfigError, RunConfig
from fedhog.data import (
    ArrayData,
    DataSpec,
    clients_training_data,
    load_client_data,
    load_test_set,
    population_training_data,
    training_sizes,
)
from fedhog.engines import run_engine
from fedhog.engines.inprocess import InProcessGrid
from fedhog.engines.shards import CohortShard, LocalShards, actor_options, cohort_blocks, shard_blocks
from fedhog.engines.vectorized import VectorizedGrid, VectorizedRunner, run_vectorized
from fedhog.protocol import Rejection
from fedhog.replies import reduce_results
from fedhog.server_app import app as server_app
from fedhog.server_app import build_strategy

pytestmark = pytest.mark.usefixtures("shared_cache")

# 24 clients, cohorts of 12 in blocks of 3: four blocks a round, which 2 and 3 shards split differently
SPLIT = {"dataset": "digits", "model": "mlp", "population": 24, "sampling-rate": 0.5, "sampling": "fixed",
         "rounds": 2, "local-epochs": 1, "batch-size": 32, "learning-rate": 0.1, "momentum": 0.5, "hog-batch-size": 8,
         "clipping-norm": 0.5, "noise-multiplier": 0.8, "mechanism": "hog", "privacy-seed": 11,
         "adaptive-clipping": True, "count-noise-std": 1.0, "delta": 1e-3}
BLOCK = 3
TIMINGS = ("seconds", "third_order_seconds_max")  # wall-clock figures, the only fields a split may change


def _config(tmp_path, name: str, **overrides) -> RunConfig:
    return RunConfig().with_overrides({**SPLIT, **overrides, "results-dir": str(tmp_path / name)})


def _run_split(config: RunConfig, shards: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """A whole vectorized run whose cohorts are split among ``shards`` shards in this process."""
    grid = VectorizedGrid(client_app, config)
    grid.cohort_runner = VectorizedRunner(config, grid.partition_of_node, LocalShards(config, shards), BLOCK)
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                             run_config=config.to_mapping()))
    return read_run(config.results_dir)


def _without_timings(rounds: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in rounds]


def test_blocks_depend_on_the_cohort_alone_and_shards_take_whole_blocks():
    members = [(slot, 100 + slot) for slot in range(10)]
    sizes = [5, 3, 5, 1, 9, 3, 5, 2, 2, 7]
    blocks = cohort_blocks(members, sizes, 4)
    assert [len(b) for b in blocks] == [4, 4, 2]
    flat = [m for b in blocks for m in b]
    assert sorted(flat) == members
    assert [sizes[slot] for slot, _ in flat] == sorted(sizes)  # similar sizes share a block: little padding
    assert cohort_blocks(list(reversed(members)), list(reversed(sizes)), 4) == blocks  # order of arrival: none
    for shards in (1, 2, 3, 5):
        split = shard_blocks(blocks, shards)
        assert len(split) == shards
        assert [b for share in split for b in share] == blocks  # contiguous runs of whole blocks, in order


@pytest.mark.parametrize("overrides", [
    # the split is the point, not the model (logreg: the cheapest HOG terms) nor the accountant (fixed-size
    # sampling's RDP costs about a second a round; the slow row samples fixed-size cohorts)
    {"max-update-norm": 0.2, "model": "logreg", "sampling": "poisson"},
    pytest.param({"mechanism": "gaussian", "adaptive-clipping": False}, marks=pytest.mark.slow),
], ids=["hog-adaptive-rejections-poisson", "gaussian-fixed"])
def test_the_release_is_the_same_bits_however_the_cohort_is_split(tmp_path, monkeypatch, overrides):
    batches: dict[int, list[list[int]]] = {}  # split -> the clients of every batch trained, in order
    work = CohortShard.work

    def recording(shard, state, partitions, seeds, hog):
        batches[split].append(list(partitions))
        return work(shard, state, partitions, seeds, hog)

    monkeypatch.setattr(CohortShard, "work", recording)
    runs = {}
    for split in (1, 2, 3):
        batches[split] = []
        runs[split] = _run_split(_config(tmp_path, f"shards-{split}", **overrides), split)
    # what makes the bits equal: every client trains in the same batch, with the same partners, whatever the split
    assert batches[2] == batches[3] == batches[1]
    assert max(len(b) for b in batches[1]) == BLOCK < max(r["clients_sampled"] for r in runs[1][0]["rounds"])
    (one, model), others = runs[1], [runs[2], runs[3]]
    assert one["status"] == "finished" and len(one["rounds"]) == SPLIT["rounds"]
    assert max(r["clients_sampled"] for r in one["rounds"]) > 2 * BLOCK  # more blocks than shards: a real split
    if "max-update-norm" in overrides:  # the shards' check refuses some replies: counted the same
        assert sum(r["rejections"].get(Rejection.TOO_LARGE, 0) for r in one["rounds"]) > 0
        assert all(r["clients_accepted"] for r in one["rounds"])
        assert len({r["clipping_norm"] for r in one["rounds"]}) == 2  # adaptive clipping moved C: private norms
    for metrics, state in others:
        assert same_state(state, model)
        assert _without_timings(metrics["rounds"]) == _without_timings(one["rounds"])


def test_a_reduced_round_releases_what_the_strategys_own_path_releases(shared_cache):
    """The shard-side check and lattice sum, then finish_reduced, against finish_replies on the same results,
    with a non-finite update and an oversized one among them: the same model bits, record and refusals."""
    config = RunConfig().with_overrides({**SPLIT, "max-update-norm": 0.9, "adaptive-clipping": False})
    grid = VectorizedGrid(client_app, config)
    runner = VectorizedRunner(config, grid.partition_of_node, LocalShards(config), BLOCK)
    torch.manual_seed(0)
    arrays = ArrayRecord(_model_state(config))
    released = []
    for path in ("strategy", "reduced"):
        strategy = build_strategy(config)
        strategy.discover(grid, config.population, 10, identify=True)
        request = strategy._train_request(1, arrays, ConfigRecord(), math.inf)
        replies = runner.train(request)
        results = list(replies.results)
        results[0] = dataclasses.replace(results[0], update=torch.full_like(results[0].update, math.nan))
        results[1] = dataclasses.replace(results[1], update=results[1].update * 1e3)
        if path == "strategy":
            replies.results = results
            new, _ = strategy.finish_replies(1, replies)
        else:
            plan = strategy.reduction_plan()
            halves = [reduce_results(part, plan) for part in (results[:5], results[5:])]  # any split adds up
            new, _ = strategy.finish_reduced(1, halves[0].add(halves[1]), plan)
        released.append((new.to_torch_state_dict(), dataclasses.asdict(strategy.current)))
    (model_a, record_a), (model_b, record_b) = released
    assert same_state(model_a, model_b)
    assert _comparable(record_a) == _comparable(record_b)
    assert record_a["rejections"][Rejection.NON_FINITE_VALUES] == 1 and record_a["rejections"][Rejection.TOO_LARGE] >= 1


def _comparable(record: dict) -> str:
    """A round's record without its timings and bytes (reply bytes are the message path's alone), NaN = NaN."""
    return json.dumps({k: v for k, v in record.items() if k not in (*TIMINGS, "bytes_received")}, sort_keys=True)


def _model_state(config: RunConfig) -> dict[str, torch.Tensor]:
    from fedhog.data import dataset_info
    from fedhog.models import build_model

    return build_model(config.model, *dataset_info(config.data_spec), config.activation,
                       config.normalization).state_dict()


def test_a_reduction_carries_no_client_vector_back():
    """What a shard returns holds one d-vector (the sum) and per-client scalars: no client's update or term."""
    config = RunConfig().with_overrides(SPLIT)
    grid = VectorizedGrid(client_app, config)
    strategy = build_strategy(config)
    strategy.discover(grid, config.population, 10, identify=True)
    torch.manual_seed(0)
    request = strategy._train_request(1, ArrayRecord(_model_state(config)), ConfigRecord(), math.inf)
    reduced = VectorizedRunner(config, grid.partition_of_node, LocalShards(config), BLOCK).reduce(
        request, strategy.reduction_plan())
    assert reduced.lattice_sum.dtype == torch.int64 and reduced.lattice_sum.dim() == 1
    assert len(reduced.accepted) + len(reduced.refused) == len(request.cohort)
    for contribution in reduced.accepted:
        assert all(isinstance(v, (int, float)) for v in contribution.metrics.values())


def test_each_actor_asks_for_its_share_and_picks_its_device_where_it_runs():
    assert actor_options({"CPU": 16.0}, "auto", 4) == {"num_cpus": 1.0, "num_gpus": 0.0}  # no GPU: CPU in the actor
    assert actor_options({"CPU": 2.0}, "auto", 4) == {"num_cpus": 0.5, "num_gpus": 0.0}  # more shards than CPUs
    assert actor_options({"CPU": 16.0, "GPU": 1.0}, "auto", 2) == {"num_cpus": 1.0, "num_gpus": 0.5}
    assert actor_options({"CPU": 16.0, "GPU": 8.0}, "cuda", 4) == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert actor_options({"CPU": 16.0, "GPU": 8.0}, "cpu", 4)["num_gpus"] == 0.0
    shard = LocalShards(RunConfig().with_overrides({**SPLIT, "device": "auto"})).shard
    assert shard.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert shard.trainer.x.device.type == shard.device.type


def test_shards_is_validated_and_needs_the_vectorized_engine(tmp_path):
    for value in (0, -1):
        with pytest.raises(ConfigError, match=rf"shards={value} is not allowed; expected an integer ≥ 1"):
            RunConfig.from_mapping({"shards": value})
    config = _config(tmp_path, "engine", shards=2)
    with pytest.raises(ConfigError, match="shards=2 is not allowed with engine='inprocess'"):
        run_engine("inprocess", config)
    with pytest.raises(ConfigError, match="shards=2 is not allowed here: client-dp='dpsgd' trains each client"):
        run_vectorized(server_app, client_app, config.with_overrides({"client-dp": "dpsgd", "mechanism": "gaussian"}))
    with pytest.raises(ConfigError, match="shards=2 is not allowed with aggregator='flower-dp'"):
        run_vectorized(server_app, client_app, config.with_overrides(
            {"aggregator": "flower-dp", "mechanism": "gaussian", "accountant": "rdp", "adaptive-clipping": False}))


# --- a population of any size: data made client by client, contexts made when asked for ----------------


def test_synthetic_large_makes_each_clients_data_from_its_own_stream():
    small, huge = DataSpec(dataset="synthetic-large", population=30), \
        DataSpec(dataset="synthetic-large:0.5,2", population=10**7)
    assert same_arrays(load_client_data(small, 7)[0], load_client_data(DataSpec(dataset="synthetic-large",
                                                                                 population=10**6), 7)[0])
    x, y, indices = clients_training_data(huge, [5, 9_999_999, 5])
    assert [len(i) for i in indices] == training_sizes(huge, [5, 9_999_999, 5])
    for i, p in enumerate([5, 9_999_999, 5]):
        train = load_client_data(huge, p)[0]
        np.testing.assert_array_equal(x[indices[i]], train.x)
        np.testing.assert_array_equal(y[indices[i]], train.y)
    assert not np.array_equal(load_client_data(huge, 1)[0].x[:5], load_client_data(huge, 2)[0].x[:5])
    test, test_30 = load_test_set(huge), load_test_set(dataclasses.replace(huge, population=30))
    assert same_arrays(test, load_test_set(dataclasses.replace(huge, population=1000)))  # the first 1 000's
    assert same_arrays(ArrayData(test.x[:len(test_30)], test.y[:len(test_30)]), test_30)
    assert 0 < len(test_30) < len(test) < 1000 * 1000
    with pytest.raises(ValueError, match="generated client by client"):
        population_training_data(huge)


def test_a_cohorts_data_and_sizes_are_its_clients_own_where_the_population_is_held():
    spec = DataSpec(dataset="digits", population=12)
    x, y, indices = clients_training_data(spec, [7, 2, 7])
    assert x is population_training_data(spec)[0]  # the pool itself, not a copy
    assert training_sizes(spec, [7, 2, 7]) == [len(i) for i in indices]
    for p, own in zip([7, 2, 7], indices, strict=True):
        assert same_arrays(ArrayData(x[own], y[own]), load_client_data(spec, p)[0])


def same_arrays(a, b) -> bool:
    return np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)


def test_a_grid_of_a_million_nodes_makes_a_context_only_when_asked():
    grid = InProcessGrid(client_app, 10**6, {"population": 10**6})
    assert len(grid.contexts) == 10**6 and len(grid.contexts._made) == 0
    node = next(iter(grid.get_node_ids()))
    assert grid.contexts[node].node_config == {"partition-id": 0, "num-partitions": 10**6}
    assert len(grid.contexts._made) == 1 and grid.contexts.get(-5) is None


def test_discovery_on_the_vectorized_grid_asks_no_node_and_keys_slots_by_partition():
    config = RunConfig().with_overrides({"dataset": "synthetic-large", "model": "mlp", "population": 10**5,
                                         "sampling-rate": 0.01, "delta": 1e-6, "privacy-seed": 3})
    grid = VectorizedGrid(client_app, config)
    strategy = build_strategy(config)
    strategy.discover(grid, config.population, 10, identify=True)
    assert strategy.slot_of_node == grid.partition_of_node  # as the ClientApp's answers would key them
    assert len(grid.contexts._made) == 0  # no message, no Context


# --- Ray -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
def test_ray_shards_release_the_same_bits_as_one(tmp_path, private_dirs):
    """Three actors (more than the CPUs, an uneven share of the four blocks) against this process's one shard;
    that any split of the blocks releases the same bits is the in-process test's above."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False)
    try:
        runs = {}
        for shards in (1, 3):
            config = _config(tmp_path, f"ray-{shards}", shards=shards)
            grid = VectorizedGrid(client_app, config)
            grid.cohort_runner = VectorizedRunner(config, grid.partition_of_node, block=BLOCK)
            try:
                server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                         run_config=config.to_mapping()))
            finally:
                grid.cohort_runner.close()
            runs[shards] = read_run(config.results_dir)
    finally:
        ray.shutdown()
    (one, model), (metrics, state) = runs[1], runs[3]
    assert same_state(state, model)
    assert _without_timings(metrics["rounds"]) == _without_timings(one["rounds"])
