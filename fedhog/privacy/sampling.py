"""Client sampling schemes whose amplification the accountant assumes.

The draws come from the round's sampling stream (:mod:`fedhog.privacy.randomness`):
a cohort nobody can predict is what amplification by sampling assumes.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..choices import SamplingKind
from .randomness import RandomBits, uniform, uniform_below


def poisson_sample(population: Sequence[int], rate: float, bits: RandomBits) -> list[int]:
    """Include each member independently with probability ``rate`` (q)."""
    keep = uniform(bits, len(population)) < rate
    return [member for member, kept in zip(population, keep, strict=True) if kept]


def fixed_size_sample(population: Sequence[int], size: int, bits: RandomBits) -> list[int]:
    """Draw exactly ``size`` members uniformly without replacement (a partial Fisher–Yates shuffle)."""
    if not 0 <= size <= len(population):
        raise ValueError(f"size={size!r} must be in 0..{len(population)}")
    order = list(range(len(population)))
    for i in range(size):
        j = i + uniform_below(bits, len(population) - i)
        order[i], order[j] = order[j], order[i]
    return [population[i] for i in sorted(order[:size])]


def sample_cohort(population: Sequence[int], method: SamplingKind, rate: float, bits: RandomBits) -> list[int]:
    """Sample one round's cohort; ``rate·len(population)`` is the fixed size for ``fixed``."""
    if method == "poisson":
        return poisson_sample(population, rate, bits)
    return fixed_size_sample(population, expected_cohort_size(len(population), rate), bits)


def expected_cohort_size(population_size: int, rate: float) -> int:
    """K = q·N, which the config guarantees to be a whole number."""
    return round(rate * population_size)
