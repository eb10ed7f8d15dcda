"""The private randomness: streams and samplers, against statistics and closed forms."""

import math

import numpy as np
import pytest
from scipy import stats

from fedhog.privacy.randomness import (
    MAX_STANDARD_NORMAL,
    PrivacyRandomness,
    SecureBits,
    SeededBits,
    client_bits,
    standard_normal,
    uniform,
)

ALPHA = 1e-9
N = 1_000_000


@pytest.mark.parametrize("make", [lambda: SeededBits(5), SecureBits], ids=["seeded", "os"])
def test_standard_normal_is_standard_normal(make):
    z = standard_normal(make(), N)
    assert z.dtype == np.float64 and z.shape == (N,)
    assert stats.kstest(z, "norm").pvalue > ALPHA
    # mean, variance and the fourth moment against N(0, 1)
    assert abs(z.mean()) < stats.norm.isf(ALPHA / 2) / math.sqrt(N)
    low, high = stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], N)
    assert low < float(np.sum(z**2)) < high
    assert float(np.mean(z**4)) == pytest.approx(3.0, abs=6 * math.sqrt(96 / N))
    assert np.abs(z).max() <= MAX_STANDARD_NORMAL


def test_standard_normal_odd_counts_and_pairs_are_independent():
    z = standard_normal(SeededBits(1), 2 * 200_001)
    assert standard_normal(SeededBits(1), 7).shape == (7,)
    half = len(z) // 2
    # Box–Muller's two outputs of a pair (r cos θ, r sin θ) are independent: correlation ~ N(0, 1/n)
    corr = float(np.dot(z[:half], z[half:])) / half
    assert abs(corr) * math.sqrt(half) < stats.norm.isf(ALPHA / 2)
    # and so are their squares (a dependent pair would correlate r²)
    squares = np.corrcoef(z[:half] ** 2, z[half:] ** 2)[0, 1]
    assert abs(squares) * math.sqrt(half) < stats.norm.isf(ALPHA / 2)


def test_the_radius_reaches_the_far_tail():
    """The radius uniform refines below 2^-11 with a second word: without it normals would stop at 8.57."""
    assert MAX_STANDARD_NORMAL == pytest.approx(13.37, abs=0.01)  # noqa: SIM300 (a constant, not a Yoda condition)

    class Zeros:  # the smallest words possible: the largest radius
        def words(self, count):
            return np.zeros(count, dtype=np.uint64)

    z = standard_normal(Zeros(), 2)
    assert z[0] == pytest.approx(MAX_STANDARD_NORMAL, rel=1e-12)  # cos 0 = 1
    assert z[1] == 0.0


def test_uniform_is_uniform_on_the_unit_interval():
    u = uniform(SeededBits(2), N)
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > ALPHA


def test_seeded_streams_repeat_and_keys_separate_them():
    assert np.array_equal(SeededBits(7, (1, 2)).words(5), SeededBits(7, (1, 2)).words(5))
    assert not np.array_equal(SeededBits(7, (1, 2)).words(5), SeededBits(7, (2, 1)).words(5))
    with pytest.raises(ValueError, match="seed=-1"):
        SeededBits(-1)


def test_secure_streams_differ_and_rekey_before_the_counter_wraps():
    assert not np.array_equal(SecureBits().words(4), SecureBits().words(4))
    bits = SecureBits()
    bits._blocks_left = 1  # pylint: disable=protected-access  # as if 256 GiB had been drawn
    first = bits.words(16)  # 2 blocks: a fresh key
    assert bits._blocks_left == 2**32 - 2  # pylint: disable=protected-access
    assert first.shape == (16,)


def test_round_streams_follow_from_seed_and_round_alone():
    fixed = PrivacyRandomness(11)
    a, b = fixed.for_round(4), PrivacyRandomness(11).for_round(4)
    assert np.array_equal(a.noise.words(3), b.noise.words(3))  # a resumed run draws what the first would
    assert not np.array_equal(fixed.for_round(5).noise.words(3), PrivacyRandomness(11).for_round(4).noise.words(3))
    streams = fixed.for_round(1)
    assert len({s.words(2).tobytes() for s in (streams.sampling, streams.mixing, streams.noise)}) == 3
    assert fixed.seed_is_fixed and not PrivacyRandomness().seed_is_fixed
    assert isinstance(PrivacyRandomness().for_round(1).noise, SecureBits)


def test_client_streams_are_their_own():
    assert isinstance(client_bits(None, 1, 0), SecureBits)
    server = PrivacyRandomness(3).for_round(2)
    client = client_bits(3, 2, 0)
    words = {client.words(2).tobytes()} | {s.words(2).tobytes() for s in (server.sampling, server.mixing, server.noise)}
    assert len(words) == 4
    assert not np.array_equal(client_bits(3, 2, 0).words(2), client_bits(3, 2, 1).words(2))
