"""Client sampling schemes whose amplification the accountant assumes."""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

SamplingKind = Literal["poisson", "fixed"]
SAMPLING_METHODS: tuple[str, ...] = ("poisson", "fixed")


def poisson_sample(population: Sequence[int], rate: float, rng: np.random.Generator) -> list[int]:
    """Include each member independently with probability ``rate`` (q)."""
    keep = rng.random(len(population)) < rate
    return [member for member, kept in zip(population, keep) if kept]


def fixed_size_sample(population: Sequence[int], size: int, rng: np.random.Generator) -> list[int]:
    """Draw exactly ``size`` members uniformly without replacement."""
    chosen = rng.choice(len(population), size=size, replace=False)
    return [population[i] for i in sorted(chosen)]


def sample_cohort(
    population: Sequence[int], method: SamplingKind, rate: float, rng: np.random.Generator
) -> list[int]:
    """Sample one round's cohort; ``rate·len(population)`` is the fixed size for ``fixed``."""
    if method == "poisson":
        return poisson_sample(population, rate, rng)
    return fixed_size_sample(population, expected_cohort_size(len(population), rate), rng)


def expected_cohort_size(population_size: int, rate: float) -> int:
    """K = q·N, which the config guarantees to be a whole number."""
    return int(round(rate * population_size))
