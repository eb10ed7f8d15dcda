"""Row t of C⁻¹Z, one round at a time, from the private lattice noise and a buffer of b − 1 noise vectors.

For a b-banded lower-triangular Toeplitz C (:mod:`.strategies`), C·n = z reads
c_0 n_t + Σ_{k=1}^{b−1} c_k n_{t−k} = z_t, so

    n_t = (z_t − Σ_{k=1}^{b−1} c_k n_{t−k}) / c_0

needs only z_t, drawn fresh each round, and the last b − 1 noise vectors: a buffer of (b − 1)·d float64 (b·d with
the row being made). z_t is fedhog's discrete Gaussian N_ℤ(0, s²)^d drawn from the round's private stream
(:func:`~fedhog.privacy.randomness.lattice_gaussian`), in lattice steps.

The buffer is a secret (with it, the next rounds' noise is predictable): :class:`BandedNoiseStream` cannot be
pickled, its repr shows no values, and it is never written anywhere. A run that restarts starts a fresh stream (a
fresh factorization; see the specification's resume section).

n_t is real, not on the lattice: how a release stays free of float residue is the integration's job (the
specification, "Exactness"); this module produces the noise.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..randomness import RandomBits, lattice_gaussian
from .strategies import BandedToeplitzStrategy


def noise_std_steps(noise_multiplier: float, strategy: BandedToeplitzStrategy, sensitivity_steps: float) -> float:
    """s, the std of z_t in lattice steps: σ (relative to C's column norm, as amplified BandMF accounts it) times
    max‖C[:, s]‖ times one participation's sensitivity in steps."""
    return noise_multiplier * strategy.max_column_norm() * sensitivity_steps


class BandedNoiseStream:
    """Streams n_t = (C⁻¹Z)[t] for t = 0, 1, ..., T − 1.

    Parameters
    ----------
    strategy : BandedToeplitzStrategy
        C.
    dimension : int
        d, the length of each noise vector.
    std_steps : float
        s, the std of each z_t entry in lattice steps (:func:`noise_std_steps`).
    """

    def __init__(self, strategy: BandedToeplitzStrategy, dimension: int, std_steps: float) -> None:
        if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension < 1:
            raise ValueError(f"dimension={dimension!r} must be a positive integer")
        if not (np.isfinite(std_steps) and std_steps > 0):
            raise ValueError(f"std_steps={std_steps!r} must be positive and finite")
        self.strategy = strategy
        self.dimension = dimension
        self.std_steps = float(std_steps)
        self._coefficients = strategy.array
        self._previous: deque[np.ndarray] = deque(maxlen=max(strategy.bands - 1, 0))  # n_{t−1}, n_{t−2}, ...
        self.rounds_drawn = 0

    @property
    def buffer_values(self) -> int:
        """How many float64 values the stream holds between rounds: (b − 1)·d."""
        return len(self._previous) * self.dimension

    def next_row(self, bits: RandomBits) -> np.ndarray:
        """n_t in lattice steps (float64, length d), drawing z_t from ``bits`` (the round's private noise stream)."""
        if self.rounds_drawn >= self.strategy.rounds:
            raise RuntimeError(f"the strategy covers {self.strategy.rounds} rounds; all have been drawn")
        row = lattice_gaussian(bits, self.dimension, self.std_steps).astype(np.float64)
        for k, previous in enumerate(self._previous, start=1):
            row -= self._coefficients[k] * previous
        row /= self._coefficients[0]
        if self._previous.maxlen:
            self._previous.appendleft(row.copy())
        self.rounds_drawn += 1
        return row

    def __getstate__(self) -> None:
        raise TypeError("BandedNoiseStream holds the last b − 1 noise vectors (a secret) and cannot be pickled "
                        "or saved")

    def __repr__(self) -> str:
        return (f"BandedNoiseStream({self.strategy!r}, dimension={self.dimension}, std_steps={self.std_steps:g}, "
                f"rounds_drawn={self.rounds_drawn})")
