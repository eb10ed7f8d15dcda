import random
from dataclasses import replace

import numpy as np
import pytest

from fedhog import data
from fedhog.data import (
    DataSpec,
    dataset_info,
    load_client_data,
    load_mnist1d,
    load_proxy_set,
    load_server_validation_set,
    load_test_set,
    validate_spec,
)

pytestmark = pytest.mark.usefixtures("fresh_cache")
SPEC = DataSpec(dataset="mnist1d", num_samples=2000, population=20, seed=0)


def all_clients(spec):
    return [load_client_data(spec, i) for i in range(spec.population)]


def rows(x):
    return [r.tobytes() for r in x.reshape(len(x), -1)]


def label_skew(spec):
    """Mean total-variation distance between client and pooled label distributions."""
    counts = np.array(
        [np.bincount(np.concatenate([t.y, v.y]), minlength=10) for t, v in all_clients(spec)]
    )
    dists = counts / counts.sum(1, keepdims=True)
    pooled = counts.sum(0) / counts.sum()
    return 0.5 * np.abs(dists - pooled).sum(1).mean()


def test_mnist1d_generation_keeps_global_rng_and_is_cached_on_disk(fresh_cache):
    load_mnist1d.cache_clear()
    np.random.seed(123)
    random.seed(123)
    np_state, py_state = np.random.get_state(), random.getstate()
    x, y = load_mnist1d(500, 7)
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    assert random.getstate() == py_state
    assert x.shape == (500, 1, 40) and x.dtype == np.float32 and y.dtype == np.int64
    assert [p.suffix for p in fresh_cache.iterdir()] == [".npz"]  # no temp file left behind
    load_mnist1d.cache_clear()
    x2, y2 = load_mnist1d(500, 7)  # now read from disk
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert not np.array_equal(load_mnist1d(500, 8)[1], y)


def test_dataset_info_matches_arrays():
    for spec in (SPEC, replace(SPEC, dataset="digits"), replace(SPEC, dataset="synthetic")):
        shape, num_classes = dataset_info(spec)
        train, val = load_client_data(spec, 0)
        test = load_test_set(spec)
        assert num_classes == 10
        for part in (train, val, test):
            assert part.x.shape[1:] == shape and part.x.dtype == np.float32
            assert part.y.dtype == np.int64 and len(part) == len(part.x)


@pytest.mark.parametrize("partitioner", data.PARTITIONERS)
def test_deterministic_for_a_seed(partitioner):
    spec = replace(SPEC, partitioner=partitioner)
    first = load_client_data(spec, 3)
    data._federation.cache_clear()
    again = load_client_data(spec, 3)
    other = load_client_data(replace(spec, seed=1), 3)
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert not np.array_equal(first[0].x[:1], other[0].x[:1])


@pytest.mark.parametrize("dataset", ["mnist1d", "digits"])
@pytest.mark.parametrize("partitioner", data.PARTITIONERS)
def test_partitions_disjoint_cover_pool_and_exclude_test_set(dataset, partitioner):
    spec = replace(SPEC, dataset=dataset, partitioner=partitioner)
    x, _ = load_mnist1d(spec.num_samples, spec.seed) if dataset == "mnist1d" else data.load_digits()
    assert len(set(rows(x))) == len(x)  # examples are identified by their content
    client_rows = [r for t, v in all_clients(spec) for r in rows(t.x) + rows(v.x)]
    test_rows = rows(load_test_set(spec).x)
    assert len(test_rows) == int(spec.test_fraction * len(x))
    assert len(set(client_rows)) == len(client_rows)  # disjoint
    assert not set(client_rows) & set(test_rows)
    assert set(client_rows) | set(test_rows) == set(rows(x))  # covering


@pytest.mark.parametrize("dataset", ["mnist1d", "digits"])
def test_server_held_sets_are_disjoint_from_clients_and_test_and_cover_the_rest(dataset):
    spec = replace(SPEC, dataset=dataset, server_validation_fraction=0.1, proxy_fraction=0.05)
    x, _ = load_mnist1d(spec.num_samples, spec.seed) if dataset == "mnist1d" else data.load_digits()
    held = load_server_validation_set(spec), load_proxy_set(spec), load_test_set(spec)
    assert [len(s) for s in held] == [int(f * len(x)) for f in (0.1, 0.05, spec.test_fraction)]
    sets = [set(rows(s.x)) for s in held] + [{r for t, v in all_clients(spec) for r in rows(t.x) + rows(v.x)}]
    assert sum(map(len, sets)) == len(set().union(*sets)) == len(x)  # pairwise disjoint, covering
    plain = replace(spec, server_validation_fraction=0.0, proxy_fraction=0.0)
    assert len(load_server_validation_set(plain)) == len(load_proxy_set(plain)) == 0
    assert set(rows(load_test_set(plain).x)) == sets[2]  # holding sets apart leaves the test set as it was


def test_server_held_sets_refused_for_synthetic_and_when_nothing_is_left():
    with pytest.raises(ValueError, match=r"server_validation_fraction=0.1.*synthetic"):
        validate_spec(replace(SPEC, dataset="synthetic", server_validation_fraction=0.1))
    with pytest.raises(ValueError, match=r"server_validation_fraction=0.4.*proxy_fraction < 1 .they sum to 1.1"):
        validate_spec(replace(SPEC, server_validation_fraction=0.4, proxy_fraction=0.5))


def test_validation_split_per_client():
    for train, val in all_clients(SPEC):
        n = len(train) + len(val)
        assert len(val) == int(SPEC.validation_fraction * n) and len(train) >= 1


def test_dirichlet_more_heterogeneous_than_iid():
    iid = label_skew(replace(SPEC, partitioner="iid"))
    dirichlet = label_skew(replace(SPEC, partitioner="dirichlet", dirichlet_alpha=0.1))
    assert dirichlet > iid + 0.3


def test_pathological_at_most_k_classes():
    spec = replace(SPEC, partitioner="pathological", classes_per_client=2)
    for train, val in all_clients(spec):
        assert len(np.unique(np.concatenate([train.y, val.y]))) <= 2


def test_many_small_clients_all_get_training_data():
    spec = replace(SPEC, population=1000, dirichlet_alpha=0.1, validation_fraction=0.5)
    sizes = [len(t) for t, _ in all_clients(spec)]
    assert min(sizes) >= 1 and sum(sizes) > 0
    _train, val = load_client_data(spec, int(np.argmin(sizes)))
    assert val.x.shape[1:] == (1, 40) and val.y.shape == (len(val),)  # possibly empty


def test_more_partitions_than_examples_is_an_error():
    with pytest.raises(ValueError, match="population=1700"):
        load_client_data(replace(SPEC, population=1700), 0)


def test_digits_scaled_to_unit_interval():
    x, y = data.load_digits()
    assert x.shape == (1797, 1, 8, 8) and x.min() == 0 and x.max() == 1
    assert set(np.unique(y)) == set(range(10))


def test_synthetic_shapes_labels_and_determinism():
    spec = DataSpec(dataset="synthetic", population=30, seed=0)
    clients = all_clients(spec)
    test = load_test_set(spec)
    sizes = [len(t) + len(v) for t, v in clients]
    assert min(sizes) >= 1 and max(sizes) <= data.SYNTHETIC_MAX_SAMPLES
    for part in [p for c in clients for p in c] + [test]:
        assert part.x.shape == (len(part), 60) and set(np.unique(part.y)) <= set(range(10))
    client_rows = {r for t, v in clients for r in rows(t.x) + rows(v.x)}
    assert not client_rows & set(rows(test.x))
    data._federation.cache_clear()
    assert np.array_equal(load_client_data(spec, 5)[0].x, clients[5][0].x)
    assert not np.array_equal(load_client_data(replace(spec, seed=1), 5)[0].y[:20], clients[5][0].y[:20])


def test_synthetic_heterogeneity_grows_with_beta():
    def mean_spread(dataset):
        spec = DataSpec(dataset=dataset, population=30, seed=0)
        return np.std([t.x.mean() for t, _ in all_clients(spec)])

    assert mean_spread("synthetic:0,1") > 3 * mean_spread("synthetic:0,0")
    assert label_skew(DataSpec(dataset="synthetic:1,1", population=30)) > 0.5


@pytest.mark.parametrize(
    "field, value",
    [
        ("dataset", "cifar"),
        ("dataset", "synthetic:1"),
        ("dataset", "hf:"),
        ("partitioner", "shards"),
        ("dirichlet_alpha", 0.0),
        ("population", 0),
        ("num_samples", 5),
        ("classes_per_client", 0),
        ("validation_fraction", 1.0),
        ("test_fraction", 0.0),
        ("test_fraction", 1.5),
        ("seed", -1),
    ],
)
def test_invalid_spec_errors_name_key_and_value(field, value):
    with pytest.raises(ValueError, match=f"^data: {field}={value!r} is not allowed; expected"):
        validate_spec(replace(SPEC, **{field: value}))


@pytest.mark.parametrize("partition_id", [-1, 20])
def test_partition_id_out_of_range(partition_id):
    with pytest.raises(ValueError, match=f"data: partition_id={partition_id} is not allowed"):
        load_client_data(SPEC, partition_id)


def test_pathological_more_classes_than_dataset_has():
    with pytest.raises(ValueError, match="classes_per_client=11"):
        load_client_data(replace(SPEC, partitioner="pathological", classes_per_client=11), 0)
