"""Banded lower-triangular Toeplitz strategies C for the prefix-sum workload A (A[t, s] = 1 for s ≤ t).

The matrix mechanism factorises A = B·C and releases C·X + Z; the model sees B(C·X + Z) = A·(X + C⁻¹Z), so round
t adds row t of C⁻¹Z to its sum (:mod:`.noise`). C is lower-triangular Toeplitz with b bands,
C[t, s] = c_{t−s} for 0 ≤ t − s < b, so that a client whose participations are at least b rounds apart touches
disjoint rows (:mod:`.sensitivity`); b = 1 with c_0 = 1 is independent noise (DP-FedAvg).

Coefficients:

- **BSR** (Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
  Training", NeurIPS 2024): the Toeplitz coefficients of A^{1/2}, c_k = binom(2k, k)/4^k (the power series of
  (1 − x)^{−1/2}), truncated to b bands. With b = T, C·C = A exactly.
- **optimised**: the b coefficients that minimise the mean squared prefix-sum error at unit column norm,
  mean_t ‖(A C⁻¹)[t, :]‖² · ‖c‖² (the loss of McKenna, "Scaling up the Amplified Banded Matrix Factorization
  Mechanism", 2024, which ``jax_privacy``'s ``optimize_banded_toeplitz`` minimises), by L-BFGS from BSR's. For a
  fixed b, the σ that amplified accounting needs does not depend on c (it is relative to the column norm), so
  these coefficients also minimise the amplified loss, σ_b times the error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import optimize, signal

CoefficientKind = Literal["bsr", "optimised"]
COEFFICIENT_KINDS: tuple[CoefficientKind, ...] = ("bsr", "optimised")


def prefix_sum_matrix(rounds: int) -> np.ndarray:
    """A: the T×T lower-triangular matrix of ones (the model is the prefix sum of the updates)."""
    return np.tril(np.ones((rounds, rounds)))


def bsr_coefficients(bands: int) -> np.ndarray:
    """c_0..c_{b−1} of A^{1/2}: c_k = ∏_{j≤k} (2j − 1)/(2j) = binom(2k, k)/4^k (positive, decreasing)."""
    _check_positive_int("bands", bands)
    k = np.arange(1, bands)
    return np.concatenate([[1.0], np.cumprod((2 * k - 1) / (2 * k))])


def toeplitz_solve(coefficients: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """C⁻¹·rhs along axis 0 for the lower-triangular Toeplitz C of ``coefficients`` (a recursion, O(T·b))."""
    return signal.lfilter([1.0], coefficients, rhs, axis=0)


def prefix_errors(coefficients: np.ndarray, rounds: int) -> np.ndarray:
    """‖(A C⁻¹)[t, :]‖² for t = 0..T−1: the variance that unit-variance Z puts on the t-th prefix sum of C⁻¹Z."""
    decoder = toeplitz_solve(coefficients, np.ones(rounds))  # A C⁻¹ is Toeplitz: its first column
    return np.cumsum(decoder**2)


def round_errors(coefficients: np.ndarray, rounds: int) -> np.ndarray:
    """‖C⁻¹[t, :]‖² for t = 0..T−1: the variance that unit-variance Z puts on round t's own noise."""
    unit = np.zeros(rounds)
    unit[0] = 1.0
    return np.cumsum(toeplitz_solve(coefficients, unit) ** 2)


def mean_prefix_loss(coefficients: np.ndarray, rounds: int) -> float:
    """mean_t ‖(A C⁻¹)[t, :]‖² · ‖c‖²: the mean squared prefix-sum error at unit column norm (scale-free)."""
    return float(np.mean(prefix_errors(coefficients, rounds)) * np.dot(coefficients, coefficients))


_DIVERGED = 1e100  # |C⁻¹ 1| beyond this: the strategy's noise explodes


def _loss_and_gradient(coefficients: np.ndarray, rounds: int) -> tuple[float, np.ndarray]:
    """:func:`mean_prefix_loss` and its gradient in c (adjoint of the Toeplitz solve); a huge loss and no gradient
    where C⁻¹ overflows (c(x) with a root inside the unit disk), so that the line search steps back."""
    bands = coefficients.size
    with np.errstate(over="ignore", invalid="ignore"):
        y = toeplitz_solve(coefficients, np.ones(rounds))  # y = C⁻¹ 1
    if not np.all(np.isfinite(y)) or np.max(np.abs(y)) > _DIVERGED:
        return _DIVERGED, np.zeros(bands)
    weights = (rounds - np.arange(rounds)) / rounds  # mean_t Σ_{s≤t} y_s² = Σ_s w_s y_s²
    error = float(weights @ y**2)
    adjoint = toeplitz_solve(coefficients, (weights * y)[::-1])[::-1]  # v = C⁻ᵀ (w ∘ y)
    # ∂y/∂c_k = −C⁻¹ S_k y (S_k shifts down by k): ∂error/∂c_k = −2 Σ_t v_t y_{t−k}
    error_gradient = np.array([-2 * adjoint[k:] @ y[:rounds - k] for k in range(bands)])
    norm2 = float(coefficients @ coefficients)
    return error * norm2, error_gradient * norm2 + 2 * error * coefficients


def optimised_coefficients(bands: int, rounds: int, max_iterations: int = 500) -> np.ndarray:
    """The b coefficients minimising :func:`mean_prefix_loss` over T rounds, by L-BFGS-B from BSR's.

    c_0 = 1 (the loss is scale-free); c_1..c_{b−1} searched in [0, 1], the box BSR's lie in, and without bounds;
    the best of the two runs and BSR's own comes back, so never worse than BSR.
    """
    _check_positive_int("rounds", rounds)
    start = bsr_coefficients(min(bands, rounds))
    if start.size == 1:
        return start

    def tail_loss(tail: np.ndarray) -> tuple[float, np.ndarray]:
        value, gradient = _loss_and_gradient(np.concatenate([[1.0], tail]), rounds)
        return value, gradient[1:]

    found = [start]
    for bounds in ([(0.0, 1.0)] * (start.size - 1), None):  # the box first; unbounded where the box run stalls
        result = optimize.minimize(tail_loss, start[1:], jac=True, method="L-BFGS-B", bounds=bounds,
                                   options={"maxiter": max_iterations})
        found.append(np.concatenate([[1.0], np.asarray(result.x, dtype=np.float64)]))
    return min(found, key=lambda c: _loss_and_gradient(c, rounds)[0])  # start first: ties keep BSR's


@dataclass(frozen=True)
class BandedToeplitzStrategy:
    """A T×T lower-triangular Toeplitz strategy C with b = ``len(coefficients)`` bands, c_0 ≠ 0.

    Parameters
    ----------
    coefficients : tuple of float
        c_0..c_{b−1}: C[t, s] = c_{t−s} for 0 ≤ t − s < b, 0 elsewhere.
    rounds : int
        T, the number of rounds (C's size); b ≤ T.
    kind : str
        Where the coefficients come from ("bsr", "optimised", or "independent" for b = 1), for reports.
    """

    coefficients: tuple[float, ...]
    rounds: int
    kind: str = "bsr"

    def __post_init__(self) -> None:
        _check_positive_int("rounds", self.rounds)
        if not 1 <= len(self.coefficients) <= self.rounds:
            raise ValueError(f"{len(self.coefficients)} coefficients: a strategy over rounds={self.rounds} "
                             "needs between 1 and that many bands")
        if not all(math.isfinite(c) for c in self.coefficients) or self.coefficients[0] == 0:
            raise ValueError(f"coefficients={self.coefficients!r} must be finite with c_0 ≠ 0 (C invertible)")

    @classmethod
    def independent(cls, rounds: int) -> BandedToeplitzStrategy:
        """C = I: independent noise every round (DP-FedAvg)."""
        return cls((1.0,), rounds, "independent")

    @classmethod
    def bsr(cls, rounds: int, bands: int) -> BandedToeplitzStrategy:
        """BSR: A^{1/2}'s coefficients truncated to ``bands`` (b = 1 is :meth:`independent`)."""
        if bands == 1:
            return cls.independent(rounds)
        return cls(tuple(bsr_coefficients(bands).tolist()), rounds, "bsr")

    @classmethod
    def optimised(cls, rounds: int, bands: int) -> BandedToeplitzStrategy:
        """:func:`optimised_coefficients` for ``bands`` over ``rounds`` (b = 1 is :meth:`independent`)."""
        if bands == 1:
            return cls.independent(rounds)
        return cls(tuple(optimised_coefficients(bands, rounds).tolist()), rounds, "optimised")

    @classmethod
    def build(cls, kind: CoefficientKind, rounds: int, bands: int) -> BandedToeplitzStrategy:
        """The strategy of coefficient ``kind`` (one of :data:`COEFFICIENT_KINDS`)."""
        if kind not in COEFFICIENT_KINDS:
            raise ValueError(f"kind={kind!r} must be one of {COEFFICIENT_KINDS}")
        return cls.bsr(rounds, bands) if kind == "bsr" else cls.optimised(rounds, bands)

    @property
    def bands(self) -> int:
        """b, the number of bands."""
        return len(self.coefficients)

    @property
    def array(self) -> np.ndarray:
        """c_0..c_{b−1} as float64."""
        return np.asarray(self.coefficients, dtype=np.float64)

    def matrix(self) -> np.ndarray:
        """C, dense T×T (for tests and small T)."""
        out = np.zeros((self.rounds, self.rounds))
        for k, c in enumerate(self.coefficients):
            out += c * np.eye(self.rounds, k=-k)
        return out

    def column_norms(self) -> np.ndarray:
        """‖C[:, s]‖ for each round s: the late columns are cut off by the end of the matrix."""
        squares = self.array**2
        full = np.concatenate([squares, np.zeros(max(0, self.rounds - self.bands))])[:self.rounds]
        return np.sqrt(np.cumsum(full)[::-1])

    def max_column_norm(self) -> float:
        """max_s ‖C[:, s]‖ = ‖c‖ (the first column holds every coefficient)."""
        return float(np.linalg.norm(self.array))

    def prefix_errors(self) -> np.ndarray:
        """:func:`prefix_errors` of this strategy, at its own scale (unit-variance Z)."""
        return prefix_errors(self.array, self.rounds)

    def round_errors(self) -> np.ndarray:
        """:func:`round_errors` of this strategy, at its own scale."""
        return round_errors(self.array, self.rounds)

    def __repr__(self) -> str:
        return f"BandedToeplitzStrategy({self.kind}, bands={self.bands}, rounds={self.rounds})"


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
