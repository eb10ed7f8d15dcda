"""Adaptive clipping (Andrew et al. 2021): the noise split, its privacy, the quantile it tracks, its noise."""

import json
import math
import random

import numpy as np
import pytest
import torch
from dp_accounting import ComposedDpEvent, GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.rdp import RdpAccountant
from flwr.supercore.differential_privacy import compute_adaptive_noise_params
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from fedhog.privacy.adaptive_clipping import (
    AdaptiveClipping,
    AdaptiveClippingSettings,
    ClippingStep,
    default_count_noise_std,
    update_noise_multiplier,
)
from fedhog.privacy.lattice import LATTICE_BITS
from fedhog.privacy.randomness import SeededBits, discrete_gaussian


def generator(seed: int = 0) -> SeededBits:
    """A seeded noise stream (the round's noise stream in a run)."""
    return SeededBits(seed)


def clipper(sigma: float = 0.0, **overrides) -> AdaptiveClipping:
    values = {"initial_clipping_norm": 1.0, "count_noise_std": 0.0, "target_quantile": 0.5, "learning_rate": 0.2}
    return AdaptiveClipping(AdaptiveClippingSettings(**{**values, **overrides}), sigma)


# --- σ_Δ: the update's share of σ --------------------------------------------


def test_update_noise_multiplier_hand_computations():
    # σ = 1, σ_b = 1:  (1 − 1/4)^(−1/2) = 2/√3
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx(2 / math.sqrt(3), rel=1e-14)
    # σ = 2, σ_b = 5:  (1/4 − 1/100)^(−1/2) = 1/√0.24
    assert update_noise_multiplier(2.0, 5.0) == pytest.approx(1 / math.sqrt(0.24), rel=1e-14)
    # σ = 0.8, σ_b = 0.5 (K = 10 at the paper's K/20):  (1/0.64 − 1)^(−1/2) = 0.8/0.6
    assert update_noise_multiplier(0.8, 0.5) == pytest.approx(4 / 3, rel=1e-14)


def test_update_noise_multiplier_limits():
    assert update_noise_multiplier(1.3, math.inf) == 1.3  # an infinitely noisy count costs nothing
    assert update_noise_multiplier(0.0, 0.0) == 0.0  # no guarantee: nothing to share
    assert update_noise_multiplier(0.0, 3.0) == 0.0
    # just above σ_b = σ/2 the update needs almost unbounded noise
    assert update_noise_multiplier(1.0, 0.5 + 1e-9) > 1e3


def test_update_noise_multiplier_agrees_with_flower():
    for sigma, cohort, sigma_b in [(1.0, 100, 5.0), (0.7, 40, 2.0), (2.5, 1000, 50.0), (1.0, 10, 0.75)]:
        flower_sigma_b, flower_sigma_delta = compute_adaptive_noise_params(sigma, cohort, sigma_b)
        assert flower_sigma_b == sigma_b
        assert update_noise_multiplier(sigma, sigma_b) == pytest.approx(flower_sigma_delta, rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(sigma=st.floats(0.01, 100.0), ratio=st.floats(0.5001, 1e4))
def test_update_and_count_compose_to_sigma(sigma, ratio):
    """1/σ² = 1/σ_Δ² + (½/σ_b)²: sensitivities C and ½ against noise σ_Δ·C and σ_b."""
    sigma_b = ratio * sigma
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    assert sigma_delta >= sigma
    assert sigma_delta ** -2 + (0.5 / sigma_b) ** 2 == pytest.approx(sigma ** -2, rel=1e-9)


CASES = [(1.0, 1.0), (0.8, 0.5), (2.0, 5.0), (0.6, 0.31)]  # (σ, σ_b); the count's share varies from 1% to 94%


@pytest.mark.parametrize("sigma,sigma_b", CASES)
def test_rdp_of_the_pair_equals_one_gaussian_with_sigma(sigma, sigma_b):
    """dp_accounting composes the two releases; the result is the single Gaussian the accountant composes."""
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    # the count: sensitivity ½, noise std σ_b  →  multiplier σ_b / ½ = 2σ_b
    pair = ComposedDpEvent([GaussianDpEvent(sigma_delta), GaussianDpEvent(2 * sigma_b)])
    for event_pair, event_one in [
        (pair, GaussianDpEvent(sigma)),
        (PoissonSampledDpEvent(0.01, pair), PoissonSampledDpEvent(0.01, GaussianDpEvent(sigma))),
    ]:
        joint, single = RdpAccountant(), RdpAccountant()
        joint.compose(event_pair, 200)
        single.compose(event_one, 200)
        assert joint.get_epsilon(1e-5) == pytest.approx(single.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("sigma,sigma_b", CASES)
def test_replace_one_pair_equals_gaussian_with_half_sigma(sigma, sigma_b):
    """Fixed-size sampling: sensitivities 2C and 1, so the pair is the σ/2 the accountant composes for 'fixed'."""
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    joint, single = RdpAccountant(), RdpAccountant()
    joint.compose(ComposedDpEvent([GaussianDpEvent(sigma_delta / 2), GaussianDpEvent(sigma_b)]), 50)
    single.compose(GaussianDpEvent(sigma / 2), 50)
    assert joint.get_epsilon(1e-5) == pytest.approx(single.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize("sigma,sigma_b", CASES)
def test_pld_of_the_pair_equals_one_gaussian_with_sigma(sigma, sigma_b):
    """Numerical PLD composition (no closed form used) agrees; counting b_i uncentred would not."""
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    interval = 1e-3

    def gaussian(std, sensitivity):
        return pld.from_gaussian_mechanism(std, sensitivity=sensitivity, value_discretization_interval=interval)

    for delta in (1e-3, 1e-5):
        single = gaussian(sigma, 1.0).get_epsilon_for_delta(delta)
        joint = gaussian(sigma_delta, 1.0).compose(gaussian(sigma_b, 0.5)).get_epsilon_for_delta(delta)
        assert joint == pytest.approx(single, abs=1e-2)
        uncentred = gaussian(sigma_delta, 1.0).compose(gaussian(sigma_b, 1.0)).get_epsilon_for_delta(delta)
        assert uncentred > single + 0.02


def _hockey_stick(p: np.ndarray, q: np.ndarray, epsilon: float, cell: float) -> float:
    return float(np.maximum(p - math.exp(epsilon) * q, 0.0).sum() * cell)


def test_subsampled_pair_has_the_privacy_profile_of_one_subsampled_gaussian():
    """Theorem 1 under Poisson subsampling, by quadrature of δ(ε) on the 2-d release itself.

    In units of the noise, one client shifts the pair (sum, count) by
    v = (1/σ_Δ, ½/σ_b); the subsampled release is (1−q)·N(0, I) + q·N(v, I)
    against N(0, I) (both directions). Its δ(ε) must be that of the 1-d
    subsampled Gaussian with shift 1/σ.
    """
    sigma, sigma_b, q = 1.0, 1.0, 0.2
    sigma_delta = update_noise_multiplier(sigma, sigma_b)
    h = 0.02
    axis = np.arange(-9.0, 10.0, h)
    x, y = np.meshgrid(axis, axis, indexing="ij")
    phi = scipy_stats.norm.pdf
    absent_1d = phi(axis)
    present_1d = (1 - q) * absent_1d + q * phi(axis - 1 / sigma)
    absent_2d = phi(x) * phi(y)

    def present_2d(count_sensitivity):
        return (1 - q) * absent_2d + q * phi(x - 1 / sigma_delta) * phi(y - count_sensitivity / sigma_b)

    centred, uncentred = present_2d(0.5), present_2d(1.0)
    for epsilon in (0.02, 0.1, 0.15):  # the remove direction is 0 beyond log(1/(1 − q)) ≈ 0.22
        for forward in (True, False):
            def delta(present, absent, cell, epsilon=epsilon, forward=forward):
                return _hockey_stick(present, absent, epsilon, cell) if forward else \
                    _hockey_stick(absent, present, epsilon, cell)

            one = delta(present_1d, absent_1d, h)
            assert one > 1e-4  # a profile that matters, not two zeros
            assert delta(centred, absent_2d, h * h) == pytest.approx(one, rel=1e-4)
            # counting b_i ∈ {0, 1} (sensitivity 1) with the same σ_b would spend visibly more
            assert delta(uncentred, absent_2d, h * h) > 1.05 * one


# --- validation ----------------------------------------------------------------


@pytest.mark.parametrize("sigma,sigma_b,pattern", [
    (1.0, 0.5, r"count_noise_std=0\.5 must exceed total_noise_multiplier/2 = 0\.5 \(total_noise_multiplier=1\.0\)"),
    (2.0, 0.3, r"count_noise_std=0\.3 must exceed .*total_noise_multiplier=2\.0"),
    (-1.0, 1.0, r"total_noise_multiplier=-1\.0"),
    (math.nan, 1.0, r"total_noise_multiplier=nan"),
    (math.inf, 1.0, r"total_noise_multiplier=inf"),
    (1.0, -0.1, r"count_noise_std=-0\.1"),
    (1.0, math.nan, r"count_noise_std=nan"),
])
def test_update_noise_multiplier_rejects(sigma, sigma_b, pattern):
    with pytest.raises(ValueError, match=pattern):
        update_noise_multiplier(sigma, sigma_b)


@pytest.mark.parametrize("field,value", [
    ("target_quantile", 0.0), ("target_quantile", 1.0), ("target_quantile", -0.2), ("target_quantile", 1.5),
    ("target_quantile", math.nan), ("learning_rate", 0.0), ("learning_rate", -0.2), ("learning_rate", math.inf),
    ("learning_rate", math.nan), ("initial_clipping_norm", 0.0), ("initial_clipping_norm", -1.0),
    ("initial_clipping_norm", math.inf), ("count_noise_std", -1.0), ("count_noise_std", math.nan),
    ("count_noise_std", math.inf),
])
def test_settings_reject_bad_values_by_name(field, value):
    values = {"initial_clipping_norm": 0.1, "count_noise_std": 5.0, "target_quantile": 0.5, "learning_rate": 0.2}
    with pytest.raises(ValueError, match=rf"^{field}={value!r}"):
        AdaptiveClippingSettings(**{**values, field: value})


def test_clipper_rejects_count_noise_too_small_for_sigma():
    with pytest.raises(ValueError, match=r"count_noise_std=0\.5 .*total_noise_multiplier=1\.2"):
        clipper(sigma=1.2, count_noise_std=0.5)


def test_step_rejects_bad_inputs():
    c = clipper()
    with pytest.raises(ValueError, match=r"expected_cohort=0 "):
        c.step([1.0], 0, generator())
    with pytest.raises(ValueError, match=r"expected_cohort=nan"):
        c.step([1.0], math.nan, generator())
    with pytest.raises(ValueError, match=r"norms_before_clip holds nan"):
        c.step([1.0, math.nan], 10, generator())
    with pytest.raises(ValueError, match=r"norms_before_clip holds -1\.0"):
        c.step([-1.0], 10, generator())
    with pytest.raises(TypeError, match=r"bits=.* must be a RandomBits stream"):
        c.step([1.0], 10, np.random.default_rng(0))
    assert c.clipping_norm == 1.0 and c.steps == 0  # nothing moved


def test_default_count_noise_std():
    assert default_count_noise_std(100) == pytest.approx(5.0)
    with pytest.raises(ValueError, match=r"expected_cohort=0"):
        default_count_noise_std(0)


# --- one step, by hand ---------------------------------------------------------


def test_step_hand_examples():
    c = clipper(initial_clipping_norm=2.0, target_quantile=0.5, learning_rate=0.2)
    assert c.update_noise_multiplier == 0.0
    # K = 4, all four under C (2.0 itself is not clipped): b̃ = 1, C ← 2·exp(−0.2·0.5)
    result = c.step([0.1, 1.0, 2.0, 1.5], 4, generator())
    assert result == ClippingStep(2.0, 1.0, 2.0 * math.exp(-0.1))
    assert c.clipping_norm == pytest.approx(2.0 * math.exp(-0.1), rel=1e-15)
    # three of four above C: b̃ = 0.25, C ← C·exp(+0.2·0.25)
    before = c.clipping_norm
    result = c.step([0.1, 5.0, 6.0, 7.0], 4, generator())
    assert result.noisy_unclipped_fraction == pytest.approx(0.25, abs=1e-15)
    assert c.clipping_norm == pytest.approx(before * math.exp(0.05), rel=1e-15)
    assert c.steps == 2


def test_step_centres_the_count_when_the_cohort_differs_from_K():
    # Poisson sampling: 3 contributions for K = 10, two under C.
    # b̃ = (½ + ½ − ½)/10 + ½ = 0.55 (the number of contributions is not released)
    c = clipper(initial_clipping_norm=1.0, target_quantile=0.3, learning_rate=0.5)
    result = c.step([0.2, 0.9, 3.0], 10, generator())
    assert result.noisy_unclipped_fraction == pytest.approx(0.55, abs=1e-15)
    assert c.clipping_norm == pytest.approx(math.exp(-0.5 * 0.25), rel=1e-15)
    # no contributions at all: b̃ = ½ exactly without noise
    assert clipper().step([], 10, generator()).noisy_unclipped_fraction == 0.5


def test_out_of_range_fraction_is_clamped_before_the_update():
    # 30 contributions under C for K = 10: b̃ = 15/10 + ½ = 2, used as 1
    c = clipper(initial_clipping_norm=1.0, target_quantile=0.5, learning_rate=0.2)
    result = c.step([0.5] * 30, 10, generator())
    assert result.noisy_unclipped_fraction == pytest.approx(2.0)
    assert c.clipping_norm == pytest.approx(math.exp(-0.2 * 0.5), rel=1e-15)


# --- the count's noise -----------------------------------------------------------


def test_count_noise_is_the_streams_discrete_gaussian_on_the_lattice():
    sigma_b, cohort = 3.0, 50
    granularity = 2.0 ** (1 - LATTICE_BITS)  # 2^(⌊log2 3⌋ − 40)
    c = clipper(sigma=1.0, initial_clipping_norm=1.0, count_noise_std=sigma_b)
    mirror = generator(7)
    g = generator(7)
    for _ in range(20):
        norms = [0.5 * c.clipping_norm] * 25 + [2.0 * c.clipping_norm] * 25  # exactly half under C
        result = c.step(norms, cohort, g)
        steps = int(discrete_gaussian(mirror, 1, sigma_b / granularity)[0])
        assert result.noisy_unclipped_fraction == 0.5 + steps * granularity / cohort


def test_count_noise_std_is_statistically_correct():
    sigma_b, cohort, draws = 4.0, 100, 20000
    c = clipper(sigma=1.0, initial_clipping_norm=1.0, count_noise_std=sigma_b, learning_rate=1e-6)
    g = generator(11)
    errors = np.empty(draws)
    for k in range(draws):
        norms = [0.5 * c.clipping_norm] * 50 + [2.0 * c.clipping_norm] * 50
        errors[k] = c.step(norms, cohort, g).noisy_unclipped_fraction - 0.5
    scale = sigma_b / cohort
    # sample std: relative standard error 1/√(2n) = 0.5%; allow 4 standard errors
    assert errors.std(ddof=1) == pytest.approx(scale, rel=4 / math.sqrt(2 * draws))
    assert abs(errors.mean()) < 4 * scale / math.sqrt(draws)
    assert scipy_stats.kstest(errors / scale, "norm").pvalue > 1e-3


def test_zero_count_noise_draws_nothing():
    g, mirror = generator(3), generator(3)
    clipper().step([1.0, 2.0], 4, g)
    assert np.array_equal(g.words(4), mirror.words(4))  # σ_b = 0: the stream is where it was


def test_global_rngs_untouched():
    torch_state, numpy_state, python_state = torch.get_rng_state(), np.random.get_state(), random.getstate()
    c = clipper(sigma=1.0, count_noise_std=5.0)
    g = generator(5)
    for _ in range(50):
        c.step([0.3, 1.2, 0.8, 2.5], 4, g)
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]
    assert random.getstate() == python_state


# --- the quantile it tracks ----------------------------------------------------


@pytest.mark.parametrize("target,count_noise_std", [(0.5, 0.0), (0.8, 0.0), (0.3, 0.0), (0.5, 5.0)])
def test_clipping_norm_converges_to_the_target_quantile_of_lognormal_norms(target, count_noise_std):
    """Norms ~ lognormal(μ=1, s=0.5); from C = 0.1 the norm settles at exp(μ + s·Φ⁻¹(γ_q)).

    Linearising log C's update gives a stationary spread of ≈ 2% per round
    (K = 100, η_C = 0.2), and successive rounds are correlated over ~6
    rounds, so the geometric mean of the last 400 rounds is within ≈ 0.5%
    of the quantile; allow 3%. σ_b = 5 (K/20) doubles the variance of b̃.
    """
    mu, s, cohort = 1.0, 0.5, 100
    sigma = 1.0 if count_noise_std else 0.0
    c = clipper(sigma=sigma, initial_clipping_norm=0.1, count_noise_std=count_noise_std,
                target_quantile=target, learning_rate=0.2)
    data = np.random.default_rng(1234)
    g = generator(99)
    history = []
    for _ in range(600):
        norms = data.lognormal(mean=mu, sigma=s, size=cohort)
        history.append(c.step(norms.tolist(), cohort, g).next_clipping_norm)
    settled = math.exp(np.mean(np.log(history[200:])))
    quantile = math.exp(mu + s * scipy_stats.norm.ppf(target))
    assert settled == pytest.approx(quantile, rel=0.03)
    # and it really clips 1 − γ_q of fresh norms
    fresh = data.lognormal(mean=mu, sigma=s, size=200_000)
    assert np.mean(fresh <= settled) == pytest.approx(target, abs=0.02)


def test_geometric_update_reaches_a_far_quantile_in_logarithmic_time():
    # all norms = 1000 ≫ C = 0.1: every round b̃ = 0 and C grows by exp(η_C·γ_q) = exp(0.1)
    c = clipper(initial_clipping_norm=0.1, target_quantile=0.5, learning_rate=0.2)
    g = generator()
    rounds = 0
    while c.clipping_norm < 1000:
        c.step([1000.0] * 10, 10, g)
        rounds += 1
    assert rounds == math.ceil(math.log(1000 / 0.1) / 0.1)


# --- checkpoints ---------------------------------------------------------------


def test_state_dict_round_trip_continues_identically():
    def run(c, g, rounds, data):
        return [c.step(data.lognormal(0.0, 1.0, size=20).tolist(), 20, g) for _ in range(rounds)]

    c = clipper(sigma=1.0, initial_clipping_norm=0.1, count_noise_std=1.0)
    run(c, generator(21), 15, np.random.default_rng(0))
    state = json.loads(json.dumps(c.state_dict()))  # plain Python, survives JSON
    expected = run(c, generator(22), 15, np.random.default_rng(1))  # later rounds: streams of their own

    resumed = clipper(sigma=1.0, initial_clipping_norm=0.1, count_noise_std=1.0)
    resumed.load_state_dict(state)
    assert resumed.steps == 15 and resumed.clipping_norm == state["clipping_norm"]
    assert run(resumed, generator(22), 15, np.random.default_rng(1)) == expected
    assert resumed.state_dict() == c.state_dict()


@pytest.mark.parametrize("state,pattern", [
    ({"clipping_norm": 0.0, "steps": 3}, r"state\['clipping_norm'\]=0\.0"),
    ({"clipping_norm": math.inf, "steps": 3}, r"state\['clipping_norm'\]=inf"),
    ({"clipping_norm": 1.0, "steps": -1}, r"state\['steps'\]=-1"),
])
def test_load_state_dict_rejects_bad_state(state, pattern):
    c = clipper()
    with pytest.raises(ValueError, match=pattern):
        c.load_state_dict(state)
    assert c.clipping_norm == 1.0 and c.steps == 0
