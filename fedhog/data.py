"""Federated datasets: offline generators, partitioning and per-client splits.

Every array a caller sees is determined by a :class:`DataSpec`. The data of a
spec is built once per process (``functools.lru_cache``) and the slow MNIST-1D
generation is also cached on disk, so many client processes can share it.

Layout of one spec:

* ``mnist1d``, ``digits`` and ``hf:<id>``: a central test set is held out
  (``test_fraction`` of the data; the ``test`` split for ``hf:``), the rest is
  the training pool, which a flwr-datasets partitioner splits into
  ``population`` disjoint client partitions covering the pool.
* ``csv:PATH``, ``parquet:PATH``, ``npz:PATH``: the user's own table (see
  :func:`tabular_source`): ``label_column`` holds the label, ``feature_columns``
  (default: every other column but ``client_column``) the numeric features. With
  ``client_column`` each distinct value is one client (in sorted order; a natural
  federation) and ``test_fraction`` of each client's rows go to the central test
  set; without it ``test_fraction`` of all rows are held out and a partitioner
  splits the rest. Features are standardised with the mean and standard deviation
  of the clients' training rows only (not their validation rows, not the test set).
* ``synthetic`` / ``synthetic:<alpha>,<beta>``: FedProx Synthetic(alpha, beta)
  (Li et al., 2020); every client generates its own data (natural partition,
  ``partitioner``, ``dirichlet_alpha`` and ``num_samples`` are ignored) and hands
  ``test_fraction`` of it to the central test set. Plain ``synthetic`` is
  Synthetic(1, 1).
* ``synthetic-large`` / ``synthetic-large:<alpha>,<beta>``: the same generator,
  but client k's data comes from a stream of its own (seeded by ``(seed, k)``)
  and is generated when asked for, never for the whole population: a population
  of millions costs nothing until its clients are sampled. The test set is the
  ``test_fraction`` held out by the first :data:`LARGE_TEST_CLIENTS` clients.

Besides the test set, the server may hold two more sets apart from every
client's data and from the test set (``mnist1d``, ``digits`` and ``hf:``
only): a *server validation set* (``server_validation_fraction`` of all
examples), on which hyperparameters are tuned and never on the test set, and a
*proxy set* (``proxy_fraction``), public or proxy data for a server-side step.
Both are taken from the training pool before it is partitioned; with both
fractions 0 (the default) the clients' data is what it was without them.

Each client's partition is then split into training (the rest) and validation
(``floor(validation_fraction * n)`` examples). A client with ``n >= 1`` examples
therefore always has at least one training example; a client with none gets
empty arrays of the right shape and dtype.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .choices import DATASETS, PARTITIONERS, TABULAR_FORMATS
from .files import cache_dir

if TYPE_CHECKING:
    from datasets import Dataset
    from flwr_datasets.partitioner import Partitioner

HF_PREFIX = "hf:"
SYNTHETIC_MAX_SAMPLES = 1000  # cap on the heavy-tailed per-client sample counts
DIGITS_EXAMPLES = 1797  # scikit-learn's digits
MNIST1D_CLASSES = 10
LARGE_SYNTHETIC = "synthetic-large"
LARGE_TEST_CLIENTS = 1000  # synthetic-large: the clients whose held-out examples are the test set
_stage = logging.getLogger("fedhog.stage").info  # what the progress display shows before the first round


@dataclass(frozen=True)
class DataSpec:
    """Everything that determines the federated data (hashable cache key).

    A run's spec is :attr:`fedhog.config.RunConfig.data_spec`: every field but
    ``test_fraction`` is the run config's field of the same name (config key
    ``x-y`` for field ``x_y``), with the same default.

    Attributes
    ----------
    dataset : str
        One of ``DATASETS``, ``"synthetic:<alpha>,<beta>"`` or ``"hf:<id>"``.
    num_samples : int
        Examples generated for ``mnist1d`` (rounded down to a multiple of 10);
        ignored by the other datasets.
    partitioner : str
        One of ``PARTITIONERS``; ignored by ``synthetic``.
    population : int
        Number of clients (partitions).
    dirichlet_alpha : float
        Dirichlet concentration (``dirichlet`` only); smaller is more skewed.
    classes_per_client : int
        Classes per client (``pathological`` only).
    validation_fraction : float
        Fraction of each client's examples kept for validation, in [0, 1).
    test_fraction : float
        Fraction of all examples held out as the central test set, in (0, 1);
        ignored by ``hf:`` datasets, which use their ``test`` split.
    server_validation_fraction : float
        Fraction of all examples the server holds as its validation set, in [0, 1).
    proxy_fraction : float
        Fraction of all examples the server holds as proxy data, in [0, 1).
    seed : int
        Seed of data generation, splitting and partitioning.
    label_column, feature_columns, client_column : str
        Tabular datasets only: the label's column, the feature columns
        (comma-separated; empty: all but the label and client columns) and the
        column naming each row's client (empty: partition with ``partitioner``).
    """

    dataset: str = "mnist1d"
    num_samples: int = 20000
    partitioner: str = "dirichlet"
    population: int = 1000
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    validation_fraction: float = 0.1
    test_fraction: float = 0.2
    server_validation_fraction: float = 0.0
    proxy_fraction: float = 0.0
    seed: int = 0
    label_column: str = ""
    feature_columns: str = ""
    client_column: str = ""


@dataclass(frozen=True)
class ArrayData:
    """Examples ``x`` (float32, ``[N, *input_shape]``) and labels ``y`` (int64, ``[N]``)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class _Federation:
    """Materialised spec: examples, central test set and per-client index splits."""

    x: np.ndarray
    y: np.ndarray
    test: ArrayData
    server_validation: ArrayData
    proxy: ArrayData
    clients: tuple[tuple[np.ndarray, np.ndarray], ...]  # (train, validation) indices
    num_classes: int = 0  # tabular datasets: distinct labels in the whole file


def _reject(key: str, value: object, expected: str) -> ValueError:
    return ValueError(f"data: {key}={value!r} is not allowed; expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _synthetic_params(dataset: str, name: str = "synthetic") -> tuple[float, float] | None:
    """Return (alpha, beta) of a ``synthetic`` dataset name (``name``), ``None`` for other names."""
    if dataset == name:
        return 1.0, 1.0
    if not dataset.startswith(f"{name}:"):
        return None
    try:
        alpha, beta = (float(v) for v in dataset.removeprefix(f"{name}:").split(","))
    except ValueError:
        return None
    ok = all(math.isfinite(v) and v >= 0 for v in (alpha, beta))
    return (alpha, beta) if ok else None


def validate_spec(spec: DataSpec, partition_id: int | None = None) -> None:
    """Check a spec (and optionally a client id) without loading any data.

    Parameters
    ----------
    spec : DataSpec
        Spec to check.
    partition_id : int, optional
        Client id to check against ``spec.population``.

    Raises
    ------
    ValueError
        ``"data: <key>=<value> is not allowed; expected ..."`` for the first
        invalid field. Constraints that need the data (e.g. more partitions
        than training examples) are reported the same way when it is loaded.
    """
    dataset = spec.dataset
    if not isinstance(dataset, str) or not (
        dataset in DATASETS
        or _synthetic_params(dataset) is not None
        or _large_params(dataset) is not None
        or (dataset.startswith(HF_PREFIX) and len(dataset) > len(HF_PREFIX))
        or tabular_source(dataset) is not None
    ):
        raise _reject(
            "dataset", dataset,
            f"one of {DATASETS}, 'synthetic:<alpha>,<beta>' or 'synthetic-large:<alpha>,<beta>' with alpha, "
            "beta >= 0, "
            f"'{HF_PREFIX}<hugging face id>' or a table: 'csv:PATH', 'parquet:PATH' or 'npz:PATH'",
        )
    _validate_tabular(spec)
    if spec.partitioner not in PARTITIONERS:
        raise _reject("partitioner", spec.partitioner, f"one of {PARTITIONERS}")
    if not _is_int(spec.num_samples) or spec.num_samples < 10:
        raise _reject("num_samples", spec.num_samples, "an integer >= 10")
    if not _is_int(spec.population) or spec.population < 1:
        raise _reject("population", spec.population, "an integer >= 1")
    if not isinstance(spec.dirichlet_alpha, (int, float)) or not spec.dirichlet_alpha > 0:
        raise _reject("dirichlet_alpha", spec.dirichlet_alpha, "a number > 0")
    if not _is_int(spec.classes_per_client) or spec.classes_per_client < 1:
        raise _reject("classes_per_client", spec.classes_per_client, "an integer >= 1")
    if not isinstance(spec.validation_fraction, (int, float)) or not (
        0 <= spec.validation_fraction < 1
    ):
        raise _reject("validation_fraction", spec.validation_fraction, "a number in [0, 1)")
    if not isinstance(spec.test_fraction, (int, float)) or not 0 < spec.test_fraction < 1:
        raise _reject("test_fraction", spec.test_fraction, "a number in (0, 1)")
    for key in ("server_validation_fraction", "proxy_fraction"):
        value = getattr(spec, key)
        if not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise _reject(key, value, "a number in [0, 1)")
        if value > 0 and (_synthetic_params(dataset) or _large_params(dataset)) is not None:
            raise _reject(key, value, "0 for synthetic data, where every example belongs to a client")
    held_out = spec.test_fraction + spec.server_validation_fraction + spec.proxy_fraction
    if held_out >= 1:
        raise _reject("server_validation_fraction", spec.server_validation_fraction,
                      f"test_fraction + server_validation_fraction + proxy_fraction < 1 (they sum to {held_out:g})")
    if not _is_int(spec.seed) or spec.seed < 0:
        raise _reject("seed", spec.seed, "an integer >= 0")
    pool = _client_examples(spec)
    if pool is not None and spec.population > pool:  # known from the config: refused before the data is made
        raise _reject("population", spec.population, f"at most the {pool} training examples of dataset="
                      f"{dataset!r}" + (f" with num_samples={spec.num_samples}" if dataset == "mnist1d" else ""))
    if partition_id is not None and (
        not _is_int(partition_id) or not 0 <= partition_id < spec.population
    ):
        raise _reject(
            "partition_id", partition_id,
            f"an integer in [0, {spec.population - 1}] (population={spec.population})",
        )


def _client_examples(spec: DataSpec) -> int | None:
    """How many examples the clients share (what :func:`_federation` partitions), where the config alone tells:
    MNIST-1D (``num_samples``) and digits; None for the datasets whose size needs their data."""
    mnist1d = spec.num_samples // MNIST1D_CLASSES * MNIST1D_CLASSES  # mnist1d makes as many of each class
    total = mnist1d if spec.dataset == "mnist1d" else DIGITS_EXAMPLES if spec.dataset == "digits" else None
    if total is None:
        return None
    held = (int(fraction * total) for fraction in (spec.test_fraction, spec.server_validation_fraction,
                                                   spec.proxy_fraction))
    return total - sum(held)


def dataset_info(spec: DataSpec) -> tuple[tuple[int, ...], int]:
    """Return ``(input_shape, num_classes)`` of one example of the spec's dataset.

    Only ``hf:`` datasets are loaded to answer this.
    """
    validate_spec(spec)
    if tabular_source(spec.dataset) is not None:
        federation = _federation(spec)
        return tuple(federation.x.shape[1:]), federation.num_classes
    if spec.dataset == "mnist1d":
        return (1, 40), MNIST1D_CLASSES
    if spec.dataset == "digits":
        return (1, 8, 8), 10
    if _synthetic_params(spec.dataset) is not None or _large_params(spec.dataset) is not None:
        return (60,), 10
    x, _, _, num_classes = _load_hf(spec.dataset.removeprefix(HF_PREFIX), spec.seed)
    return tuple(x.shape[1:]), num_classes


def load_test_set(spec: DataSpec) -> ArrayData:
    """Return (a copy of) the central test set, disjoint from every client's data."""
    validate_spec(spec)
    if _large_params(spec.dataset) is not None:
        held = [_large_client(spec, k)[2] for k in range(min(spec.population, LARGE_TEST_CLIENTS))]
        return ArrayData(np.concatenate([h.x for h in held]), np.concatenate([h.y for h in held]))
    test = _federation(spec).test
    return ArrayData(test.x.copy(), test.y.copy())


def load_server_validation_set(spec: DataSpec) -> ArrayData:
    """Return the server's validation set (empty unless ``server_validation_fraction > 0``)."""
    validate_spec(spec)
    if _large_params(spec.dataset) is not None:
        return _empty_like(load_test_set(replace(spec, population=1)))
    held = _federation(spec).server_validation
    return ArrayData(held.x.copy(), held.y.copy())


def load_proxy_set(spec: DataSpec) -> ArrayData:
    """Return the server's proxy set (empty unless ``proxy_fraction > 0``)."""
    validate_spec(spec)
    if _large_params(spec.dataset) is not None:
        return _empty_like(load_test_set(replace(spec, population=1)))
    held = _federation(spec).proxy
    return ArrayData(held.x.copy(), held.y.copy())


def load_client_data(spec: DataSpec, partition_id: int) -> tuple[ArrayData, ArrayData]:
    """Return ``(train, validation)`` of client ``partition_id``.

    Training data is never empty (specs with more clients than training examples
    are rejected). Validation data is empty (``len == 0``, shapes
    ``[0, *input_shape]`` and ``[0]``) when ``validation_fraction * n < 1``;
    callers must handle that.
    """
    validate_spec(spec, partition_id)
    if _large_params(spec.dataset) is not None:
        x, y, _ = _large_client(spec, partition_id)
        train, val = _train_val_split(np.arange(len(y)), spec.validation_fraction)
        return ArrayData(x[train], y[train]), ArrayData(x[val], y[val])
    fed = _federation(spec)
    train, val = fed.clients[partition_id]
    return ArrayData(fed.x[train], fed.y[train]), ArrayData(fed.x[val], fed.y[val])


def population_training_data(spec: DataSpec) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """The pooled examples ``x, y`` and every client's training indices into them.

    ``load_client_data(spec, i)[0]`` is ``ArrayData(x[indices[i]], y[indices[i]])``: this is the
    view the vectorized engine keeps on its device once, for the whole population.
    """
    validate_spec(spec)
    if not holds_population(spec):
        raise ValueError(f"data: dataset={spec.dataset!r} is generated client by client, never for the whole "
                         "population; ask for a cohort's (clients_training_data)")
    fed = _federation(spec)
    return fed.x, fed.y, tuple(train for train, _ in fed.clients)


def holds_population(spec: DataSpec) -> bool:
    """Whether the spec's data exists for the whole population at once (all but ``synthetic-large``)."""
    return _large_params(spec.dataset) is None


def clients_training_data(spec: DataSpec,
                          partitions: list[int]) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    """Examples ``x, y`` holding these clients' training data, and client ``partitions[i]``'s indices into them.

    ``load_client_data(spec, partitions[i])[0]`` is ``ArrayData(x[indices[i]], y[indices[i]])``. Data
    held for the whole population (:func:`holds_population`) is not copied: ``x, y`` are the pool.
    """
    if holds_population(spec):
        validate_spec(spec)
        fed = _federation(spec)
        return fed.x, fed.y, tuple(fed.clients[p][0] for p in partitions)
    train = [load_client_data(spec, p)[0] for p in partitions]
    ends = np.cumsum([len(t) for t in train])
    return (np.concatenate([t.x for t in train]) if train else np.zeros((0, 60), np.float32),
            np.concatenate([t.y for t in train]) if train else np.zeros(0, np.int64),
            tuple(np.arange(end - len(t), end) for t, end in zip(train, ends, strict=True)))


def training_sizes(spec: DataSpec, partitions: list[int]) -> list[int]:
    """How many training examples each of these clients holds (without generating ``synthetic-large``'s data)."""
    if holds_population(spec):
        validate_spec(spec)
        clients = _federation(spec).clients
        return [len(clients[p][0]) for p in partitions]
    return [n - int(spec.test_fraction * n) - int(spec.validation_fraction * (n - int(spec.test_fraction * n)))
            for n in (_large_count(np.random.default_rng([spec.seed, p])) for p in partitions)]


@functools.lru_cache(maxsize=8)
def _federation(spec: DataSpec) -> _Federation:
    _stage("preparing the data: %s for %d clients (%s)…", spec.dataset, spec.population, spec.partitioner)
    params = _synthetic_params(spec.dataset)
    if params is not None:
        return _synthetic_federation(spec, *params)
    if tabular_source(spec.dataset) is not None:
        return _tabular_federation(spec)
    if spec.dataset.startswith(HF_PREFIX):
        x, y, test, _ = _load_hf(spec.dataset.removeprefix(HF_PREFIX), spec.seed)
    else:
        x, y = (
            load_mnist1d(spec.num_samples, spec.seed)
            if spec.dataset == "mnist1d"
            else load_digits()
        )
        order = np.random.default_rng(spec.seed).permutation(len(y))
        n_test = int(spec.test_fraction * len(y))
        test = ArrayData(x[order[:n_test]], y[order[:n_test]])
        x, y = x[order[n_test:]], y[order[n_test:]]
    total = len(y) + len(test)
    n_val, n_proxy = (int(fraction * total) for fraction in (spec.server_validation_fraction, spec.proxy_fraction))
    order = np.random.default_rng([spec.seed, 1]).permutation(len(y)) if n_val + n_proxy else np.arange(len(y))
    held = [ArrayData(x[i], y[i]) for i in (order[:n_val], order[n_val:n_val + n_proxy])]
    x, y = x[order[n_val + n_proxy:]], y[order[n_val + n_proxy:]]
    _stage("partitioning %d examples among %d clients (%s)…", len(y), spec.population, spec.partitioner)
    clients = tuple(
        _train_val_split(part, spec.validation_fraction) for part in _partition(y, spec)
    )
    return _Federation(x, y, test, held[0], held[1], clients)


def _train_val_split(
    indices: np.ndarray, validation_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """Split already shuffled client indices into (train, validation)."""
    n_val = int(validation_fraction * len(indices))
    return indices[n_val:], indices[:n_val]


def _make_partitioner(spec: DataSpec) -> Partitioner:
    # flwr-datasets and datasets are imported where used: they cost ~1 s of every fresh
    # ClientApp process, and a process builds its partition once.
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    if spec.partitioner == "iid":  # contiguous shards of the (shuffled) pool
        return IidPartitioner(spec.population)
    if spec.partitioner == "dirichlet":
        # flwr's default min_partition_size=10 resamples until every client has 10
        # examples and gives up after 10 tries, which fails for large populations
        # with ~10 examples each; empty clients are filled by _fill_empty instead.
        return DirichletPartitioner(
            spec.population, "label", float(spec.dirichlet_alpha),
            min_partition_size=0, seed=spec.seed,
        )
    return PathologicalPartitioner(
        spec.population, "label", spec.classes_per_client,
        class_assignment_mode="first-deterministic", seed=spec.seed,
    )


def _partition(labels: np.ndarray, spec: DataSpec) -> list[np.ndarray]:
    """Split ``arange(len(labels))`` into ``spec.population`` disjoint covering parts."""
    if spec.population > len(labels):
        raise _reject(
            "population", spec.population,
            f"at most the {len(labels)} training examples of dataset={spec.dataset!r}",
        )
    num_classes = len(np.unique(labels))
    if spec.partitioner == "pathological" and spec.classes_per_client > num_classes:
        raise _reject(
            "classes_per_client", spec.classes_per_client,
            f"at most the {num_classes} classes of dataset={spec.dataset!r}",
        )
    key = json.dumps({"labels": hashlib.sha256(np.ascontiguousarray(labels, dtype=np.int64).tobytes()).hexdigest(),
                      "population": spec.population, "partitioner": spec.partitioner, "seed": spec.seed,
                      "dirichlet_alpha": float(spec.dirichlet_alpha), "classes_per_client": spec.classes_per_client})
    path = cache_dir() / f"partition-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    cached = _cached_partition(path)
    if cached is not None:
        return cached
    parts = _fill_empty(_partition_with_flwr_datasets(labels, spec))
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        np.savez(tmp, rows=np.concatenate(parts), sizes=np.array([len(p) for p in parts]),
                 version=np.array(_flwr_datasets_version() or ""))
    os.replace(tmp.name, path)
    return parts


def _flwr_datasets_version() -> str | None:
    """The installed flwr-datasets' version (None where it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flwr-datasets")
    except PackageNotFoundError:
        return None


def _cached_partition(path: Path) -> list[np.ndarray] | None:
    """The parts :func:`_partition` cached at ``path``: None where there are none, or where another flwr-datasets
    wrote them than the one installed (without flwr-datasets, as on a GPU machine with no network and no pyarrow,
    the cached parts are the only ones there are: ``simulations/gpu/prepare.sh`` carries them)."""
    if not path.exists():
        return None
    with np.load(path) as f:
        installed = _flwr_datasets_version()
        if installed is not None and str(f["version"]) != installed:
            return None
        return np.split(f["rows"], np.cumsum(f["sizes"])[:-1])


def _partition_with_flwr_datasets(labels: np.ndarray, spec: DataSpec) -> list[np.ndarray]:
    """flwr-datasets' partitioner of ``spec`` on ``labels``: each client's rows (some may be empty)."""
    from datasets import Dataset

    partitioner = _make_partitioner(spec)
    partitioner.dataset = Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})
    from .compat import partition_indices

    try:
        first = np.asarray(partitioner.load_partition(0)["idx"], dtype=np.int64)  # assigns every partition
        assigned = partition_indices(partitioner)  # read directly: a Dataset.select per client costs ≈ 2 ms
        parts = (
            [np.asarray(part, dtype=np.int64) for part in assigned] if assigned is not None
            else [first] + [np.asarray(partitioner.load_partition(i)["idx"], dtype=np.int64)
                            for i in range(1, spec.population)]
        )
    except ValueError as err:  # pathological: a class is needed by more clients than it has
        raise _reject(
            "population", spec.population, f"a feasible partitioning ({err})"
        ) from err
    return parts


def _fill_empty(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Give each empty part one example taken from the currently largest part.

    Deterministic; always succeeds when there are at least as many examples as parts.
    """
    sizes = np.array([len(p) for p in parts])
    for i in np.flatnonzero(sizes == 0):
        donor = int(np.argmax(sizes))
        parts[i], parts[donor] = parts[donor][-1:], parts[donor][:-1]
        sizes[i], sizes[donor] = 1, sizes[donor] - 1
    return parts


def _synthetic_federation(spec: DataSpec, alpha: float, beta: float) -> _Federation:
    """FedProx Synthetic(alpha, beta): one generated data set per client.

    Follows the reference generator of Li et al. (2020): ``u_k ~ N(0, alpha)``,
    ``W_k ~ N(u_k, 1)`` (60x10), ``b_k ~ N(u_k, 1)``, ``B_k ~ N(0, beta)``,
    ``v_k ~ N(B_k, 1)`` (60), ``x ~ N(v_k, diag(j^-1.2))``,
    ``y = argmax(softmax(x W_k + b_k))``, with ``lognormal(4, 2) + 50`` examples
    per client capped at ``SYNTHETIC_MAX_SAMPLES``. As in the reference code,
    ``alpha`` and ``beta`` are standard deviations.
    """
    dim, num_classes, k = 60, 10, spec.population
    rng = np.random.default_rng(spec.seed)
    counts = np.minimum(rng.lognormal(4, 2, k).astype(np.int64) + 50, SYNTHETIC_MAX_SAMPLES)
    u = rng.normal(0, alpha, k)
    v = rng.normal(rng.normal(0, beta, k)[:, None], 1, (k, dim))
    std = np.arange(1, dim + 1) ** -0.6  # sqrt of the covariance diagonal j^-1.2
    xs, ys, tests, clients, offset = [], [], [], [], 0
    for u_k, v_k, n in zip(u, v, counts, strict=True):
        w = rng.normal(u_k, 1, (dim, num_classes))
        b = rng.normal(u_k, 1, num_classes)
        x = (v_k + std * rng.standard_normal((n, dim))).astype(np.float32)
        y = np.argmax(x @ w + b, axis=1)  # softmax is monotone
        n_test = int(spec.test_fraction * n)
        tests.append((x[:n_test], y[:n_test]))
        xs.append(x[n_test:])
        ys.append(y[n_test:])
        idx = np.arange(offset, offset + n - n_test)
        clients.append(_train_val_split(idx, spec.validation_fraction))
        offset += n - n_test
    test = ArrayData(
        np.concatenate([t[0] for t in tests]),
        np.concatenate([t[1] for t in tests]).astype(np.int64),
    )
    empty = ArrayData(test.x[:0], test.y[:0])
    return _Federation(
        np.concatenate(xs), np.concatenate(ys).astype(np.int64), test, empty, empty, tuple(clients)
    )


def _large_params(dataset: str) -> tuple[float, float] | None:
    """(alpha, beta) of a ``synthetic-large`` dataset name, ``None`` for other names."""
    return _synthetic_params(dataset, LARGE_SYNTHETIC)


def _large_count(rng: np.random.Generator) -> int:
    """A ``synthetic-large`` client's number of examples: the first draw of its stream."""
    return int(min(int(rng.lognormal(4, 2)) + 50, SYNTHETIC_MAX_SAMPLES))


def _large_client(spec: DataSpec, k: int) -> tuple[np.ndarray, np.ndarray, ArrayData]:
    """``synthetic-large`` client k: its examples ``x, y`` (training and validation) and its held-out test share.

    :func:`_synthetic_federation`'s generator for one client, on the stream seeded by ``(seed, k)`` alone.
    """
    params = _large_params(spec.dataset)
    if params is None:
        raise ValueError(f"dataset={spec.dataset!r} is not a {LARGE_SYNTHETIC} dataset")
    alpha, beta = params
    dim, num_classes = 60, 10
    rng = np.random.default_rng([spec.seed, k])
    n = _large_count(rng)
    u = rng.normal(0, alpha)
    v = rng.normal(rng.normal(0, beta), 1, dim)
    w = rng.normal(u, 1, (dim, num_classes))
    b = rng.normal(u, 1, num_classes)
    x = (v + np.arange(1, dim + 1) ** -0.6 * rng.standard_normal((n, dim))).astype(np.float32)
    y = np.argmax(x @ w + b, axis=1).astype(np.int64)
    n_test = int(spec.test_fraction * n)
    return x[n_test:], y[n_test:], ArrayData(x[:n_test], y[:n_test])


def _empty_like(data: ArrayData) -> ArrayData:
    return ArrayData(data.x[:0], data.y[:0])


def tabular_source(dataset: str) -> tuple[str, Path] | None:
    """``(format, path)`` of a ``csv:PATH`` / ``parquet:PATH`` / ``npz:PATH`` dataset, None for other names.

    CSV and Parquet files are read with pandas (one column per column); an
    ``.npz`` file's arrays are its columns: 1-D arrays of one length, or a single
    ``[N, ...]`` array as the only feature column (its example shape is kept).
    """
    fmt, sep, path = dataset.partition(":") if isinstance(dataset, str) else ("", "", "")
    return (fmt, Path(path)) if sep and fmt in TABULAR_FORMATS and path else None


def _table(dataset: str) -> tuple[str, Path]:
    """:func:`tabular_source` of a dataset that is a table (ValueError for any other)."""
    source = tabular_source(dataset)
    if source is None:
        raise ValueError(f"dataset={dataset!r} is not a table ('csv:PATH', 'parquet:PATH' or 'npz:PATH')")
    return source


def _validate_tabular(spec: DataSpec) -> None:
    """The tabular keys: ``label-column`` required for tables, no column keys for the built-in datasets."""
    source = tabular_source(spec.dataset)
    columns = {"label-column": spec.label_column, "feature-columns": spec.feature_columns,
               "client-column": spec.client_column}
    if source is None:
        for key, value in columns.items():
            if value:
                raise _reject(key, value, f"'' for dataset={spec.dataset!r} (the column keys are for tables: "
                              "'csv:PATH', 'parquet:PATH', 'npz:PATH')")
        return
    if not spec.label_column:
        raise _reject("label-column", spec.label_column, f"the name of the label's column in {spec.dataset}")


@functools.lru_cache(maxsize=4)
def _read_table(dataset: str, modified: float) -> dict[str, np.ndarray]:
    """The columns of a table file (cached per file and modification time)."""
    fmt, path = _table(dataset)
    try:
        if fmt == "npz":
            with np.load(path, allow_pickle=False) as archive:
                columns = {name: archive[name] for name in archive.files}
        else:
            import pandas as pd

            frame = pd.read_csv(path) if fmt == "csv" else pd.read_parquet(path)
            columns = {str(name): frame[name].to_numpy() for name in frame.columns}
    except Exception as error:  # pylint: disable=broad-except  # any reader's failure is a bad file
        raise _reject("dataset", dataset, f"a readable {fmt} file ({type(error).__name__}: {error})") from None
    lengths = {name: len(values) for name, values in columns.items() if np.ndim(values) >= 1}
    if not columns or len(lengths) != len(columns) or len(set(lengths.values())) != 1 or not min(lengths.values()):
        raise _reject("dataset", dataset, f"a non-empty table whose columns have one length (found {lengths})")
    return columns


def _column_names(spec: DataSpec, table: dict[str, np.ndarray]) -> list[str]:
    """The feature columns: ``feature-columns``, or every column but the label and client columns."""
    known = ", ".join(table)
    for key, name in (("label-column", spec.label_column), ("client-column", spec.client_column)):
        if name and name not in table:
            raise _reject(key, name, f"a column of {spec.dataset}; its columns are {known}")
    if not spec.feature_columns:
        names = [n for n in table if n not in (spec.label_column, spec.client_column)]
    else:
        names = [n.strip() for n in spec.feature_columns.split(",")]
        for name in names:
            if name not in table:
                raise _reject("feature-columns", spec.feature_columns, f"comma-separated columns of "
                              f"{spec.dataset}; {name!r} is not one (its columns are {known})")
        if spec.label_column in names:
            raise _reject("feature-columns", spec.feature_columns,
                          f"columns other than label-column={spec.label_column!r}")
    if not names:
        raise _reject("feature-columns", spec.feature_columns, f"at least one feature column in {spec.dataset}")
    return names


_ALL_OTHERS = " (feature-columns = '' takes every column but label-column and client-column)"


def _features(spec: DataSpec, table: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    """The feature matrix ``[N, F]`` (or one multi-dimensional column's ``[N, ...]``), float64; non-numbers refused."""
    for name in names:
        values = table[name]
        if values.dtype.kind not in "biuf":
            example = next((v for v in values.ravel() if not isinstance(v, (int, float))), values.ravel()[0])
            raise _reject("feature-columns", spec.feature_columns,
                          f"numeric columns{_ALL_OTHERS * (not spec.feature_columns)}; {name!r} holds "
                          f"{values.dtype} values such as {example!r}. fedhog does "
                          "not encode categorical columns: encode them as numbers first (one-hot or codes) "
                          "or leave the column out with feature-columns")
        if values.ndim > 1 and len(names) > 1:
            raise _reject("feature-columns", spec.feature_columns, f"1-D columns, or a single [N, ...] array; "
                          f"{name!r} has shape {values.shape}")
        bad = int(np.count_nonzero(~np.isfinite(values.astype(np.float64))))
        if bad:
            raise _reject("feature-columns", spec.feature_columns, f"columns without missing or infinite values"
                          f"{_ALL_OTHERS * (not spec.feature_columns)}; {name!r} has {bad}")
    if len(names) == 1 and table[names[0]].ndim > 1:
        return table[names[0]].astype(np.float64)
    return np.stack([table[name].astype(np.float64) for name in names], axis=1)


def _codes(spec: DataSpec, key: str, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct values (sorted) and each row's index among them; missing values refused."""
    if values.ndim != 1:
        raise _reject(key, getattr(spec, key.replace("-", "_")), f"a 1-D column; it has shape {values.shape}")
    if values.dtype.kind == "f":
        missing = int(np.count_nonzero(np.isnan(values)))
    else:
        missing = sum(v is None or (isinstance(v, float) and math.isnan(v)) for v in values.astype(object))
    if missing:
        raise _reject(key, getattr(spec, key.replace("-", "_")), f"a column without missing values; it has {missing}")
    try:
        return np.unique(values, return_inverse=True)
    except TypeError as error:  # mixed types that do not sort
        raise _reject(key, getattr(spec, key.replace("-", "_")), f"a column of one type ({error})") from None


def _tabular_federation(spec: DataSpec) -> _Federation:
    """A table as a federation: natural clients or partitioned, a held-out test set, train-fitted scaling."""
    fmt, path = _table(spec.dataset)
    if not path.is_file():  # checked when the data is loaded: a config is valid where the file is not (a server)
        raise _reject("dataset", spec.dataset, f"a {fmt} file that exists; {path.absolute()} "
                      + ("is not a file" if path.exists() else "was not found"))
    table = _read_table(spec.dataset, path.stat().st_mtime)
    x = _features(spec, table, _column_names(spec, table))
    classes, y = _codes(spec, "label-column", table[spec.label_column])
    if len(classes) < 2:
        raise _reject("label-column", spec.label_column, f"a column with at least 2 distinct labels; it has one "
                      f"({classes[0]!r})")
    rng = np.random.default_rng(spec.seed)
    if spec.client_column:
        names, groups = _codes(spec, "client-column", table[spec.client_column])
        if len(names) < 2:
            raise _reject("client-column", spec.client_column, f"a column with at least 2 distinct values (one "
                          f"client each); it has one ({names[0]!r})")
        if len(names) != spec.population:
            raise _reject("population", spec.population, f"the {len(names)} distinct values of "
                          f"client-column={spec.client_column!r} (one client each): set population = {len(names)}")
        held_rows: list[list[np.ndarray]] = [[], [], []]  # test, server validation, proxy: a share of each client
        client_rows = []
        for client in range(len(names)):
            *held, rest = _held_out(rng.permutation(np.flatnonzero(groups == client)), spec)
            for rows, part in zip(held_rows, held, strict=True):
                rows.append(part)
            client_rows.append(rest)
        pool = np.concatenate(client_rows)
        starts = np.cumsum([0] + [len(r) for r in client_rows])
        clients = tuple(_train_val_split(np.arange(a, b), spec.validation_fraction)
                        for a, b in itertools.pairwise(starts))
        test, validation, proxy = (np.concatenate(rows) for rows in held_rows)
    else:
        test, validation, proxy, pool = _held_out(rng.permutation(len(y)), spec)
        clients = tuple(_train_val_split(part, spec.validation_fraction) for part in _partition(y[pool], spec))
    train_rows = pool[np.concatenate([train for train, _ in clients])]
    mean, std = x[train_rows].mean(axis=0), x[train_rows].std(axis=0)
    std[std == 0] = 1.0  # a constant feature stays constant (0)
    scaled = ((x - mean) / std).astype(np.float32)
    test_set, validation_set, proxy_set = (ArrayData(scaled[rows], y[rows].astype(np.int64))
                                           for rows in (test, validation, proxy))
    return _Federation(scaled[pool], y[pool].astype(np.int64), test_set, validation_set, proxy_set, clients,
                       len(classes))


def _held_out(rows: np.ndarray, spec: DataSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Shuffled ``rows`` split into test, server validation, proxy (their fractions of ``rows``) and the rest."""
    sizes = [int(f * len(rows)) for f in (spec.test_fraction, spec.server_validation_fraction, spec.proxy_fraction)]
    ends = np.cumsum(sizes)
    return rows[:ends[0]], rows[ends[0]:ends[1]], rows[ends[1]:ends[2]], rows[ends[2]:]


@functools.lru_cache(maxsize=4)
def load_mnist1d(num_samples: int = 20000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Generate MNIST-1D, cached in memory and on disk.

    Parameters
    ----------
    num_samples : int
        Examples to generate (rounded down to a multiple of 10 by ``mnist1d``).
    seed : int
        Generator seed.

    Returns
    -------
    x, y : np.ndarray
        ``[N, 1, 40]`` float32 signals (standardised by ``mnist1d``) and int64 labels.

    Notes
    -----
    The disk cache is ``$FEDHOG_CACHE`` (default ``~/.cache/fedhog``), one ``.npz``
    per argument hash, written atomically. ``mnist1d`` reseeds the global NumPy
    and Python RNGs; their states are restored afterwards.
    """
    key = json.dumps({"generator": "mnist1d", "num_samples": num_samples, "seed": seed})
    path = cache_dir() / f"mnist1d-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as f:
            return f["x"], f["y"]
    _stage("generating MNIST-1D: %d examples (once: cached in %s)…", num_samples, cache_dir())
    from mnist1d.data import get_dataset_args, make_dataset  # slow import, only on a miss

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        raw = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    x = np.concatenate([raw["x"], raw["x_test"]]).astype(np.float32)[:, None, :]
    y = np.concatenate([raw["y"], raw["y_test"]]).astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        np.savez(tmp, x=x, y=y)
    os.replace(tmp.name, path)
    return x, y


@functools.lru_cache(maxsize=1)
def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """Return scikit-learn's 1797 8x8 digits: ``[N, 1, 8, 8]`` float32 in [0, 1], int64 labels."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    return x, data.target.astype(np.int64)


def _hf_arrays(split: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """Convert an image-classification split (one image column and ``label``) to arrays."""
    feature = next(name for name in split.column_names if name != "label")
    x = np.asarray(split.with_format("numpy")[feature], dtype=np.float32) / 255.0
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # to [N, C, H, W]
    return x, np.asarray(split["label"], dtype=np.int64)


@functools.lru_cache(maxsize=2)
def _load_hf(dataset_id: str, seed: int) -> tuple[np.ndarray, np.ndarray, ArrayData, int]:
    """Load a Hugging Face image-classification dataset through ``FederatedDataset``.

    Returns the shuffled ``train`` split (the training pool) as arrays, the
    ``test`` split as the central test set and the number of classes. Needs
    network access on first use (afterwards the Hugging Face cache). The pool is
    partitioned by :func:`_partition`, like the offline datasets, so the
    placeholder partitioner given to ``FederatedDataset`` is never used.
    """
    from flwr_datasets import FederatedDataset

    fds = FederatedDataset(dataset=dataset_id, partitioners={"train": 1}, seed=seed)
    train = fds.load_split("train")
    x, y = _hf_arrays(train)
    test = ArrayData(*_hf_arrays(fds.load_split("test")))
    return x, y, test, train.features["label"].num_classes
