"""The higher-order mixing and the Gaussian mechanism, against hand computations and statistics."""

import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as scipy_stats

from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import CLIP_GUARD, Contribution, build_mechanism, norms_of
from fedhog.privacy.randomness import MAX_STANDARD_NORMAL, SeededBits, sampler_log_ratio_bound
from fedhog.privacy.sampler_slack import sampler_slack

F64 = torch.float64


def t64(*values):
    return torch.tensor(values, dtype=F64)


class One(NamedTuple):
    """The stats of a single contribution."""

    norm_before_clip: float
    clipped: bool
    mixing_ratio: float


def constrain_one(update, term, xi, settings_):
    """The mechanism's constrain_sensitivity on one contribution: a batch of one row."""
    out, stats = settings_.constrain_sensitivity(update[None], None if term is None else term[None],
                                                 torch.tensor([xi], dtype=F64))
    assert out.shape == (1, update.numel())
    return out[0], One(stats.norms_before_clip[0], stats.clipped[0], stats.mixing_ratios[0])


def mixed(update, term, gamma, xi, clip=1e9):
    """u = Δ + γξ(‖Δ‖/‖t‖)t, with a clipping norm too large to act."""
    return constrain_one(update, term, xi, build_mechanism("hog", clip, 0.0, gamma))


def clip_only(vector, clip):
    return constrain_one(vector, None, 0.0, build_mechanism("gaussian", clip, 0.0))


# --- the mixing ---------------------------------------------------------------


def test_mixing_hand_example():
    # Δ = (3, 4), ‖Δ‖ = 5; t = (0, 2), ‖t‖ = 2; γ = 0.5, ξ = -1.2
    # scale = 0.5 · (-1.2) · 5 / 2 = -1.5  →  u = (3, 4 - 3) = (3, 1)
    u, stats = mixed(t64(3, 4), t64(0, 2), 0.5, -1.2)
    torch.testing.assert_close(u, t64(3.0, 1.0), rtol=0, atol=1e-12)
    assert stats.mixing_ratio == pytest.approx(0.6, rel=1e-15)
    assert stats.norm_before_clip == pytest.approx(math.sqrt(10), rel=1e-12) and not stats.clipped


def test_mixing_second_hand_example():
    # Δ = (1, 0, 2), ‖Δ‖ = √5; t = (2, -1, 2), ‖t‖ = 3; γ = 2, ξ = 0.3
    # scale = 2 · 0.3 · √5 / 3 = 0.2 √5
    scale = 0.2 * math.sqrt(5)
    u, _ = mixed(t64(1, 0, 2), t64(2, -1, 2), 2.0, 0.3)
    torch.testing.assert_close(u, t64(1 + 2 * scale, -scale, 2 + 2 * scale), rtol=0, atol=1e-12)


def test_mixing_term_norm_is_gamma_abs_xi_times_update_norm():
    # ‖u - Δ‖ = γ |ξ| ‖Δ‖ whatever the scale of t (the term contributes only a direction).
    gen = torch.Generator().manual_seed(3)
    update = torch.randn(50, generator=gen, dtype=F64)
    for scale in (1e-30, 1.0, 1e4, 1e30):
        term = scale * torch.randn(50, generator=torch.Generator().manual_seed(4), dtype=F64)
        u, stats = mixed(update, term, 0.7, -2.5)
        expected = 0.7 * 2.5 * float(torch.linalg.vector_norm(update))
        assert float(torch.linalg.vector_norm(u - update)) == pytest.approx(expected, rel=1e-12)
        assert stats.mixing_ratio == pytest.approx(0.7 * 2.5, rel=1e-15)


def test_zero_term_zero_update_or_zero_gamma_leave_the_update():
    update = t64(3, -4, 1)
    u, stats = mixed(update, torch.zeros(3, dtype=F64), 0.5, 1.7)
    assert torch.equal(u, update) and stats.mixing_ratio == 0.0
    assert u is not update  # a copy: later in-place work cannot alter the reply
    zero = torch.zeros(3, dtype=F64)
    u, stats = mixed(zero, t64(1, 2, 3), 0.5, 1.0)
    assert torch.equal(u, zero) and stats.norm_before_clip == 0.0
    assert torch.equal(mixed(t64(1, 2, 3), t64(4, 5, 6), 0.0, 1.0)[0], t64(1, 2, 3))


def test_hog_needs_a_term_and_none_constrains_nothing():
    with pytest.raises(ValueError, match="third-order term"):
        constrain_one(t64(1, 0), None, 0.1, build_mechanism("hog", 1.0, 0.0, 1.0))
    with pytest.raises(ValueError, match="does not constrain"):
        constrain_one(t64(1, 0), None, 0.0, build_mechanism("none", 1.0, 0.0))
    with pytest.raises(ValueError, match="NaN or inf"):
        clip_only(t64(1, math.inf), 1.0)


# --- clipping --------------------------------------------------------------------

# entries below 1e-100 become 0: their squares underflow, and a norm of ~1e-200 read as 0 is no bug
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False).map(
    lambda v: 0.0 if abs(v) < 1e-100 else v)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(values=st.lists(finite, min_size=1, max_size=40),
       clipping_norm=st.floats(min_value=1e-3, max_value=1e3))
def test_clipping_properties(values, clipping_norm):
    vector = torch.tensor(values, dtype=F64)
    true_norm = math.hypot(*values)  # no underflow for tiny entries
    clipped, stats = clip_only(vector, clipping_norm)

    assert stats.norm_before_clip == pytest.approx(true_norm, rel=1e-9, abs=1e-300)
    clipped_norm = math.hypot(*clipped.tolist())
    assert clipped_norm <= clipping_norm  # strictly inside the ball, rounding included
    if true_norm <= clipping_norm * (1 - 1e-9):
        assert torch.equal(clipped, vector)  # under C: untouched
    else:
        assert clipped_norm == pytest.approx(clipping_norm, rel=1e-9)  # over C: on the sphere
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
def test_clipping_near_the_bound(values, clipping_norm, ratio):
    # vectors whose norm is ratio · C, including just above and just below C
    direction = torch.tensor(values, dtype=F64) / math.hypot(*values)
    vector = direction * (ratio * clipping_norm)
    clipped, _ = clip_only(vector, clipping_norm)
    if ratio > 1 + 1e-9:
        assert float(torch.linalg.vector_norm(clipped)) == pytest.approx(clipping_norm, rel=1e-9)
        torch.testing.assert_close(clipped, direction * clipping_norm, rtol=1e-9, atol=1e-12)
    elif ratio < 1 - 1e-9:
        assert torch.equal(clipped, vector)


def test_clipping_hand_example():
    clipped, stats = clip_only(t64(3, 4), 1.0)
    assert stats.norm_before_clip == 5.0 and stats.clipped
    torch.testing.assert_close(clipped, t64(0.6, 0.8) * CLIP_GUARD, rtol=0, atol=1e-15)  # a hair inside C
    same, stats = clip_only(t64(0.3, 0.4), 1.0)
    assert stats.norm_before_clip == pytest.approx(0.5) and torch.equal(same, t64(0.3, 0.4))


extreme = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.sampled_from([3.4e38, -3.4e38, 1e19, -1e19, 1.4e-45, -1.4e-45, 1e-40, 0.0]))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(update=st.lists(extreme, min_size=1, max_size=12), term=st.lists(extreme, min_size=12, max_size=12),
       gamma=st.sampled_from([0.0, 0.5, 1.0, 1e6]), xi=st.floats(-MAX_STANDARD_NORMAL, MAX_STANDARD_NORMAL),
       clip=st.sampled_from([1e-3, 1.0, 1e3]))
def test_any_finite_float32_contribution_is_finite_and_inside_the_ball(update, term, gamma, xi, clip):
    """Huge, subnormal and zero float32 entries: the output is finite and ‖c‖ ≤ C, mixing or not."""
    delta = torch.tensor(update, dtype=torch.float32)
    t = torch.tensor(term[:len(update)], dtype=torch.float32)
    for settings_ in (build_mechanism("gaussian", clip, 1.0), build_mechanism("hog", clip, 1.0, gamma)):
        out, stats = constrain_one(delta, t, xi, settings_)
        assert out.dtype == F64 and bool(torch.isfinite(out).all())
        assert math.hypot(*out.tolist()) <= clip
        assert not math.isnan(stats.norm_before_clip)


extreme64 = st.one_of(
    st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False),
    st.sampled_from([1e300, -1e300, 2.0**401, 2.0**-401, 1e-200, 5e-324, -5e-324, 2.0**-1000, 0.0]))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(update=st.lists(extreme64, min_size=1, max_size=12), term=st.lists(extreme64, min_size=12, max_size=12),
       gamma=st.sampled_from([0.0, 0.5, 1e6]), xi=st.floats(-MAX_STANDARD_NORMAL, MAX_STANDARD_NORMAL),
       clip=st.sampled_from([1e-3, 1.0, 1e3]))
def test_any_finite_float64_contribution_is_finite_and_inside_the_ball(update, term, gamma, xi, clip):
    """float64 rows whose norm cannot be summed directly (huge, tiny, subnormal) are summed scaled: the output is
    still finite and inside the ball, and the norm seen is math.hypot's (overflow-free, correctly rounded in
    Python ≥ 3.10) to a few ulps."""
    delta = torch.tensor(update, dtype=F64)
    t = torch.tensor(term[:len(update)], dtype=F64)
    for settings_ in (build_mechanism("gaussian", clip, 1.0), build_mechanism("hog", clip, 1.0, gamma)):
        out, stats = constrain_one(delta, t, xi, settings_)
        assert bool(torch.isfinite(out).all())
        assert math.hypot(*out.tolist()) <= clip
        if settings_.name == "gaussian":
            assert stats.norm_before_clip == pytest.approx(math.hypot(*update), rel=1e-14, abs=0)


def test_norms_are_hypot_on_both_sides_of_the_direct_range():
    """norms_of sums each row directly and again scaled where that cannot be trusted (huge, tiny, zero): the same
    norms either way (math.hypot's); NaN or inf flagged as not finite, a norm past float64's range too large."""
    rows = [[3.0, 4.0], [3e250, 4e250], [3e-250, 4e-250], [1e300, 1e300], [5e-324, 0.0], [0.0, 0.0],
            [2.0**400, 1.0], [float("nan"), 1.0], [float("inf"), 1.0], [1.7e308, 1.7e308]]
    norms, finite = norms_of([torch.tensor(r, dtype=F64) for r in rows])
    for row, norm, ok in zip(rows, norms, finite, strict=True):
        assert ok == all(math.isfinite(v) for v in row)
        if math.isfinite(math.hypot(*row)):
            assert norm == pytest.approx(math.hypot(*row), rel=1e-15, abs=0)
        else:  # NaN or inf entries, or finite ones whose norm is past float64's range
            assert not math.isfinite(norm)
    direct, _ = norms_of([torch.tensor([3.0, 4.0], dtype=F64), torch.tensor([3e-5, 4e-5], dtype=F64)])
    assert direct == [5.0, pytest.approx(5e-5, rel=1e-15, abs=0)]


# --- the lattice -------------------------------------------------------------------


def test_lattice_granularity_is_a_power_of_two_about_2_to_the_minus_40_of_the_noise():
    for sigma, clip in ((1.0, 1.0), (0.3, 2.0), (7.0, 0.5), (0.0, 3.0), (1e3, 1e-2)):
        lattice = NoiseLattice.for_settings(build_mechanism("gaussian", clip, sigma), 1000)
        g = lattice.granularity
        assert math.log2(g) == int(math.log2(g))
        scale = clip * max(sigma, 1.0)
        assert 2.0**-41 * scale < g <= 2.0**-40 * scale
        assert lattice.rounding_slack == pytest.approx(g * math.sqrt(1000) / 2, rel=1e-15)
        assert lattice.sum_std(build_mechanism("gaussian", clip, sigma)) == sigma * (clip + lattice.rounding_slack)


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(values=st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=30))
def test_quantize_moves_each_entry_by_at_most_half_a_step(values):
    lattice = NoiseLattice(2.0**-20, len(values))
    steps = lattice.quantize(torch.tensor(values, dtype=F64))
    assert steps.dtype == torch.int64
    error = steps.to(F64) * lattice.granularity - torch.tensor(values, dtype=F64)
    assert float(error.abs().max()) <= lattice.granularity / 2
    assert float(torch.linalg.vector_norm(error)) <= lattice.rounding_slack


def test_release_is_a_lattice_point_whatever_the_data():
    """Mironov's attack reads x from the low bits of x + noise; here every output is g × an integer."""
    settings_ = build_mechanism("gaussian", clipping_norm=1.0, noise_multiplier=1.0)
    lattice = NoiseLattice.for_settings(settings_, 64)
    for data in (t64(*([0.1] * 64)), t64(*([0.1 + 1e-13] * 64)), torch.linspace(-0.05, 0.05, 64, dtype=F64)):
        out, _ = settings_.aggregate([Contribution(data)], 1, [0.0], SeededBits(9), 64, F64)
        steps = out / lattice.granularity
        assert torch.equal(steps, torch.round(steps))


def test_sampler_slack_closed_form():
    eta = sampler_log_ratio_bound()
    assert 2e-13 < eta < 3e-13  # 2·(231·5·2⁻⁵³ + 22·2⁻⁵² + 4·2⁻⁵²)
    std, d, rounds = 2.0**40, 10**6, 100
    kappa = rounds * d * (eta + 17 / std**2)
    outside = rounds * d * 2.7 * math.exp(-(20 - 1) ** 2 / 2)
    slack = sampler_slack(1.0, std, d, rounds, 3.0, 1e-5)
    assert slack.epsilon == pytest.approx(2 * kappa, rel=1e-12)
    assert slack.delta == pytest.approx(math.expm1(kappa) * 1e-5 + outside * (1 + math.exp(3.0 + kappa)), rel=1e-9)
    assert slack.epsilon < 1e-4 and slack.delta < 1e-9  # σ = 1, a 1M-parameter model, 100 rounds: negligible
    # a coarse lattice (σ_ℤ = 2^10 steps): the discrete-vs-rounded Gaussian term 17/σ_ℤ² dominates
    assert sampler_slack(1.0, 2.0**10, 10, 1, 1.0, 1e-5).epsilon == pytest.approx(2 * 10 * (eta + 17 / 2.0**20))
    assert sampler_slack(0.05, std, 10, 1, 1.0, 1e-5).delta >= 1.0  # a shift of 20 std leaves the window: vacuous
    assert sampler_slack(0.0, std, 10, 1, 1.0, 1e-5) == sampler_slack(1.0, std, 10, 0, 1.0, 1e-5)  # no noise/release


# --- aggregate: the deterministic part ----------------------------------------


def gaussian(sigma=0.0, clip=1.0):
    return build_mechanism("gaussian", clipping_norm=clip, noise_multiplier=sigma)


def lattice_atol(settings_, numel=2):
    return NoiseLattice.for_settings(settings_, numel).granularity  # rounding onto the lattice, ÷ K ≥ 1


def test_gaussian_aggregate_without_noise_hand_example():
    # u1 = (3, 4), ‖u1‖ = 5 > C = 1 → (0.6, 0.8); u2 = (0.3, 0.4) unchanged; K = 4 (not 2!)
    contributions = [Contribution(t64(3, 4), 10), Contribution(t64(0.3, 0.4), 1000)]
    out, stats = gaussian().aggregate(contributions, 4, [0.0, 0.0], SeededBits(0), 2, F64)
    torch.testing.assert_close(out, t64(0.9 / 4, 1.2 / 4), rtol=0, atol=lattice_atol(gaussian()))
    assert stats.num_contributions == 2
    assert stats.fraction_clipped == 0.5
    assert stats.mean_norm_before_clip == pytest.approx(2.75)
    assert stats.noise_std == 0.0


def test_gaussian_aggregate_ignores_weights_and_xis():
    a = [Contribution(t64(1, 0), 1), Contribution(t64(0, 1), 1)]
    b = [Contribution(t64(1, 0), 500), Contribution(t64(0, 1), 3)]
    out_a, _ = gaussian(clip=10).aggregate(a, 2, [0.0, 0.0], SeededBits(0), 2, F64)
    out_b, _ = gaussian(clip=10).aggregate(b, 2, [5.0, -3.0], SeededBits(0), 2, F64)
    assert torch.equal(out_a, out_b)
    torch.testing.assert_close(out_a, t64(0.5, 0.5), rtol=0, atol=0)


def test_hog_aggregate_without_noise_hand_example():
    settings_ = build_mechanism("hog", clipping_norm=2.0, noise_multiplier=0.0, mixing_strength=0.5)
    contributions = [
        # Δ=(3,4), t=(0,2), ξ=-1.2 → u=(3,1), ‖u‖=√10 > 2 → (6/√10, 2/√10); mixing ratio 0.5·1.2 = 0.6
        Contribution(t64(3, 4), 7, term=t64(0, 2)),
        # Δ=(1,0), t=(0,-3), ξ=2 → scale 0.5·2·1/3 = 1/3 → u=(1,-1), ‖u‖=√2 ≤ 2 unchanged; ratio 1.0
        Contribution(t64(1, 0), 9, term=t64(0, -3)),
    ]
    out, stats = settings_.aggregate(contributions, 4, [-1.2, 2.0], SeededBits(0), 2, F64)
    r10 = math.sqrt(10)
    torch.testing.assert_close(out, t64((6 / r10 + 1) / 4, (2 / r10 - 1) / 4), rtol=0,
                               atol=lattice_atol(settings_))
    assert stats.fraction_clipped == 0.5
    assert stats.mean_norm_before_clip == pytest.approx((r10 + math.sqrt(2)) / 2, rel=1e-12)
    assert stats.mean_mixing_ratio == pytest.approx(0.8, rel=1e-12)
    assert stats.noise_std == 0.0


def test_hog_uses_the_xi_given_for_each_contribution():
    settings_ = build_mechanism("hog", clipping_norm=100.0, noise_multiplier=0.0, mixing_strength=1.0)
    contributions = [Contribution(t64(1, 0), 1, term=t64(0, 1)), Contribution(t64(0, 2), 1, term=t64(1, 0))]
    out, _ = settings_.aggregate(contributions, 1, [3.0, -0.5], SeededBits(0), 2, F64)
    # u1 = (1, 3), u2 = (-1, 2)
    torch.testing.assert_close(out, t64(0.0, 5.0), rtol=0, atol=2 * lattice_atol(settings_))


def test_hog_requires_terms_and_one_xi_per_contribution():
    settings_ = build_mechanism("hog", clipping_norm=1.0, noise_multiplier=0.0, mixing_strength=1.0)
    with pytest.raises(ValueError, match="third-order term"):
        settings_.aggregate([Contribution(t64(1, 0), 1)], 1, [0.1], SeededBits(0), 2, F64)
    with pytest.raises(ValueError, match="one ξ per contribution"):
        settings_.aggregate([Contribution(t64(1, 0), 1, term=t64(0, 1))], 1, [], SeededBits(0), 2, F64)


class CountingBits:
    """A stream that counts the words drawn from it."""

    def __init__(self):
        self.drawn, self._inner = 0, SeededBits(0)

    def words(self, count):
        self.drawn += count
        return self._inner.words(count)


def test_none_is_weighted_mean_without_clipping_or_noise():
    settings_ = build_mechanism("none", clipping_norm=0.1, noise_multiplier=5.0)
    contributions = [Contribution(t64(1, 2), 10), Contribution(t64(4, -1), 30)]
    bits = CountingBits()
    out, stats = settings_.aggregate(contributions, 1000, [], bits, 2, F64)
    # (10·(1,2) + 30·(4,-1)) / 40 = (3.25, -0.25): norms far above C = 0.1, no clipping, no /K
    torch.testing.assert_close(out, t64(3.25, -0.25), rtol=0, atol=1e-15)
    assert bits.drawn == 0  # no noise drawn
    assert stats.noise_std == 0.0 and stats.fraction_clipped == 0.0
    assert stats.mean_norm_before_clip == pytest.approx((math.sqrt(5) + math.sqrt(17)) / 2)


def test_aggregate_returns_requested_dtype():
    out, _ = gaussian(clip=10).aggregate([Contribution(t64(1, 2), 1)], 1, [0.0], SeededBits(0), 2, torch.float32)
    assert out.dtype == torch.float32


# --- aggregate: the noise ---------------------------------------------------------

NUMEL = 200_000
ALPHA = 1e-9  # probability that a correct implementation fails one of these checks


def noise_of(contributions, sigma, clip, k, seed, numel=NUMEL):
    """The noise part of the release: output with σ minus output with σ = 0 (same lattice)."""
    settings_ = build_mechanism("gaussian", clipping_norm=clip, noise_multiplier=sigma)
    xis = [0.0] * len(contributions)
    noisy, stats = settings_.aggregate(contributions, k, xis, SeededBits(seed), numel, F64)
    lattice = NoiseLattice.for_settings(settings_, numel)
    clean = sum(lattice.quantize(constrain_one(c.update, None, 0.0, settings_)[0]) for c in contributions)
    return (noisy - clean.to(F64) * lattice.granularity / k).numpy(), stats


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
def test_noise_std_is_sigma_times_sensitivity_over_k(sigma, clip, k):
    contributions = [Contribution(torch.full((NUMEL,), 0.01, dtype=F64), 1),
                     Contribution(torch.linspace(-1, 1, NUMEL, dtype=F64), 1)]
    noise, stats = noise_of(contributions, sigma, clip, k, seed=12345)
    lattice = NoiseLattice.for_settings(gaussian(sigma, clip), NUMEL)
    expected = sigma * (clip + lattice.rounding_slack) / k
    assert stats.noise_std == pytest.approx(expected, rel=1e-15)
    assert lattice.rounding_slack < 1e-9 * clip  # the sensitivity is C to nine digits
    assert_std(noise, expected)
    # Gaussian shape, not just the right variance
    assert scipy_stats.kstest(noise / expected, "norm").pvalue > ALPHA


def test_empty_round_releases_pure_noise():
    settings_ = build_mechanism("gaussian", clipping_norm=1.5, noise_multiplier=1.2)
    out, stats = settings_.aggregate([], 8, [], SeededBits(7), NUMEL, F64)
    assert stats.num_contributions == 0
    assert_std(out.numpy(), stats.noise_std)
    assert stats.noise_std == pytest.approx(1.2 * 1.5 / 8, rel=1e-9)


def test_noise_is_independent_across_coordinates_and_streams():
    settings_ = build_mechanism("gaussian", clipping_norm=1.0, noise_multiplier=1.0)
    first, _ = settings_.aggregate([], 1, [], SeededBits(99, (1, 2)), NUMEL, F64)
    second, _ = settings_.aggregate([], 1, [], SeededBits(99, (2, 2)), NUMEL, F64)
    # correlation of two independent N(0,1) vectors: ~N(0, 1/n)
    corr = float(torch.dot(first, second)) / NUMEL
    assert abs(corr) * math.sqrt(NUMEL) < scipy_stats.norm.isf(ALPHA / 2)
    lag = float(torch.dot(first[1:], first[:-1])) / (NUMEL - 1)
    assert abs(lag) * math.sqrt(NUMEL - 1) < scipy_stats.norm.isf(ALPHA / 2)


def test_noise_comes_only_from_the_stream_given():
    settings_ = build_mechanism("hog", clipping_norm=1.0, noise_multiplier=1.0, mixing_strength=0.5)
    contributions = [Contribution(t64(1, 2, 3), 1, term=t64(0, 1, 0))]

    def run(privacy_seed, global_seed):
        torch.manual_seed(global_seed)
        np.random.seed(global_seed)
        torch_state, numpy_state = torch.get_rng_state(), np.random.get_state()
        out, _ = settings_.aggregate(contributions, 2, [0.3], SeededBits(privacy_seed), 3, F64)
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


def test_stats_hand_example_with_noise():
    # three contributions, norms 5, 1, 0.5 with C = 1 → clipped fraction 1/3 (norm == C is not clipped)
    contributions = [Contribution(t64(3, 4), 1), Contribution(t64(0, 1), 1), Contribution(t64(0.5, 0), 1)]
    settings_ = build_mechanism("gaussian", clipping_norm=1.0, noise_multiplier=0.8)
    _, stats = settings_.aggregate(contributions, 10, [0.0] * 3, SeededBits(0), 2, F64)
    assert stats.fraction_clipped == pytest.approx(1 / 3)
    assert stats.noise_std == pytest.approx(0.8 * 1.0 / 10, rel=1e-9)
    assert stats.mean_norm_before_clip == pytest.approx((5 + 1 + 0.5) / 3)
    assert math.isnan(stats.mean_mixing_ratio)  # no mixing for gaussian


def test_clip_guard_is_a_hair_inside_c():
    assert 1 - 1e-11 < CLIP_GUARD < 1


def test_a_batch_constrains_each_row_as_if_alone():
    """Stacked [R, P] rows with different norms, terms and ξ give exactly what each row gives alone."""
    gen = torch.Generator().manual_seed(8)
    updates = torch.randn(7, 30, generator=gen, dtype=F64) * torch.tensor([0.01, 0.5, 1, 2, 10, 0, 1e3])[:, None]
    terms = torch.randn(7, 30, generator=gen, dtype=F64)
    terms[2] = 0.0
    xis = torch.tensor([0.3, -1.2, 2.0, 0.0, 0.7, 1.1, -0.4], dtype=F64)
    settings_ = build_mechanism("hog", 1.5, 0.0, 0.6)
    batch, stats = settings_.constrain_sensitivity(updates, terms, xis)
    for r in range(7):
        alone, one = constrain_one(updates[r], terms[r], float(xis[r]), settings_)
        torch.testing.assert_close(batch[r], alone, rtol=0, atol=0)
        assert (stats.norms_before_clip[r], stats.clipped[r], stats.mixing_ratios[r]) == tuple(one)


# --- the mechanisms as objects ---------------------------------------------------------------------------------


def test_the_registry_builds_each_mechanism_and_refuses_others():
    none, gaussian_, hog = (build_mechanism(name, 1.5, 0.7, 0.3) for name in ("none", "gaussian", "hog"))
    assert (none.name, gaussian_.name, hog.name) == ("none", "gaussian", "hog")
    assert (none.clips, gaussian_.clips, hog.clips) == (False, True, True)
    assert (none.wants_term, gaussian_.wants_term, hog.wants_term) == (False, False, True)
    assert (none.has_guarantee, gaussian_.has_guarantee, build_mechanism("gaussian", 1.5, 0.0).has_guarantee) == (
        False, True, False)
    assert hog.mixing_strength == 0.3 and not hasattr(gaussian_, "mixing_strength")  # γ is hog's only
    assert "γ=0.3" in hog.describe() and "C=1.5" in gaussian_.describe() and "ε = ∞" in none.describe()
    with pytest.raises(ValueError, match="mechanism='laplace' must be one of"):
        build_mechanism("laplace", 1.0)
    with pytest.raises(ValueError, match="adds no noise"):
        none.add_noise(torch.zeros(2, dtype=torch.int64), NoiseLattice(1.0, 2), SeededBits(0), 1)


def test_with_clipping_changes_c_and_sigma_only():
    """Adaptive clipping's round mechanism: the same class (and γ), the new C and σ, which the release uses."""
    for name in ("none", "gaussian", "hog"):
        base = build_mechanism(name, 1.5, 0.7, 0.3)
        moved = base.with_clipping(0.25, 2.0)
        assert type(moved) is type(base) and (moved.clipping_norm, moved.noise_multiplier) == (0.25, 2.0)
        assert (base.clipping_norm, base.noise_multiplier) == (1.5, 0.7)  # the original is unchanged
        assert getattr(moved, "mixing_strength", None) == getattr(base, "mixing_strength", None)
    update = t64(3.0, 4.0)  # ‖Δ‖ = 5: clipped to the new C
    out, _ = build_mechanism("gaussian", 10.0).with_clipping(0.5, 0.0).constrain_sensitivity(
        update[None], None, t64(0.0))
    torch.testing.assert_close(out[0], update * 0.5 * CLIP_GUARD / 5, rtol=1e-15, atol=0)


def test_xis_are_drawn_per_slot_only_where_there_is_mixing():
    """hog: ξ of a slot is the population's draw at that slot, whoever else is asked; gaussian draws nothing."""
    hog, gaussian_ = build_mechanism("hog", 1.0, 1.0, 0.5), build_mechanism("gaussian", 1.0, 1.0)
    everyone = hog.xis(SeededBits(3), 8, range(8))
    np.testing.assert_array_equal(hog.xis(SeededBits(3), 8, [6, 1]), everyone[[6, 1]])
    assert len(set(everyone.tolist())) == 8
    bits = CountingBits()
    assert np.array_equal(gaussian_.xis(bits, 8, [6, 1]), np.zeros(2)) and bits.drawn == 0


def test_each_mechanisms_accountant_is_its_own():
    """Gaussian and hog compose their σ (halved for replace-one); none has no guarantee and ε = ∞ once it releases."""
    for name in ("gaussian", "hog"):
        accountant = build_mechanism(name, 1.0, 1.2, 0.5).accountant("fixed", 0.1, 100, 1e-4, "rdp")
        assert accountant.has_guarantee and accountant.noise_multiplier == 0.6
    plain = build_mechanism("none", 1.0, 1.2).accountant("poisson", 0.1, 100, 1e-4, "pld")
    assert not plain.has_guarantee and plain.noise_multiplier is None and plain.sampler_slack(3) is None
    plain.compose_round()
    assert plain.epsilon() == math.inf
