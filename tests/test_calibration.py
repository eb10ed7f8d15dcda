"""Noise calibration against the runtime accountant and the analytic Gaussian mechanism."""

import math

import pytest
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from scipy import optimize
from scipy.stats import norm

from fedhog.privacy.accounting import ClientLevelAccountant, privacy_config
from fedhog.privacy.calibration import calibrate_event_noise_multiplier, calibrate_noise_multiplier

N, DELTA, TOL = 1000, 1e-5, 1e-3


def epsilon_after(sigma, sampling, q, rounds, accountant, delta=DELTA):
    """ε of fedhog's runtime accountant after ``rounds`` releases (restored as a checkpoint)."""
    runtime = ClientLevelAccountant(sigma, sampling, q, N, delta, accountant=accountant)
    backend = runtime.state_dict()["backend"]
    backend["compositions"] = [{"event": vars(runtime.event), "count": rounds}]
    runtime.load_state_dict({"releases": rounds, "backend": backend})
    return runtime.epsilon()


@pytest.mark.parametrize("target, rounds, sampling, q, accountant", [
    (8.0, 100, "poisson", 0.1, "pld"),
    (1.0, 100, "poisson", 0.1, "pld"),
    (3.0, 50, "poisson", 0.02, "rdp"),
    (3.0, 20, "fixed", 0.1, "rdp"),
])
def test_calibrated_sigma_is_the_smallest_that_meets_the_target(target, rounds, sampling, q, accountant):
    sigma = calibrate_noise_multiplier(target, DELTA, rounds, sampling, q, N, accountant, tolerance=TOL)
    assert epsilon_after(sigma, sampling, q, rounds, accountant) <= target
    assert epsilon_after(sigma * (1 - TOL), sampling, q, rounds, accountant) > target


def test_pld_needs_less_noise_than_rdp_and_tighter_budgets_need_more():
    pld = calibrate_noise_multiplier(8.0, DELTA, 100, "poisson", 0.1, N, "pld", 0.01)
    rdp = calibrate_noise_multiplier(8.0, DELTA, 100, "poisson", 0.1, N, "rdp", 0.01)
    assert pld < rdp * 0.99
    assert calibrate_noise_multiplier(3.0, DELTA, 100, "poisson", 0.1, N, "pld", 0.01) > pld / 0.99


@pytest.mark.slow
def test_fixed_size_calibrates_twice_the_replace_one_accountant_sigma():
    tol = 0.05  # the relations below are exact at any tolerance
    fixed = calibrate_noise_multiplier(3.0, DELTA, 20, "fixed", 0.1, N, "rdp", tol)
    config = PrivacyConfig(DELTA, N, NeighboringRelation.REPLACE_ONE, SamplingMethod.WITHOUT_REPLACEMENT)
    assert fixed == 2 * calibrate_event_noise_multiplier(3.0, DELTA, 20, config, 100, "rdp", tol)
    # PLD cannot account sampling without replacement: the request falls back to RDP
    assert calibrate_noise_multiplier(3.0, DELTA, 20, "fixed", 0.1, N, "pld", tol) == fixed
    # replace-one doubles the sum's sensitivity, which amplification does not buy back
    assert fixed > 2 * calibrate_noise_multiplier(3.0, DELTA, 20, "poisson", 0.1, N, "rdp", tol)


@pytest.mark.parametrize("epsilon, rounds", [(1.0, 1), (3.0, 100)])
def test_no_amplification_matches_the_analytic_gaussian(epsilon, rounds):
    # T Gaussian releases with σ = one with σ/√T; δ(ε) in closed form (Balle & Wang 2018, Thm 8)
    def delta_gap(s):
        return norm.cdf(1 / (2 * s) - epsilon * s) - math.exp(epsilon) * norm.cdf(-1 / (2 * s) - epsilon * s) - DELTA

    exact = optimize.brentq(delta_gap, 0.01, 100, xtol=1e-12) * math.sqrt(rounds)
    config = PrivacyConfig(DELTA, N, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    sigma = calibrate_event_noise_multiplier(epsilon, DELTA, rounds, config, N, "pld", tolerance=TOL)
    assert exact <= sigma <= exact * (1 + 2 * TOL)


@pytest.mark.parametrize("name, value", [
    ("target_epsilon", 0.0), ("target_epsilon", -1.0), ("target_epsilon", math.inf),
    ("delta", 0.0), ("delta", 1.0), ("rounds", 0), ("rounds", 2.5),
    ("sampling", "uniform"), ("sampling_rate", 0.0), ("sampling_rate", 1.5), ("sampling_rate", 0.1234),
    ("population", 0), ("accountant", "prv"), ("tolerance", 0.0), ("tolerance", 1.0),
])
def test_bad_arguments_are_named(name, value):
    arguments = {"target_epsilon": 3.0, "delta": DELTA, "rounds": 10, "sampling": "poisson",
                 "sampling_rate": 0.1, "population": N, "accountant": "pld", "tolerance": TOL}
    with pytest.raises(ValueError, match=f"^{name}="):
        calibrate_noise_multiplier(**{**arguments, name: value})


def test_pld_cannot_calibrate_sampling_without_replacement():
    with pytest.raises(ValueError, match=r"accountant='pld'.*without-replacement"):
        calibrate_event_noise_multiplier(3.0, DELTA, 10, privacy_config("fixed", N, DELTA), 100, "pld")
