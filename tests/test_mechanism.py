"""The higher-order mixing and the Gaussian mechanism, against hand computations and statistics."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from fedhog.privacy.mechanism import (
    Contribution,
    MechanismSettings,
    aggregate,
    clip_to_norm,
    mix_third_order,
)
from fedhog.privacy.rng import PrivacyRng

F64 = torch.float64


def t64(*values):
    return torch.tensor(values, dtype=F64)


# --- mix_third_order ---------------------------------------------------------


def test_mix_third_order_hand_example():
    # Δ = (3, 4), ‖Δ‖ = 5; t = (0, 2), ‖t‖ = 2; γ = 0.5, ξ = -1.2
    # scale = 0.5 · (-1.2) · 5 / 2 = -1.5  →  u = (3, 4 - 3) = (3, 1)
    u = mix_third_order(t64(3, 4), t64(0, 2), mixing_strength=0.5, xi=-1.2)
    torch.testing.assert_close(u, t64(3.0, 1.0), rtol=0, atol=1e-12)


def test_mix_third_order_second_hand_example():
    # Δ = (1, 0, 2), ‖Δ‖ = √5; t = (2, -1, 2), ‖t‖ = 3; γ = 2, ξ = 0.3
    # scale = 2 · 0.3 · √5 / 3 = 0.2 √5
    scale = 0.2 * math.sqrt(5)
    u = mix_third_order(t64(1, 0, 2), t64(2, -1, 2), mixing_strength=2.0, xi=0.3)
    torch.testing.assert_close(u, t64(1 + 2 * scale, -scale, 2 + 2 * scale), rtol=0, atol=1e-12)


def test_mixing_term_norm_is_gamma_abs_xi_times_update_norm():
    # ‖u - Δ‖ = γ |ξ| ‖Δ‖ whatever the scale of t (the term contributes only a direction).
    gen = torch.Generator().manual_seed(3)
    update = torch.randn(50, generator=gen, dtype=F64)
    term = 1e4 * torch.randn(50, generator=gen, dtype=F64)
    u = mix_third_order(update, term, mixing_strength=0.7, xi=-2.5)
    assert float(torch.linalg.vector_norm(u - update)) == pytest.approx(
        0.7 * 2.5 * float(torch.linalg.vector_norm(update)), rel=1e-12
    )


def test_mix_third_order_zero_term_returns_update():
    update = t64(3, -4, 1)
    u = mix_third_order(update, torch.zeros(3, dtype=F64), mixing_strength=0.5, xi=1.7)
    assert torch.equal(u, update)
    assert u is not update  # a copy: later in-place work cannot alter the reply


def test_mix_third_order_zero_update_or_zero_gamma_returns_update():
    zero = torch.zeros(3, dtype=F64)
    assert torch.equal(mix_third_order(zero, t64(1, 2, 3), 0.5, 1.0), zero)
    assert torch.equal(mix_third_order(t64(1, 2, 3), t64(4, 5, 6), 0.0, 1.0), t64(1, 2, 3))


# --- clip_to_norm --------------------------------------------------------------

# entries below 1e-100 become 0: their squares underflow, and a norm of ~1e-200 read as 0 is no bug
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False).map(
    lambda v: 0.0 if abs(v) < 1e-100 else v)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(values=st.lists(finite, min_size=1, max_size=40),
       clipping_norm=st.floats(min_value=1e-3, max_value=1e3))
def test_clip_to_norm_properties(values, clipping_norm):
    vector = torch.tensor(values, dtype=F64)
    true_norm = math.hypot(*values)  # no underflow for tiny entries
    clipped, norm_before = clip_to_norm(vector, clipping_norm)

    assert norm_before == pytest.approx(true_norm, rel=1e-9, abs=1e-300)
    clipped_norm = float(torch.linalg.vector_norm(clipped))
    assert clipped_norm <= clipping_norm * (1 + 1e-12)
    if true_norm <= clipping_norm * (1 - 1e-9):
        assert torch.equal(clipped, vector)  # under C: untouched
    else:
        assert clipped_norm == pytest.approx(clipping_norm, rel=1e-9)  # over C: exactly on the sphere
    if true_norm > 0:
        # same direction: clipped = c · vector with 0 < c ≤ 1
        expected = vector * min(1.0, clipping_norm / true_norm)
        torch.testing.assert_close(clipped, expected, rtol=1e-9, atol=1e-9 * clipping_norm)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(values=st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=1, max_size=20).filter(
           lambda v: math.hypot(*v) > 1e-3),
       clipping_norm=st.floats(min_value=1e-3, max_value=1e3),
       ratio=st.one_of(st.sampled_from([0.5, 1 - 1e-6, 1 + 1e-6, 1.001, 1.01, 1.1, 2.0]),
                       st.floats(min_value=0.0, max_value=5.0)))
def test_clip_to_norm_near_the_bound(values, clipping_norm, ratio):
    # vectors whose norm is ratio · C, including just above and just below C
    direction = torch.tensor(values, dtype=F64) / math.hypot(*values)
    vector = direction * (ratio * clipping_norm)
    clipped, _ = clip_to_norm(vector, clipping_norm)
    if ratio > 1 + 1e-9:
        assert float(torch.linalg.vector_norm(clipped)) == pytest.approx(clipping_norm, rel=1e-9)
        torch.testing.assert_close(clipped, direction * clipping_norm, rtol=1e-9, atol=1e-12)
    elif ratio < 1 - 1e-9:
        assert torch.equal(clipped, vector)


def test_clip_to_norm_hand_example():
    clipped, norm = clip_to_norm(t64(3, 4), 1.0)
    assert norm == 5.0
    torch.testing.assert_close(clipped, t64(0.6, 0.8), rtol=0, atol=1e-15)
    same, norm = clip_to_norm(t64(0.3, 0.4), 1.0)
    assert norm == pytest.approx(0.5) and torch.equal(same, t64(0.3, 0.4))


# --- aggregate: the deterministic part ----------------------------------------


def gaussian(sigma=0.0, clip=1.0):
    return MechanismSettings(kind="gaussian", clipping_norm=clip, noise_multiplier=sigma)


def test_gaussian_aggregate_without_noise_hand_example():
    # u1 = (3, 4), ‖u1‖ = 5 > C = 1 → (0.6, 0.8); u2 = (0.3, 0.4) unchanged; K = 4 (not 2!)
    contributions = [Contribution(t64(3, 4), 10), Contribution(t64(0.3, 0.4), 1000)]
    out, stats = aggregate(contributions, gaussian(), 4, [0.0, 0.0], torch.Generator(), 2, F64)
    torch.testing.assert_close(out, t64(0.9 / 4, 1.2 / 4), rtol=0, atol=1e-15)
    assert stats.num_contributions == 2
    assert stats.fraction_clipped == 0.5
    assert stats.mean_norm_before_clip == pytest.approx(2.75)
    assert stats.noise_std == 0.0


def test_gaussian_aggregate_ignores_num_examples_and_xis():
    a = [Contribution(t64(1, 0), 1), Contribution(t64(0, 1), 1)]
    b = [Contribution(t64(1, 0), 500), Contribution(t64(0, 1), 3)]
    out_a, _ = aggregate(a, gaussian(clip=10), 2, [0.0, 0.0], torch.Generator(), 2, F64)
    out_b, _ = aggregate(b, gaussian(clip=10), 2, [5.0, -3.0], torch.Generator(), 2, F64)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(out_a, t64(0.5, 0.5), rtol=0, atol=0)


def test_hog_aggregate_without_noise_hand_example():
    settings_ = MechanismSettings(kind="hog", clipping_norm=2.0, noise_multiplier=0.0, mixing_strength=0.5)
    contributions = [
        # Δ=(3,4), t=(0,2), ξ=-1.2 → u=(3,1), ‖u‖=√10 > 2 → (6/√10, 2/√10); mixing ratio 0.5·1.2 = 0.6
        Contribution(t64(3, 4), 7, term=t64(0, 2)),
        # Δ=(1,0), t=(0,-3), ξ=2 → scale 0.5·2·1/3 = 1/3 → u=(1,-1), ‖u‖=√2 ≤ 2 unchanged; ratio 1.0
        Contribution(t64(1, 0), 9, term=t64(0, -3)),
    ]
    out, stats = aggregate(contributions, settings_, 4, [-1.2, 2.0], torch.Generator(), 2, F64)
    r10 = math.sqrt(10)
    torch.testing.assert_close(out, t64((6 / r10 + 1) / 4, (2 / r10 - 1) / 4), rtol=0, atol=1e-12)
    assert stats.fraction_clipped == 0.5
    assert stats.mean_norm_before_clip == pytest.approx((r10 + math.sqrt(2)) / 2, rel=1e-12)
    assert stats.mean_mixing_ratio == pytest.approx(0.8, rel=1e-12)
    assert stats.noise_std == 0.0


def test_hog_uses_the_xi_given_for_each_contribution():
    settings_ = MechanismSettings(kind="hog", clipping_norm=100.0, noise_multiplier=0.0, mixing_strength=1.0)
    contributions = [Contribution(t64(1, 0), 1, term=t64(0, 1)), Contribution(t64(0, 2), 1, term=t64(1, 0))]
    out, _ = aggregate(contributions, settings_, 1, [3.0, -0.5], torch.Generator(), 2, F64)
    # u1 = (1, 3), u2 = (-1, 2)
    torch.testing.assert_close(out, t64(0.0, 5.0), rtol=0, atol=1e-12)


def test_hog_requires_terms_and_one_xi_per_contribution():
    settings_ = MechanismSettings(kind="hog", clipping_norm=1.0, noise_multiplier=0.0, mixing_strength=1.0)
    with pytest.raises(ValueError, match="third-order term"):
        aggregate([Contribution(t64(1, 0), 1)], settings_, 1, [0.1], torch.Generator(), 2, F64)
    with pytest.raises(ValueError, match="one ξ per contribution"):
        aggregate([Contribution(t64(1, 0), 1, term=t64(0, 1))], settings_, 1, [], torch.Generator(), 2, F64)


def test_none_is_example_weighted_mean_without_clipping_or_noise():
    settings_ = MechanismSettings(kind="none", clipping_norm=0.1, noise_multiplier=5.0)
    contributions = [Contribution(t64(1, 2), 10), Contribution(t64(4, -1), 30)]
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    out, stats = aggregate(contributions, settings_, 1000, [], gen, 2, F64)
    # (10·(1,2) + 30·(4,-1)) / 40 = (3.25, -0.25): norms far above C = 0.1, no clipping, no /K
    torch.testing.assert_close(out, t64(3.25, -0.25), rtol=0, atol=1e-15)
    assert torch.equal(gen.get_state(), state)  # no noise drawn
    assert stats.noise_std == 0.0 and stats.fraction_clipped == 0.0
    assert stats.mean_norm_before_clip == pytest.approx((math.sqrt(5) + math.sqrt(17)) / 2)


def test_aggregate_returns_requested_dtype():
    out, _ = aggregate([Contribution(t64(1, 2), 1)], gaussian(clip=10), 1, [0.0], torch.Generator(), 2,
                       torch.float32)
    assert out.dtype == torch.float32


# --- aggregate: the noise ---------------------------------------------------------

NUMEL = 200_000
ALPHA = 1e-9  # probability that a correct implementation fails one of these checks


def noise_of(contributions, sigma, clip, k, seed, numel=NUMEL):
    """The noise part of the release: output with σ minus output with σ = 0."""
    settings_ = MechanismSettings(kind="gaussian", clipping_norm=clip, noise_multiplier=sigma)
    rng = PrivacyRng(seed)
    xis = [0.0] * len(contributions)
    noisy, stats = aggregate(contributions, settings_, k, xis, rng.noise, numel, F64)
    clean, _ = aggregate(contributions, gaussian(0.0, clip), k, xis, rng.noise, numel, F64)
    return (noisy - clean).numpy(), stats


def assert_std(samples, std):
    """Two-sided chi-square test of the sample variance around a known zero mean, plus a z-test of the mean."""
    n = samples.size
    statistic = float(np.sum(samples.astype(np.float64) ** 2)) / std**2
    low, high = scipy_stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], n)
    assert low < statistic < high, f"sample std {np.sqrt(statistic / n) * std:.6g}, expected {std:.6g}"
    z = float(np.mean(samples)) / (std / math.sqrt(n))
    assert abs(z) < scipy_stats.norm.isf(ALPHA / 2)


def test_chi_square_check_rejects_wrong_std():
    # the check used below is sharp enough to catch σC instead of σC/K, or 2x off
    samples = np.random.default_rng(0).normal(0.0, 0.2, NUMEL)
    assert_std(samples, 0.2)
    for wrong in (0.1, 0.4, 0.2 * math.sqrt(5), 0.2 / math.sqrt(5), 0.2 * 1.02):
        with pytest.raises(AssertionError):
            assert_std(samples, wrong)


@pytest.mark.parametrize("sigma, clip, k", [(2.0, 0.5, 5), (0.7, 3.0, 1), (1.0, 1.0, 40)])
def test_noise_std_is_sigma_c_over_k(sigma, clip, k):
    contributions = [Contribution(torch.full((NUMEL,), 0.01, dtype=F64), 1),
                     Contribution(torch.linspace(-1, 1, NUMEL, dtype=F64), 1)]
    noise, stats = noise_of(contributions, sigma, clip, k, seed=12345)
    assert stats.noise_std == pytest.approx(sigma * clip / k, rel=1e-15)
    assert_std(noise, sigma * clip / k)
    # Gaussian shape, not just the right variance
    assert scipy_stats.kstest(noise / (sigma * clip / k), "norm").pvalue > ALPHA


def test_empty_round_releases_pure_noise():
    settings_ = MechanismSettings(kind="gaussian", clipping_norm=1.5, noise_multiplier=1.2)
    out, stats = aggregate([], settings_, 8, [], PrivacyRng(7).noise, NUMEL, F64)
    assert stats.num_contributions == 0
    assert_std(out.numpy(), 1.2 * 1.5 / 8)


def test_noise_is_independent_across_coordinates_and_rounds():
    rng = PrivacyRng(99)
    settings_ = MechanismSettings(kind="gaussian", clipping_norm=1.0, noise_multiplier=1.0)
    first, _ = aggregate([], settings_, 1, [], rng.noise, NUMEL, F64)
    second, _ = aggregate([], settings_, 1, [], rng.noise, NUMEL, F64)
    # correlation of two independent N(0,1) vectors: ~N(0, 1/n)
    corr = float(torch.dot(first, second)) / NUMEL
    assert abs(corr) * math.sqrt(NUMEL) < scipy_stats.norm.isf(ALPHA / 2)
    lag = float(torch.dot(first[1:], first[:-1])) / (NUMEL - 1)
    assert abs(lag) * math.sqrt(NUMEL - 1) < scipy_stats.norm.isf(ALPHA / 2)


def test_noise_comes_only_from_the_dedicated_generator():
    settings_ = MechanismSettings(kind="hog", clipping_norm=1.0, noise_multiplier=1.0, mixing_strength=0.5)
    contributions = [Contribution(t64(1, 2, 3), 1, term=t64(0, 1, 0))]

    def run(privacy_seed, global_seed):
        torch.manual_seed(global_seed)
        np.random.seed(global_seed)
        torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
        rng = PrivacyRng(privacy_seed)
        out, _ = aggregate(contributions, settings_, 2, rng.standard_normals(1), rng.noise, 3, F64)
        # the global generators were neither read nor advanced
        assert torch.equal(torch.get_rng_state(), torch_state)
        after = np.random.get_state()
        assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1])
        assert after[2:] == numpy_state[2:]
        return out

    reference = run(privacy_seed=5, global_seed=0)
    assert torch.equal(run(privacy_seed=5, global_seed=1), reference)  # global seed is irrelevant
    assert torch.equal(run(privacy_seed=5, global_seed=2), reference)
    assert not torch.equal(run(privacy_seed=6, global_seed=0), reference)  # privacy seed matters


def test_privacy_rng_state_round_trip_reproduces_noise_and_xis():
    rng = PrivacyRng(2024)
    rng.standard_normals(3)
    state = rng.state_dict()
    expected = (rng.standard_normals(4), torch.randn(5, generator=rng.noise), rng.sampling.random(3))
    other = PrivacyRng(1)
    other.load_state_dict(state)
    got = (other.standard_normals(4), torch.randn(5, generator=other.noise), other.sampling.random(3))
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1])
    assert np.array_equal(got[2], expected[2])


def test_unseeded_privacy_rngs_differ():
    a, b = PrivacyRng(), PrivacyRng()
    assert not a.seed_is_fixed and PrivacyRng(0).seed_is_fixed
    assert a.standard_normals(4) != b.standard_normals(4)


def test_stats_hand_example_with_noise():
    # three contributions, norms 5, 1, 0.5 with C = 1 → clipped fraction 1/3 (norm == C is not clipped)
    contributions = [Contribution(t64(3, 4), 1), Contribution(t64(0, 1), 1), Contribution(t64(0.5, 0), 1)]
    settings_ = MechanismSettings(kind="gaussian", clipping_norm=1.0, noise_multiplier=0.8)
    _, stats = aggregate(contributions, settings_, 10, [0.0] * 3, PrivacyRng(0).noise, 2, F64)
    assert stats.fraction_clipped == pytest.approx(1 / 3)
    assert stats.noise_std == pytest.approx(0.8 * 1.0 / 10)
    assert stats.mean_norm_before_clip == pytest.approx((5 + 1 + 0.5) / 3)
    assert math.isnan(stats.mean_mixing_ratio)  # no mixing for gaussian


def test_drawing_xi_does_not_shift_the_noise():
    """ξ has its own stream: a hog run and a gaussian run with one privacy seed get the same noise."""
    with_mixing, without = PrivacyRng(3), PrivacyRng(3)
    with_mixing.standard_normals(5)
    assert torch.equal(torch.randn(4, generator=with_mixing.noise), torch.randn(4, generator=without.noise))
    assert without.standard_normals(5)[:2] != with_mixing.standard_normals(2)  # the ξ stream had advanced by 5
