"""Client sampling (statistically) and client-level accounting (against dp_accounting called directly)."""

import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp
from scipy import stats

from fedhog.privacy.accounting import ClientLevelAccountant, accountant_noise_multiplier
from fedhog.privacy.randomness import SecureBits, SeededBits, uniform_below
from fedhog.privacy.sampling import (
    expected_cohort_size,
    fixed_size_sample,
    poisson_sample,
    sample_cohort,
)

STREAMS = {"seeded": lambda seed: SeededBits(seed), "os": lambda seed: SecureBits()}

ALPHA = 1e-9  # probability that a correct implementation fails one statistical check
DELTA = 1e-5


# --- sampling ------------------------------------------------------------------


@pytest.mark.parametrize("stream", STREAMS)
def test_poisson_sample_rate_and_independence(stream):
    population = list(range(500, 1500))  # members are not indices
    q, draws = 0.1, 2000
    rng = STREAMS[stream](0)
    counts = np.zeros(len(population), dtype=np.int64)
    sizes = []
    for _ in range(draws):
        cohort = poisson_sample(population, q, rng)
        assert cohort == sorted(set(cohort)) and set(cohort) <= set(population)
        counts[np.asarray(cohort, dtype=np.int64) - 500] += 1
        sizes.append(len(cohort))
    n = len(population)
    # overall inclusion rate: exact binomial test on N·draws Bernoulli(q) trials
    assert stats.binomtest(int(counts.sum()), n * draws, q).pvalue > ALPHA
    # every member has the same rate: each count ~ Binomial(draws, q), independent
    chi2 = float(np.sum((counts - draws * q) ** 2) / (draws * q * (1 - q)))
    assert stats.chi2.sf(chi2, n) > ALPHA and stats.chi2.cdf(chi2, n) > ALPHA
    # independent inclusion: cohort size ~ Binomial(N, q), so its variance is Nq(1-q), not 0
    variance_ratio = np.var(sizes, ddof=1) / (n * q * (1 - q))
    low, high = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], draws - 1) / (draws - 1)
    assert low < variance_ratio < high


def test_poisson_sample_extreme_rates():
    rng = SeededBits(1)
    assert poisson_sample([3, 1, 2], 1.0, rng) == [3, 1, 2]
    assert poisson_sample(list(range(100)), 0.0, rng) == []


@pytest.mark.parametrize("stream", STREAMS)
def test_fixed_size_sample_exact_size_no_duplicates_uniform(stream):
    population = [10 * i + 7 for i in range(50)]
    size, draws = 10, 5000
    rng = STREAMS[stream](2)
    counts = dict.fromkeys(population, 0)
    pair_01 = 0
    for _ in range(draws):
        cohort = fixed_size_sample(population, size, rng)
        assert len(cohort) == size and len(set(cohort)) == size
        assert set(cohort) <= set(population)
        for member in cohort:
            counts[member] += 1
        pair_01 += population[0] in cohort and population[1] in cohort
    n, p = len(population), size / len(population)
    observed = np.array(list(counts.values()), dtype=float)
    # Without replacement, counts have covariance R p(1-p) N/(N-1) (I - 11ᵀ/N), so
    # Σ (O - Rp)² / (R p (1-p)) · (N-1)/N ~ χ²(N-1).
    statistic = float(np.sum((observed - draws * p) ** 2) / (draws * p * (1 - p))) * (n - 1) / n
    assert stats.chi2.sf(statistic, n - 1) > ALPHA and stats.chi2.cdf(statistic, n - 1) > ALPHA
    # pairs are included together with probability k(k-1) / (N(N-1)) (uniform over subsets)
    pair_p = size * (size - 1) / (n * (n - 1))
    assert stats.binomtest(pair_01, draws, pair_p).pvalue > ALPHA


def test_sample_cohort_dispatch():
    rng = SeededBits(3)
    population = list(range(200))
    assert all(len(sample_cohort(population, "fixed", 0.05, rng)) == 10 for _ in range(50))
    sizes = {len(sample_cohort(population, "poisson", 0.05, rng)) for _ in range(50)}
    assert len(sizes) > 1  # Poisson cohorts vary in size
    assert expected_cohort_size(1000, 0.1) == 100
    assert expected_cohort_size(30, 0.1) == 3  # 0.1·30 = 3.0000000000000004 rounds to 3


def test_uniform_below_has_no_modulo_bias():
    # bound 3 does not divide 2^64: a plain modulo would favour 0 by 1 part in 6e18 (invisible), so check
    # the rejection path directly with a stream whose first word is in the biased tail
    class Words:
        def __init__(self, words):
            self.queue = list(words)

        def words(self, count):
            return np.array([self.queue.pop(0) for _ in range(count)], dtype=np.uint64)

    tail = 2**64 - 1  # ≥ 2^64 − (2^64 mod 3): rejected
    assert uniform_below(Words([tail, 7]), 3) == 7 % 3
    counts = np.bincount([uniform_below(SeededBits(4, (i,)), 3) for i in range(3000)], minlength=3)
    assert stats.chisquare(counts).pvalue > ALPHA
    with pytest.raises(ValueError, match="bound=0"):
        uniform_below(SeededBits(0), 0)


# --- accounting: against dp_accounting directly ----------------------------------


def direct_poisson_epsilon(sigma, q, rounds, delta=DELTA):
    accountant = rdp.RdpAccountant()  # add/remove-one
    for _ in range(rounds):
        accountant.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
    return accountant.get_epsilon(delta)


def direct_fixed_epsilon(sigma, population, cohort, rounds, delta=DELTA):
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        population, cohort, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(event, rounds)
    return accountant.get_epsilon(delta)


def test_poisson_accountant_matches_dp_accounting():
    sigma, q, n, rounds = 2.0, 0.1, 1000, 4
    accountant = ClientLevelAccountant(sigma, "poisson", q, n, DELTA)
    assert accountant.has_guarantee
    assert accountant.event.noise_multiplier == sigma
    assert (accountant.event.sample_size, accountant.event.population_size) == (100, 1000)
    epsilons = []
    for _ in range(rounds):
        accountant.compose_round()
        epsilons.append(accountant.epsilon())
    for t, eps in enumerate(epsilons, start=1):
        assert eps == pytest.approx(direct_poisson_epsilon(sigma, q, t), rel=1e-9)
    assert all(a < b for a, b in itertools.pairwise(epsilons))
    assert accountant.releases == rounds


def test_fixed_size_sampling_composes_half_sigma():
    assert accountant_noise_multiplier(1.3, "fixed") == 1.3 / 2
    assert accountant_noise_multiplier(1.3, "poisson") == 1.3
    sigma, q, n, rounds = 2.0, 0.1, 1000, 3
    accountant = ClientLevelAccountant(sigma, "fixed", q, n, DELTA)
    assert accountant.event.noise_multiplier == sigma / 2
    assert accountant.event.sample_size == 100
    for _ in range(rounds):
        accountant.compose_round()
    with_half = direct_fixed_epsilon(sigma / 2, n, 100, rounds)
    with_full = direct_fixed_epsilon(sigma, n, 100, rounds)
    assert accountant.epsilon() == pytest.approx(with_half, rel=1e-9)
    # sensitivity 2C under replace-one: the σ (not σ/2) accounting would claim far less ε
    assert with_full < 0.7 * with_half
    assert accountant.epsilon() != pytest.approx(with_full, rel=0.05)


def test_published_rdp_value():
    # Standard reference point (TF Privacy / dp_accounting RDP): σ = 1.0, q = 0.1, T = 100, δ = 1e-5 → ε ≈ 7.90
    assert direct_poisson_epsilon(1.0, 0.1, 1, 1e-5) < 7.90  # sanity: one round spends far less
    accountant = ClientLevelAccountant(1.0, "poisson", 0.1, 1000, 1e-5)
    accountant.compose_round()
    # T = 100 identical releases, restored as a checkpoint would be (100 separate composes take ~15 s)
    state = accountant.state_dict()
    state["releases"] = 100
    state["backend"]["compositions"][0]["count"] = 100
    restored = ClientLevelAccountant(1.0, "poisson", 0.1, 1000, 1e-5)
    restored.load_state_dict(state)
    assert restored.epsilon() == pytest.approx(7.90, rel=0.01)
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 100)
    assert accountant.get_epsilon(1e-5) == pytest.approx(7.90, rel=0.01)


@pytest.mark.parametrize("sigma, has_guarantee", [(0.0, True), (1.0, False), (0.0, False)])
@pytest.mark.parametrize("sampling", ["poisson", "fixed"])
def test_no_guarantee_is_infinite_epsilon_after_a_release(sigma, has_guarantee, sampling):
    accountant = ClientLevelAccountant(sigma, sampling, 0.1, 100, DELTA, has_guarantee=has_guarantee)
    assert not accountant.has_guarantee and accountant.event is None
    assert accountant.epsilon() == 0.0
    assert not accountant.would_exceed(math.inf)
    assert accountant.would_exceed(1e6)  # any finite budget is exceeded by the first release
    accountant.compose_round()
    assert accountant.epsilon() == math.inf
    state = json.loads(json.dumps(accountant.state_dict()))
    other = ClientLevelAccountant(sigma, sampling, 0.1, 100, DELTA, has_guarantee=has_guarantee)
    other.load_state_dict(state)
    assert other.releases == 1 and other.epsilon() == math.inf


def test_epsilon_is_zero_before_any_release():
    assert ClientLevelAccountant(1.0, "poisson", 0.1, 100, DELTA).epsilon() == 0.0


def test_would_exceed_is_about_the_next_release_and_does_not_compose():
    sigma, q, n = 2.0, 0.1, 1000
    accountant = ClientLevelAccountant(sigma, "poisson", q, n, DELTA)
    first, second = direct_poisson_epsilon(sigma, q, 1), direct_poisson_epsilon(sigma, q, 2)
    assert accountant.would_exceed(first * 0.999)
    assert not accountant.would_exceed(first * 1.001)
    assert not accountant.would_exceed(math.inf)
    assert accountant.releases == 0 and accountant.epsilon() == 0.0  # nothing composed
    accountant.compose_round()
    assert accountant.would_exceed(second * 0.999)
    assert not accountant.would_exceed(second * 1.001)
    # the current ε may already be under the budget while the next release is not
    assert first < second * 0.999
    assert accountant.epsilon() == pytest.approx(first, rel=1e-9)


def test_state_dict_round_trip_gives_same_epsilon():
    sigma, q, n = 2.0, 0.1, 1000
    accountant = ClientLevelAccountant(sigma, "fixed", q, n, DELTA)
    for _ in range(2):
        accountant.compose_round()
    state = json.loads(json.dumps(accountant.state_dict()))  # checkpoints go through JSON
    restored = ClientLevelAccountant(sigma, "fixed", q, n, DELTA)
    restored.load_state_dict(state)
    assert restored.releases == 2
    assert restored.epsilon() == accountant.epsilon()
    accountant.compose_round()
    restored.compose_round()
    assert restored.epsilon() == accountant.epsilon()
    assert restored.epsilon() == pytest.approx(direct_fixed_epsilon(sigma / 2, n, 100, 3), rel=1e-9)
    # a checkpoint of a different privacy configuration is refused
    with pytest.raises(ValueError, match="privacy configuration does not match"):
        ClientLevelAccountant(sigma, "fixed", q, n, 1e-6).load_state_dict(state)
    # so is a state whose count of releases is not an integer, or without the backend this accountant keeps
    for bad in ({**state, "releases": "3"}, {**state, "releases": 2.0}, {**state, "backend": None},
                {**state, "backend": [1]}):
        with pytest.raises(ValueError, match=r"accountant state|no backend state"):
            ClientLevelAccountant(sigma, "fixed", q, n, DELTA).load_state_dict(bad)
