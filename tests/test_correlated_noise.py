"""Correlated noise across rounds (issue 42): strategies, sensitivity, the noise stream, accounting, the planner."""

from __future__ import annotations

import itertools
import math
import pickle

import numpy as np
import pytest
import scipy.linalg
import torch
from dp_accounting import dp_event, rdp
from dp_accounting.pld import PLDAccountant

from fedhog.privacy.accounting import PLD_VALUE_DISCRETIZATION_INTERVAL, ClientLevelAccountant
from fedhog.privacy.calibration import calibrate_noise_multiplier
from fedhog.privacy.correlated.accounting import (
    BandedParticipation,
    amplified_bandmf_event,
    banded_epsilon,
    calibrate_banded_noise_multiplier,
)
from fedhog.privacy.correlated.noise import BandedNoiseStream
from fedhog.privacy.correlated.planner import NoisePrediction, choose_bands, plan_bands
from fedhog.privacy.correlated.release import (
    COEFFICIENT_BITS,
    BandedLatticeRelease,
    dyadic_strategy,
    release_sensitivity_steps,
)
from fedhog.privacy.correlated.sensitivity import max_column_norm, separated_sensitivity
from fedhog.privacy.correlated.strategies import (
    BandedToeplitzStrategy,
    _loss_and_gradient,
    bsr_coefficients,
    mean_prefix_loss,
    optimised_coefficients,
    prefix_sum_matrix,
)
from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SeededBits, lattice_gaussian


def test_bsr_with_every_band_is_the_square_root_of_the_prefix_sum_matrix() -> None:
    rounds = 16
    strategy = BandedToeplitzStrategy.bsr(rounds, rounds)
    matrix = strategy.matrix()
    np.testing.assert_allclose(matrix @ matrix, prefix_sum_matrix(rounds), atol=1e-12)
    np.testing.assert_allclose(matrix, scipy.linalg.sqrtm(prefix_sum_matrix(rounds)).real, atol=1e-10)


@pytest.mark.parametrize("bands", [1, 2, 5])
def test_banded_bsr_is_the_square_root_cut_to_its_bands(bands: int) -> None:
    rounds = 12
    root = scipy.linalg.sqrtm(prefix_sum_matrix(rounds)).real
    lags = np.subtract.outer(np.arange(rounds), np.arange(rounds))
    expected = np.where((lags >= 0) & (lags < bands), root, 0.0)
    strategy = BandedToeplitzStrategy.bsr(rounds, bands)
    assert strategy.bands == bands
    np.testing.assert_allclose(strategy.matrix(), expected, atol=1e-10)


def test_optimised_coefficients_beat_bsr_and_the_gradient_is_right() -> None:
    rounds, bands = 200, 4
    coefficients = np.array([1.0, 0.7, 0.4, 0.2])
    value, gradient = _loss_and_gradient(coefficients, rounds)
    step = 1e-6
    numeric = [(_loss_and_gradient(coefficients + step * e, rounds)[0]
                - _loss_and_gradient(coefficients - step * e, rounds)[0]) / (2 * step) for e in np.eye(bands)]
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6)
    assert value == pytest.approx(mean_prefix_loss(coefficients, rounds))
    optimised = optimised_coefficients(bands, rounds)
    assert mean_prefix_loss(optimised, rounds) < 0.95 * mean_prefix_loss(bsr_coefficients(bands), rounds)


def _seeded_rows(strategy: BandedToeplitzStrategy, dimension: int, std_steps: float, seed: int) -> np.ndarray:
    stream = BandedNoiseStream(strategy, dimension, std_steps)
    return np.stack([stream.next_row(SeededBits(seed, (t,))) for t in range(strategy.rounds)])


def test_the_stream_draws_the_rows_of_the_inverse_strategy_times_the_lattice_noise() -> None:
    strategy = BandedToeplitzStrategy.bsr(7, 3)
    rows = _seeded_rows(strategy, 5, 40.0, seed=11)
    z = np.stack([lattice_gaussian(SeededBits(11, (t,)), 5, 40.0) for t in range(7)]).astype(np.float64)
    np.testing.assert_allclose(rows, np.linalg.solve(strategy.matrix(), z), rtol=1e-12, atol=1e-9)
    exhausted = BandedNoiseStream(strategy, 1, 1.0)
    for t in range(7):
        exhausted.next_row(SeededBits(0, (t,)))
    with pytest.raises(RuntimeError, match="covers 7 rounds"):
        exhausted.next_row(SeededBits(0, (7,)))


def test_one_band_is_exactly_independent_noise() -> None:
    strategy = BandedToeplitzStrategy.bsr(4, 1)
    np.testing.assert_array_equal(strategy.matrix(), np.eye(4))
    rows = _seeded_rows(strategy, 6, 30.0, seed=5)
    expected = np.stack([lattice_gaussian(SeededBits(5, (t,)), 6, 30.0) for t in range(4)])
    np.testing.assert_array_equal(rows, expected)
    assert BandedNoiseStream(strategy, 6, 30.0).buffer_values == 0


def test_the_streams_covariance_is_the_planners_prediction() -> None:
    """Each coordinate is one sample of the T noise values: the sample covariance of d = 20 000 of them against
    s²·C⁻¹C⁻ᵀ and the prefix sums' variances against s²·‖(A C⁻¹)[t, :]‖², each within 5 CLT standard errors."""
    rounds, bands, dimension, std = 6, 3, 20_000, 50.0
    strategy = BandedToeplitzStrategy.bsr(rounds, bands)
    rows = _seeded_rows(strategy, dimension, std, seed=3)
    inverse = np.linalg.inv(strategy.matrix())
    predicted = std**2 * inverse @ inverse.T
    sample = np.cov(rows)
    error = np.sqrt((np.outer(np.diag(predicted), np.diag(predicted)) + predicted**2) / dimension)
    assert np.all(np.abs(sample - predicted) < 5 * error)
    prefix_variance = np.var(np.cumsum(rows, axis=0), axis=1)
    planned = std**2 * strategy.prefix_errors()
    assert np.all(np.abs(prefix_variance - planned) < 5 * planned * math.sqrt(2 / dimension))
    np.testing.assert_allclose(np.diag(predicted), std**2 * strategy.round_errors())
    independent = std**2 * np.arange(1, rounds + 1)  # what a planner that ignored C would predict
    assert np.any(np.abs(prefix_variance - independent) > 5 * independent * math.sqrt(2 / dimension))


def test_the_stream_keeps_its_buffer_to_itself() -> None:
    stream = BandedNoiseStream(BandedToeplitzStrategy.bsr(5, 3), 4, 10.0)
    row = stream.next_row(SeededBits(1, (0,)))
    with pytest.raises(TypeError, match="secret"):
        pickle.dumps(stream)
    assert repr(f"{row[0]:g}") not in repr(stream) and stream.buffer_values == 4


def _brute_force_sensitivity(matrix: np.ndarray, separation: int, most: int) -> float:
    """max over every separated pattern π (|π| ≤ most) and every sign vector of ‖C[:, π]·s‖."""
    rounds = matrix.shape[0]
    best = 0.0
    for size in range(1, most + 1):
        for pattern in itertools.combinations(range(rounds), size):
            if any(b - a < separation for a, b in itertools.pairwise(pattern)):
                continue
            columns = matrix[:, pattern]
            for signs in itertools.product((-1.0, 1.0), repeat=size):
                best = max(best, float(np.linalg.norm(columns @ np.array(signs))))
    return best


@pytest.mark.parametrize("rounds, bands, most", [(7, 2, 4), (8, 3, 3), (8, 3, 2), (6, 1, 6)])
def test_sensitivity_against_every_separated_participation_pattern(rounds: int, bands: int, most: int) -> None:
    rng = np.random.default_rng(rounds * 10 + bands)
    strategies = [BandedToeplitzStrategy.bsr(rounds, bands),
                  BandedToeplitzStrategy(tuple(rng.normal(size=bands).tolist()), rounds, "random")]
    for strategy in strategies:
        matrix = strategy.matrix()
        assert separated_sensitivity(matrix, bands, most) == pytest.approx(
            _brute_force_sensitivity(matrix, bands, most), rel=1e-12)
        assert separated_sensitivity(matrix, bands, 1) == pytest.approx(max_column_norm(matrix), rel=1e-12)
        assert max_column_norm(matrix) == pytest.approx(strategy.max_column_norm(), rel=1e-12)


def test_sensitivity_refuses_participations_closer_than_the_bands() -> None:
    matrix = BandedToeplitzStrategy.bsr(8, 3).matrix()
    with pytest.raises(ValueError, match="not orthogonal"):
        separated_sensitivity(matrix, 2)
    # and the brute force shows why: closer participations move C·X further than the orthogonal formula says
    assert _brute_force_sensitivity(matrix, 2, 4) > math.sqrt(4) * max_column_norm(matrix)


def test_one_band_is_dp_fedavgs_accounting() -> None:
    population, cohort, rounds, delta = 1000, 20, 40, 1e-5
    participation = BandedParticipation(population, cohort, rounds, 1)
    sigma = calibrate_banded_noise_multiplier(2.0, delta, participation, "rdp", tolerance=0.05)
    assert sigma == calibrate_noise_multiplier(2.0, delta, rounds, "poisson", cohort / population, population, "rdp",
                                               tolerance=0.05)
    accountant = ClientLevelAccountant(sigma, "poisson", cohort / population, population, delta, accountant="pld")
    for _ in range(rounds):
        accountant.compose_round()
    assert banded_epsilon(sigma, participation, delta) == pytest.approx(accountant.epsilon(), rel=1e-12)


@pytest.mark.parametrize("population, cohort, rounds, bands, sigma",
                         [(1000, 10, 10, 3, 2.0), (5000, 50, 12, 4, 2.0), (10**5, 1000, 20, 8, 3.5)])
def test_banded_epsilon_is_a_direct_composition_of_the_cycles(population: int, cohort: int, rounds: int,
                                                              bands: int, sigma: float) -> None:
    """ε against ⌈T/b⌉ sampled Gaussians composed one at a time with dp_accounting (RDP adds exactly; PLD's
    convolutions differ by rounding only), and against one cycle fewer (which must give less)."""
    participation = BandedParticipation(population, cohort, rounds, bands)
    cycles = -(-rounds // bands)
    sampled = dp_event.PoissonSampledDpEvent(cohort * bands / population, dp_event.GaussianDpEvent(sigma))
    by_hand_rdp, fewer = rdp.RdpAccountant(), rdp.RdpAccountant()
    by_hand_pld = PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
    for cycle in range(cycles):
        by_hand_rdp.compose(sampled)
        by_hand_pld.compose(sampled)
        if cycle:
            fewer.compose(sampled)
    assert banded_epsilon(sigma, participation, 1e-5, "rdp") == pytest.approx(by_hand_rdp.get_epsilon(1e-5), rel=1e-9)
    assert banded_epsilon(sigma, participation, 1e-5, "pld") == pytest.approx(by_hand_pld.get_epsilon(1e-5), rel=1e-2)
    assert banded_epsilon(sigma, participation, 1e-5, "rdp") > fewer.get_epsilon(1e-5)
    assert amplified_bandmf_event(sigma, participation) == dp_event.SelfComposedDpEvent(sampled, cycles)


def test_calibration_meets_the_budget_and_no_less_noise_would() -> None:
    participation = BandedParticipation(10_000, 100, 60, 4)
    sigma = calibrate_banded_noise_multiplier(1.5, 1e-5, participation, "rdp", tolerance=1e-2)
    assert banded_epsilon(sigma, participation, 1e-5, "rdp") <= 1.5
    assert banded_epsilon(sigma * (1 - 2e-2), participation, 1e-5, "rdp") > 1.5


def test_participation_groups_and_its_limits() -> None:
    participation = BandedParticipation(100, 10, 9, 4)
    assert participation.sampling_probability == pytest.approx(0.4) and participation.cycles == 3
    assert [participation.active_group(t) for t in range(6)] == [0, 1, 2, 3, 0, 1]
    assert participation.group_of(7) == 3
    with pytest.raises(ValueError, match="cohort=10 × bands=11 exceeds population=100"):
        BandedParticipation(100, 10, 20, 11)
    with pytest.raises(ValueError, match="bands=10 exceeds rounds=9"):
        BandedParticipation(100, 10, 9, 10)


def _prediction(bands: int, ratio: float) -> NoisePrediction:
    return NoisePrediction(BandedToeplitzStrategy.bsr(10, bands), 1.0, ratio, 1.0, ratio, 1.0)


def test_choose_bands_never_picks_a_strategy_predicted_worse_than_independent_noise() -> None:
    assert choose_bands([_prediction(1, 1.0), _prediction(2, 1.05), _prediction(4, 1.2)]).bands == 1
    assert choose_bands([_prediction(1, 1.0), _prediction(2, 0.9), _prediction(4, 0.9)]).bands == 2
    with pytest.raises(ValueError, match="b = 1"):
        choose_bands([_prediction(2, 0.5)])


def test_the_planner_keeps_independent_noise_where_correlation_does_not_pay() -> None:
    """The convergence federation at ε = 1 (issue 42: BSR predicted 1.05 at b = 2): b = 1 is chosen."""
    plan = plan_bands(1000, 100, 100, 1.0, 1e-5, [2, 20], "bsr", tolerance=1e-2)
    assert [p.bands for p in plan] == [1, 2]  # b = 20 would need K·b > N
    assert plan[0].ratio == 1.0 and all(p.ratio > 1.0 for p in plan[1:])
    assert plan[1].ratio == pytest.approx(1.05, abs=0.01)
    assert choose_bands(plan).bands == 1


def _sums(rounds: int, dimension: int, seed: int, scale: int = 2**50) -> np.ndarray:
    return np.random.default_rng(seed).integers(-scale, scale, size=(rounds, dimension), dtype=np.int64)


def test_the_exact_release_encodes_c_times_s_in_exact_integers() -> None:
    strategy = dyadic_strategy(BandedToeplitzStrategy.optimised(9, 4))
    sums = _sums(9, 6, seed=1, scale=2**54)
    numerators = [int(c * 2**COEFFICIENT_BITS) for c in strategy.coefficients]
    release = BandedLatticeRelease(strategy, 2.0**-30, 1e6)
    for t in range(9):
        lattice_release, _ = release.release(sums[t], SeededBits(8, (t,)))
        encoded = lattice_release - lattice_gaussian(SeededBits(8, (t,)), 6, 1e6)  # R_t: the release less its z_t
        exact = [sum(numerators[k] * int(sums[t - k][i]) for k in range(min(4, t + 1))) for i in range(6)]
        assert encoded.tolist() == [(value + 2**(COEFFICIENT_BITS - 1)) >> COEFFICIENT_BITS for value in exact]
    with pytest.raises(OverflowError):
        BandedLatticeRelease(strategy, 1.0, 1.0).release(np.full(6, 2**55, dtype=np.int64), SeededBits(0, (0,)))


def test_the_exact_release_is_c_inverse_of_a_lattice_point() -> None:
    strategy, granularity = dyadic_strategy(BandedToeplitzStrategy.bsr(8, 3)), 2.0**-20
    sums = _sums(8, 5, seed=2, scale=2**30)
    release = BandedLatticeRelease(strategy, granularity, 1e5)
    lattice, model = zip(*(release.release(sums[t], SeededBits(4, (t,))) for t in range(8)), strict=True)
    lattice_release, model_sums = np.stack(lattice), np.stack(model)
    assert lattice_release.dtype == np.int64  # the private release: integers, nothing of the data's float bits
    np.testing.assert_allclose(strategy.matrix() @ model_sums / granularity, lattice_release, rtol=0, atol=1e-3)
    noise = lattice_release - strategy.matrix() @ sums.astype(np.float64)  # z + rounding residue, |residue| ≤ ½
    z = np.stack([lattice_gaussian(SeededBits(4, (t,)), 5, 1e5) for t in range(8)])
    assert np.max(np.abs(noise - z)) <= 0.5 + 1e-3


@pytest.mark.parametrize("bands, round_changed", [(3, 2), (4, 0), (1, 3)])
def test_one_participation_moves_the_release_by_at_most_its_sensitivity(bands: int, round_changed: int) -> None:
    rounds, dimension, step_bound = 8, 50, 1000.0
    strategy = dyadic_strategy(BandedToeplitzStrategy.bsr(rounds, bands))
    sums = _sums(rounds, dimension, seed=3, scale=2**40)
    rng = np.random.default_rng(bands)
    delta = rng.normal(size=dimension)
    delta = np.round(delta / np.linalg.norm(delta) * step_bound * 0.999).astype(np.int64)
    neighbour = sums.copy()
    neighbour[round_changed] += delta
    releases = []
    for data in (sums, neighbour):
        release = BandedLatticeRelease(strategy, 1.0, 1e4)
        releases.append(np.stack([release.release(data[t], SeededBits(9, (t,)))[0] for t in range(rounds)]))
    moved = releases[1] - releases[0]
    touched = np.zeros(rounds, dtype=bool)
    touched[round_changed:round_changed + bands] = True
    assert not moved[~touched].any()
    np.testing.assert_array_equal(moved[round_changed], delta)  # c_0 = 1: the participation's own row, exactly
    bound = release_sensitivity_steps(strategy, step_bound, dimension)
    assert np.linalg.norm(moved) <= bound
    assert np.linalg.norm(moved) > strategy.max_column_norm() * np.linalg.norm(delta) - math.sqrt(bands * dimension)


def test_one_band_releases_exactly_what_dp_fedavg_releases() -> None:
    mechanism = GaussianMechanism(clipping_norm=1.0, noise_multiplier=1.3)
    lattice = NoiseLattice.for_settings(mechanism, 40)
    std_steps = lattice.sum_std(mechanism) / lattice.granularity
    release = BandedLatticeRelease(dyadic_strategy(BandedToeplitzStrategy.independent(3)), lattice.granularity,
                                   std_steps)
    for t, data in enumerate(_sums(3, 40, seed=5, scale=2**42)):
        expected, _ = mechanism.add_noise(torch.from_numpy(data), lattice, SeededBits(7, (t,)), 10)
        _, model_sum = release.release(data, SeededBits(7, (t,)))
        np.testing.assert_array_equal(model_sum, expected.numpy())
    assert release_sensitivity_steps(release.strategy, 5.0, 40) == 5.0


def test_the_exact_release_refuses_what_it_cannot_do_exactly_and_keeps_its_buffer() -> None:
    with pytest.raises(ValueError, match="dyadic_strategy"):
        BandedLatticeRelease(BandedToeplitzStrategy((1.0, 0.1), 4), 1.0, 1.0)
    release = BandedLatticeRelease(dyadic_strategy(BandedToeplitzStrategy.bsr(4, 2)), 1.0, 1.0)
    release.release(np.arange(3, dtype=np.int64), SeededBits(0, (0,)))
    with pytest.raises(TypeError, match="secret"):
        pickle.dumps(release)
    with pytest.raises(TypeError, match="int64"):
        release.release(np.zeros(3), SeededBits(0, (1,)))
