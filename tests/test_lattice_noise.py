"""The lattice noise is exactly the discrete Gaussian the accountant's argument assumes: no holes, the right pmf.

The first review's attack: the trusted server's noise was a float64 Box–Muller
normal rounded onto a lattice of 2⁻⁴⁰ std, whose radius could never fall
within 2⁻²⁶ std of zero, so a pair of noise values near zero (and many points
further out) could not be produced; a neighbour one lattice step away then
reaches outputs the dataset cannot, with infinite privacy loss. These tests
look for such holes with rigged random words (any value, any pair, reached
through the mechanism's own ``add_noise``), check the sampler's pmf against
the exact N_ℤ(0, σ²) at several σ (lattice resolution included), the exact
Bernoulli it rests on, and the float64 ``exp`` bound its analysis assumes.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import (
    EXP_ULPS,
    SecureBits,
    SeededBits,
    bernoulli,
    bernoulli_exp,
    discrete_gaussian,
    lattice_gaussian,
    sampler_log_ratio_bound,
)

LN2 = math.log(2)


class Rigged:
    """Random words chosen by the test: ``first`` for the first request (repeated to its length), then ``rest``."""

    def __init__(self, first: list[int], rest: int = 0) -> None:
        self.queue = [list(first)]
        self.rest = rest

    def words(self, count: int) -> np.ndarray:
        if self.queue:
            pattern = self.queue.pop(0)
            return np.array([pattern[i % len(pattern)] for i in range(count)], dtype=np.uint64)
        return np.full(count, self.rest, dtype=np.uint64)


def _scale_bits(sigma: float) -> int:
    return max(0, round(math.log2(LN2 * sigma)))


def _word_for(value: int, sigma: float) -> int:
    """The proposal word that makes the sampler propose ``value``: U in the top k bits, V as trailing zeros, sign."""
    k = _scale_bits(sigma)
    below, blocks = abs(value) % 2**k, abs(value) >> k
    assert blocks + 1 < 63 - k
    return (below << (64 - k) if k else 0) | (1 << (1 + blocks)) | int(value < 0)


# --- no holes ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sigma", [2.0**40 * 1.3, 2.0**41 * 0.77, 3.0e4, 5.0, 0.7])
@pytest.mark.parametrize("value", [0, 1, -1, 2, -17, 12345, -(2**30) - 5])
def test_every_value_near_zero_and_beyond_can_be_drawn(sigma, value):
    if abs(value) > 12 * sigma:
        pytest.skip("outside the analysed window at this σ")
    # the proposal is the value, every acceptance word is 0: accepted whatever exp(−x) is (ties read on)
    assert discrete_gaussian(Rigged([_word_for(value, sigma)]), 1, sigma)[0] == value


def test_the_trusted_servers_noise_has_no_hole_a_neighbour_one_step_away_could_exploit():
    """The review's reproduction through the mechanism: S and S′ = S + e₁ on the lattice of σ_ℤ ≈ 2⁴⁰ steps.

    For every output o = S + n with (n₁, n₂) a pair near zero, o − S′ = n − e₁ must be drawable too
    (Box–Muller rounded onto this lattice could produce no pair within 2¹⁴ steps of zero).
    """
    settings = GaussianMechanism(clipping_norm=1.0, noise_multiplier=1.0)
    lattice = NoiseLattice.for_settings(settings, 2)
    std_steps = lattice.sum_std(settings) / lattice.granularity
    assert std_steps > 2.0**40
    s = torch.tensor([5, -3], dtype=torch.int64)
    for pair in [(0, 0), (1, 0), (0, -1), (2**13, -(2**13)), (-1, 1)]:
        output = s + torch.tensor(pair)
        for neighbour in (s, s + torch.tensor([1, 0])):  # both datasets reach the output: finite privacy loss
            rigged = Rigged([_word_for(int(v), std_steps) for v in output - neighbour])
            released, _ = settings.add_noise(neighbour, lattice, rigged, 1)
            assert torch.equal(torch.round(released / lattice.granularity).to(torch.int64), output)


# --- the pmf -------------------------------------------------------------------------------------------------
def _exact_pmf(sigma: float, support: np.ndarray) -> np.ndarray:
    """P[x] of N_ℤ(0, σ²) on ``support``, normalised over ±(12σ + 10) (the mass beyond is below 1e−30)."""
    wide = np.arange(-int(12 * sigma) - 10, int(12 * sigma) + 11, dtype=np.float64)
    total = np.exp(-wide**2 / (2 * sigma**2)).sum()
    return np.exp(-support.astype(np.float64) ** 2 / (2 * sigma**2)) / total


@pytest.mark.parametrize("sigma", [0.7, 1.45, 3.0, 11.5, 40.0, 181.0])  # t = 2^k on both sides of λσ's rounding
def test_the_sampler_draws_the_exact_pmf(sigma):
    draws = discrete_gaussian(SeededBits(17), 300_000, sigma)
    low, high = int(np.floor(-4 * sigma)) - 1, int(np.ceil(4 * sigma)) + 1
    inner = np.arange(low, high + 1)
    expected = _exact_pmf(sigma, inner) * draws.size
    observed = np.bincount(np.clip(draws, low - 1, high + 1) - (low - 1), minlength=high - low + 3)
    tails = np.array([observed[0], observed[-1]])
    tail_expected = (1 - _exact_pmf(sigma, inner).sum()) / 2 * draws.size * np.ones(2)
    cells = np.concatenate([observed[1:-1], tails])
    wanted = np.concatenate([expected, tail_expected])
    keep = wanted >= 5
    pooled_obs = np.append(cells[keep], cells[~keep].sum())
    pooled_exp = np.append(wanted[keep], wanted[~keep].sum())
    pooled_exp *= pooled_obs.sum() / pooled_exp.sum()
    assert stats.chisquare(pooled_obs, pooled_exp).pvalue > 1e-6


def test_chi_square_can_fail():
    """The same test rejects a sampler whose σ is 3 % off, so passing above means something."""
    draws = discrete_gaussian(SeededBits(17), 300_000, 3.0 * 1.03)
    inner = np.arange(-13, 14)
    observed = np.bincount(np.clip(draws, -14, 14) + 14, minlength=29)
    expected = np.concatenate([[(1 - _exact_pmf(3.0, inner).sum()) / 2], _exact_pmf(3.0, inner),
                               [(1 - _exact_pmf(3.0, inner).sum()) / 2]]) * draws.size
    assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue < 1e-6


@pytest.mark.parametrize("sigma", [2.0**40 * 1.3, 2.0**20 * 1.9])
def test_large_sigma_matches_the_normal_and_resolves_single_steps_near_its_mean(sigma):
    bits = SecureBits()
    draws = lattice_gaussian(bits, 400_000, sigma)
    assert stats.kstest(draws / sigma, "norm").pvalue > 1e-4
    # the last bits are uniform (no float grid): values mod 4 are equally likely, also for draws near zero
    near = draws[np.abs(draws) < sigma / 4]
    assert stats.chisquare(np.bincount(near % 4, minlength=4)).pvalue > 1e-4


def test_draws_differ_under_os_entropy_and_repeat_under_a_seed():
    assert not np.array_equal(discrete_gaussian(SecureBits(), 100, 2.0**40),
                              discrete_gaussian(SecureBits(), 100, 2.0**40))
    assert np.array_equal(lattice_gaussian(SeededBits(3), 5000, 2.0**40),
                          lattice_gaussian(SeededBits(3), 5000, 2.0**40))


@pytest.mark.parametrize("sigma", [0.0, -1.0, math.inf, math.nan, 2.0**47])
def test_bad_sigma_is_refused(sigma):
    with pytest.raises(ValueError, match="sigma="):
        discrete_gaussian(SeededBits(1), 3, sigma)


# --- the exact Bernoulli -------------------------------------------------------------------------------------
def test_bernoulli_compares_an_unbounded_uniform_with_the_float():
    """32 random bits at a time (the low half of a word first) against p's binary digits."""
    p = np.array([0.3])
    whole = math.floor(0.3 * 2.0**32)
    next_digits = math.floor((0.3 * 2.0**32 - whole) * 2.0**32)
    assert bernoulli(Rigged([whole - 1]), p)[0]
    assert not bernoulli(Rigged([whole + 1]), p)[0]
    assert next_digits > 0  # a tie reads the next 32 bits against p's next digits
    assert bernoulli(Rigged([whole], rest=next_digits - 1), p)[0]
    assert not bernoulli(Rigged([whole], rest=next_digits + 1), p)[0]
    quarter = np.array([0.25])  # p·2³² is whole: a tie means U ≥ p, nothing more is read
    assert not bernoulli(Rigged([2**30], rest=0), quarter)[0]
    tiny = np.array([5e-324])  # the smallest subnormal: only a long run of zero bits accepts it
    assert bernoulli(Rigged([0], rest=0), tiny)[0]
    assert not bernoulli(Rigged([0], rest=1), tiny)[0]
    assert bernoulli(Rigged([2**32 - 1]), np.array([1.0]))[0]
    assert not bernoulli(Rigged([0]), np.array([0.0]))[0]


@pytest.mark.parametrize("p", [0.37, 1e-3, 2.0**-20 * 3])
def test_bernoulli_frequency(p):
    hits = int(bernoulli(SeededBits(5), np.full(2_000_000, p)).sum())
    assert stats.binomtest(hits, 2_000_000, p).pvalue > 1e-5


def test_bernoulli_exp_has_no_zero_probability_far_out():
    """exp(−800) underflows float64; the factors exp(−700)·exp(−100) do not, so zeros still accept."""
    assert bernoulli_exp(Rigged([0], rest=0), np.array([800.0]))[0]
    assert not bernoulli_exp(Rigged([1], rest=1), np.array([800.0]))[0]


def test_numpys_exp_is_within_the_ulps_the_analysis_allows():
    xs = np.concatenate([np.random.default_rng(0).uniform(0, 231, 20_000), np.linspace(0, 1, 2000), [700.0]])
    ours = np.exp(-xs)
    mpmath.mp.prec = 120
    exact = np.array([float(mpmath.exp(-mpmath.mpf(float(x)))) for x in xs])
    relative = np.abs(ours - exact) / exact
    assert relative.max() <= EXP_ULPS * 2.0**-52
    assert 1e-13 < sampler_log_ratio_bound() < 1e-12


# --- the accountant counts the sampler -------------------------------------------------------------------------
def test_the_client_level_accountant_adds_the_samplers_slack_to_epsilon():
    from fedhog.privacy.accounting import ClientLevelAccountant

    def accountant() -> ClientLevelAccountant:
        return ClientLevelAccountant(1.0, "poisson", 0.1, 1000, 1e-5, accountant="pld")

    plain, covered = accountant(), accountant()
    covered.cover_sampler(2.0**40, 10_000)
    for _ in range(5):
        plain.compose_round()
        covered.compose_round()
    slack = 2 * 5 * 10_000 * (sampler_log_ratio_bound() + 17 / 2.0**80)
    assert covered.epsilon() - plain.epsilon() == pytest.approx(slack, rel=1e-3)
    assert covered.sampler_slack(5).epsilon == pytest.approx(slack, rel=1e-12)
    assert 0 < covered.sampler_slack(5).delta < 1e-12
    sixth = accountant()
    for _ in range(6):
        sixth.compose_round()
    budget = sixth.epsilon() + 0.6 * slack  # the sixth release fits without the slack (6/5·slack), not with it
    assert not plain.would_exceed(budget) and covered.would_exceed(budget)
