"""Client-level DP on a tiny federation is said, with its numbers; fedhog's exact split is public for a baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedhog.config import RunConfig
from fedhog.server_app import build_strategy


def _strategy(**keys):
    config = RunConfig.from_mapping({"mechanism": "gaussian", **keys})
    strategy = build_strategy(config)
    strategy.slot_of_node = {node: node for node in range(config.population)}
    return strategy


def test_five_hospitals_are_warned_with_the_numbers_behind_it():
    strategy = _strategy(population=5, **{"sampling-rate": 1.0, "noise-multiplier": 2.0, "delta": 1e-3})
    warning = strategy.small_federation_warning(410)
    noise = 2.0 * 1.0 * math.sqrt(410) / 5  # σ·C·√d/K, the expected norm of the noise on the average
    assert warning.startswith("small federation:") and f"≈ {noise:.3g}" in warning
    assert "K = 5 expected of N = 5 clients" in warning and f"{2.0 / 5:.3g} per coordinate" in warning


def test_the_quickstarts_federation_is_not_warned():
    strategy = _strategy(population=10000, **{"sampling-rate": 0.05, "noise-multiplier": 1.031})
    assert strategy.small_federation_warning(7460) == ""  # σ·√d/K = 0.18: the noise is shorter than C


def test_no_guarantee_no_warning():
    strategy = _strategy(population=5, mechanism="none", **{"sampling-rate": 1.0, "delta": 1e-3})
    assert strategy.small_federation_warning(410) == ""


def test_the_noise_norm_the_warning_quotes_is_the_mechanisms():
    """The expected norm of d Gaussian coordinates of std σC/K is σC√d/K (to within 1/(4d)): checked by sampling."""
    sigma, clip, cohort, dimension = 2.0, 1.0, 5, 410
    draws = np.random.default_rng(0).normal(0.0, sigma * clip / cohort, size=(2000, dimension))
    assert np.linalg.norm(draws, axis=1).mean() == pytest.approx(sigma * clip * math.sqrt(dimension) / cohort,
                                                                 rel=2e-3)


def test_the_central_split_is_the_clients_training_data_pooled_and_the_test_set():
    import fedhog
    from fedhog.data import load_client_data, load_test_set

    keys = {"dataset": "digits", "population": 10, "sampling-rate": 0.1, "seed": 3, "partitioner": "iid"}
    train, test = fedhog.central_split(keys)
    spec = RunConfig.from_mapping(keys).data_spec
    clients = [load_client_data(spec, i) for i in range(10)]
    np.testing.assert_array_equal(train.x, np.concatenate([c[0].x for c in clients]))
    np.testing.assert_array_equal(train.y, np.concatenate([c[0].y for c in clients]))
    np.testing.assert_array_equal(test.x, load_test_set(spec).x)
    validation = sum(len(c[1]) for c in clients)
    assert len(train) + validation + len(test) == 1797  # every example of scikit-learn's digits, each once
    rows = {row.tobytes() for row in train.x}
    assert not any(row.tobytes() in rows for row in test.x)  # disjoint (digits has no duplicate images across)
