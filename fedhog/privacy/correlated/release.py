"""The exact banded release: correlated lattice noise with no float residue of the data and no holes.

Adding the real row n_t of C⁻¹Z (:mod:`.noise`) to the lattice sum g·S_t would give up what fedhog's lattice
release guarantees (:mod:`fedhog.privacy.mechanism`): a release whose low-order bits carry nothing of the data, and
noise that can reach every lattice point. Instead the private release is the integer vector

    r_t = R_t + z_t,    R_t = round(Σ_{k<b} c_k S_{t−k}),    z_t ~ N_ℤ(0, s²)^d,

i.e. C·S rounded onto the lattice plus the discrete Gaussian, and the model's sum is its post-processing
y_t = g·(C⁻¹r)_t = (g·r_t − Σ_{k≥1} c_k y_{t−k})/c_0, computed from r and the previous (public) y's. R_t is exact
integer arithmetic: the coefficients are dyadic, c_k = m_k·2⁻²⁰ with c_0 = 1 (:func:`dyadic_strategy`), and
S = hi·2³¹ + lo is split so that every product and sum fits int64:
Σ c_k S_{t−k} = 2¹¹·Σ m_k hi_{t−k} + 2⁻²⁰·Σ m_k lo_{t−k}.

Sensitivity (:func:`release_sensitivity_steps`): a participation in round j moves S_j by δ (‖δ‖ ≤ C/g + √d/2
steps). Row j moves by exactly δ (c_0 = 1, and round(a + δ) = round(a) + δ for integer δ); rows j+1..j+b−1 move
by c_k·δ plus < 1 step a coordinate of rounding; other rows do not move. So ‖r − r′‖ ≤ ‖c‖·‖δ‖ + √((b − 1)·d),
and z_t's std must be σ (relative to that, as amplified BandMF accounts) times it. b = 1 is DP-FedAvg's release
bit for bit.

The buffers — the b − 1 previous lattice sums (the data's aggregates) and y's — live only in the object, which
refuses to be pickled.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from ..randomness import RandomBits, lattice_gaussian
from .strategies import BandedToeplitzStrategy

COEFFICIENT_BITS = 20  # c_k = m_k·2⁻²⁰: 6 significant digits, far finer than any loss difference between strategies
_SPLIT_BITS = 31  # S = hi·2³¹ + lo, 0 ≤ lo < 2³¹
_MAX_ABS_COEFFICIENT = 2.0  # |m_k| ≤ 2²¹: b ≤ 64 products of lo stay below 2⁵⁸
MAX_ABS_LATTICE_SUM = 2**55  # |S| below this: Σ m_k hi (|hi| < 2²⁴) times 2¹¹ stays below 2⁶²


def dyadic_strategy(strategy: BandedToeplitzStrategy) -> BandedToeplitzStrategy:
    """``strategy`` scaled to c_0 = 1 with every coefficient rounded to a multiple of 2⁻²⁰ (its sensitivity and
    errors are then computed from these coefficients, not the unrounded ones)."""
    scaled = strategy.array / strategy.array[0]
    rounded = np.round(scaled * 2.0**COEFFICIENT_BITS) / 2.0**COEFFICIENT_BITS
    return BandedToeplitzStrategy(tuple(rounded.tolist()), strategy.rounds, strategy.kind)


def release_sensitivity_steps(strategy: BandedToeplitzStrategy, contribution_steps: float, dimension: int) -> float:
    """How far one participation moves the release r, in lattice steps: ‖c‖·``contribution_steps`` + √((b−1)·d)."""
    return strategy.max_column_norm() * contribution_steps + math.sqrt((strategy.bands - 1) * dimension)


class BandedLatticeRelease:
    """Round by round: r_t = round((C·S)_t) + z_t on the lattice, and the model's sum y_t = g·(C⁻¹r)_t.

    Parameters
    ----------
    strategy : BandedToeplitzStrategy
        C, with c_0 = 1 and dyadic coefficients (:func:`dyadic_strategy`), |c_k| ≤ 2, b ≤ 64.
    granularity : float
        g, the lattice step.
    std_steps : float
        s, the std of z_t in steps: σ × :func:`release_sensitivity_steps`.
    """

    def __init__(self, strategy: BandedToeplitzStrategy, granularity: float, std_steps: float) -> None:
        numerators = strategy.array * 2.0**COEFFICIENT_BITS
        if strategy.coefficients[0] != 1.0 or not np.array_equal(numerators, np.round(numerators)):
            raise ValueError("the strategy needs c_0 = 1 and coefficients that are multiples of 2^-20 "
                             "(use dyadic_strategy)")
        if strategy.bands > 64 or np.max(np.abs(strategy.array)) > _MAX_ABS_COEFFICIENT:
            raise ValueError(f"{strategy!r}: at most 64 bands and |c_k| ≤ 2 keep the integer sums within int64")
        if not (math.isfinite(granularity) and granularity > 0) or not (math.isfinite(std_steps) and std_steps > 0):
            raise ValueError(f"granularity={granularity!r} and std_steps={std_steps!r} must be positive and finite")
        self.strategy = strategy
        self.granularity = granularity
        self.std_steps = std_steps
        self._numerators = numerators.astype(np.int64)
        self._sums: deque[np.ndarray] = deque(maxlen=strategy.bands)  # S_t, S_{t−1}, ...: secret
        self._released: deque[np.ndarray] = deque(maxlen=max(strategy.bands - 1, 0))  # y_{t−1}, ...: public
        self.rounds_released = 0

    def _encode(self, lattice_sum: np.ndarray) -> np.ndarray:
        """R_t = round(Σ_k c_k S_{t−k}) exactly (int64; ties round up), keeping ``lattice_sum`` as S_t."""
        lattice_sum = np.asarray(lattice_sum)
        if lattice_sum.dtype != np.int64:
            raise TypeError(f"the lattice sum must be int64, got {lattice_sum.dtype}")
        if lattice_sum.size and int(np.max(np.abs(lattice_sum))) >= MAX_ABS_LATTICE_SUM:
            raise OverflowError("a lattice sum entry reaches 2^55: the exact encoding would overflow int64")
        if self._sums and lattice_sum.shape != self._sums[0].shape:
            raise ValueError(f"lattice sum of shape {lattice_sum.shape}; earlier rounds had {self._sums[0].shape}")
        self._sums.appendleft(lattice_sum.copy())
        high = np.zeros_like(lattice_sum)
        low = np.zeros_like(lattice_sum)
        for numerator, past in zip(self._numerators, self._sums, strict=False):
            high += numerator * (past >> _SPLIT_BITS)
            low += numerator * (past & (2**_SPLIT_BITS - 1))
        half = 2 ** (COEFFICIENT_BITS - 1)
        return (high << (_SPLIT_BITS - COEFFICIENT_BITS)) + ((low + half) >> COEFFICIENT_BITS)

    def release(self, lattice_sum: np.ndarray, bits: RandomBits) -> tuple[np.ndarray, np.ndarray]:
        """(r_t, y_t): the private lattice release (int64) and the model's noised sum g·(C⁻¹r)_t (float64)."""
        if self.rounds_released >= self.strategy.rounds:
            raise RuntimeError(f"the strategy covers {self.strategy.rounds} rounds; all have been released")
        encoded = self._encode(lattice_sum)
        lattice_release = encoded + lattice_gaussian(bits, encoded.size, self.std_steps).reshape(encoded.shape)
        model_sum = lattice_release.astype(np.float64) * self.granularity
        for coefficient, previous in zip(self.strategy.coefficients[1:], self._released, strict=False):
            model_sum -= coefficient * previous
        if self._released.maxlen:
            self._released.appendleft(model_sum.copy())
        self.rounds_released += 1
        return lattice_release, model_sum

    def __getstate__(self) -> None:
        raise TypeError("BandedLatticeRelease holds the last lattice sums (secret) and cannot be pickled or saved")

    def __repr__(self) -> str:
        return (f"BandedLatticeRelease({self.strategy!r}, granularity={self.granularity:g}, "
                f"std_steps={self.std_steps:g}, rounds_released={self.rounds_released})")
