"""Whether correlated noise pays, from public parameters only: the noise the model accumulates for each b.

A model trained by summing its rounds' updates (server SGD) carries the prefix sums of the per-round noise. For a
b-banded strategy C (:mod:`.strategies`) with Z of std σ_b·‖c‖ per participation's sensitivity, the t-th prefix
sum's noise has variance σ_b²·‖c‖²·‖(A C⁻¹)[t, :]‖² (in units of the clipping norm, on the sum; the mean divides
by K for every b alike). The planner reports the root mean square of its std over the T rounds,

    prefix noise(b) = σ_b · ‖c‖ · √(mean_t ‖(A C⁻¹)[t, :]‖²),

with σ_b calibrated to (ε, δ) for amplified BandMF (:mod:`.accounting`), relative to independent noise
(b = 1: C = I, σ_1 DP-FedAvg's, √((T + 1)/2)). It also reports each round's own noise the same way
(‖C⁻¹[t, :]‖ instead of the prefix rows): correlated noise makes a round's noise larger while its prefix sums
shrink, and what a non-SGD server optimizer does with that is not in this prediction.

:func:`choose_bands` takes the candidate with the smallest predicted prefix noise; b = 1 is always a candidate
and predicts exactly 1, so no strategy predicted worse than independent noise is chosen.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .accounting import BandedParticipation, calibrate_banded_noise_multiplier
from .strategies import BandedToeplitzStrategy, CoefficientKind


@dataclass(frozen=True)
class NoisePrediction:
    """The predicted noise of one strategy, in units of the clipping norm on the noised sum.

    Attributes
    ----------
    strategy : BandedToeplitzStrategy
        C.
    noise_multiplier : float
        σ_b, relative to one participation's sensitivity (C's column norm times the clipping norm).
    prefix_noise : float
        RMS over rounds of the std of the prefix sums of the noise.
    round_noise : float
        RMS over rounds of the std of each round's own noise.
    ratio : float
        ``prefix_noise`` ÷ independent noise's (b = 1) at the same (N, K, T, ε, δ).
    round_ratio : float
        ``round_noise`` ÷ independent noise's.
    """

    strategy: BandedToeplitzStrategy
    noise_multiplier: float
    prefix_noise: float
    round_noise: float
    ratio: float
    round_ratio: float

    @property
    def bands(self) -> int:
        """b."""
        return self.strategy.bands


def accumulated_noise(strategy: BandedToeplitzStrategy, noise_multiplier: float) -> tuple[float, float]:
    """(prefix noise, round noise) of ``strategy`` at σ = ``noise_multiplier`` (see the module docstring)."""
    scale = noise_multiplier * strategy.max_column_norm()
    return (scale * math.sqrt(float(np.mean(strategy.prefix_errors()))),
            scale * math.sqrt(float(np.mean(strategy.round_errors()))))


def plan_bands(population: int, cohort: int, rounds: int, target_epsilon: float, delta: float,
               candidates: Iterable[int], kind: CoefficientKind = "bsr", accountant: str = "pld",
               tolerance: float = 1e-4) -> tuple[NoisePrediction, ...]:
    """The prediction of each feasible candidate b (K·b ≤ N, b ≤ T) and of b = 1, sorted by b.

    Parameters
    ----------
    population, cohort, rounds : int
        N, the expected cohort K, and T.
    target_epsilon, delta : float
        The budget every candidate is calibrated to.
    candidates : iterable of int
        The b's to consider (b = 1 is added).
    kind : {"bsr", "optimised"}
        The coefficients for b > 1.
    accountant : {"pld", "rdp"}
        The accountant σ_b is calibrated with.
    tolerance : float
        Relative tolerance of each σ_b.
    """
    wanted = sorted({1, *candidates})
    if wanted[0] < 1:
        raise ValueError(f"candidates={sorted(candidates)!r} must be positive integers")
    feasible = [b for b in wanted if b <= rounds and cohort * b <= population]
    independent: tuple[float, float] | None = None
    predictions = []
    for bands in feasible:
        sigma = _calibrated(BandedParticipation(population, cohort, rounds, bands), target_epsilon, delta,
                            accountant, tolerance)
        strategy = BandedToeplitzStrategy.build(kind, rounds, bands)
        prefix, per_round = accumulated_noise(strategy, sigma)
        if independent is None:
            independent = (prefix, per_round)
        predictions.append(NoisePrediction(strategy, sigma, prefix, per_round, prefix / independent[0],
                                           per_round / independent[1]))
    return tuple(predictions)


@functools.lru_cache(maxsize=256)
def _calibrated(participation: BandedParticipation, target_epsilon: float, delta: float, accountant: str,
                tolerance: float) -> float:
    """σ_b, remembered: BSR's and the optimised coefficients share it (it depends on b, not on c)."""
    return calibrate_banded_noise_multiplier(target_epsilon, delta, participation, accountant, tolerance)


def choose_bands(predictions: Sequence[NoisePrediction]) -> NoisePrediction:
    """The prediction with the least prefix noise (the fewer bands on a tie); b = 1 must be among them.

    Raises
    ------
    ValueError
        If independent noise (b = 1) is not a candidate: without it "never worse than independent noise" cannot be
        kept.
    """
    if not any(p.bands == 1 for p in predictions):
        raise ValueError("choose_bands needs the prediction for b = 1 (independent noise) among its candidates")
    return min(predictions, key=lambda p: (p.ratio, p.bands))
