"""Adaptive clipping: the clipping norm C follows a private quantile of the update norms.

After Andrew, Thakkar, McMahan and Ramaswamy, "Differentially Private Learning
with Adaptive Clipping", NeurIPS 2021 (arXiv:1905.03871), Section 3 (Algorithm
1 and Theorem 1).

Vocabulary as in :mod:`fedhog.privacy.mechanism`: clipping norm C, noise
multiplier σ, expected cohort size K. New here: target quantile γ_q, clipping
learning rate η_C, and σ_b, the standard deviation of the noise on the count
(an absolute standard deviation in units of clients, not a multiplier: the
paper's σ_b, Flower's ``clipped_count_stddev``).

Round t, with C_t the clipping norm of that round and u_i the (mixed)
contributions the mechanism clips::

    b_i   = 1[‖u_i‖ ≤ C_t]                                    (before clipping)
    b̃_t   = (Σ_i (b_i − ½) + N(0, σ_b²)) / K + ½
    C_t+1 = C_t · exp(−η_C · (clip_[0,1](b̃_t) − γ_q))

The sum releases centred indicators b_i − ½ ∈ {−½, +½}, so one client moves
it by at most ½ (add/remove) instead of 1: this is the paper's device in the
proof of Theorem 1, and what TF Privacy's ``QuantileEstimatorQuery`` does.
When the number n of contributions equals K this b̃ is exactly the paper's
(Σ b_i + N(0, σ_b²)) / K; under Poisson sampling n is random and private, so
the centred sum, not Σ b_i − n/2, is what may be released. Clamping b̃ to
[0, 1] is post-processing (as in TF Privacy) and bounds one step to a factor
exp(±η_C·max(γ_q, 1 − γ_q)).

Privacy (Theorem 1). Releasing the clipped sum with noise σ_Δ·C (L2
sensitivity C) together with the centred count with noise σ_b (sensitivity
½) is a Gaussian mechanism on the concatenated, rescaled vector whose privacy
loss is that of ONE Gaussian mechanism with noise multiplier σ, where::

    1/σ² = 1/σ_Δ² + (½ / σ_b)²   ⇔   σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)

So the accountant keeps composing σ (the configured noise multiplier, one
event per round, subsampling applied to the joint release), while the
mechanism adds only σ_Δ·C to the sum; σ_Δ > σ, and it is finite only when
σ_b > σ/2. The same identity holds under replace-one (fixed-size sampling):
both sensitivities double (2C and 1), so the pair is one Gaussian with
multiplier σ/2, which is what :func:`~fedhog.privacy.accounting.accountant_noise_multiplier`
already composes. Adapting C costs no privacy beyond this: C_t+1 is a
function of released values only.

The count noise comes from the round's noise stream
(:mod:`fedhog.privacy.randomness`), never from a global RNG, and lives on a
lattice as the update's noise does (:mod:`fedhog.privacy.mechanism`): the
centred sum is a multiple of ½, the noise an integer multiple of a power of
two g ≤ ½, so b̃·K − ½K is a lattice point whatever the norms were.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .lattice import LATTICE_BITS
from .randomness import RandomBits, lattice_gaussian

# Andrew et al. use σ_b = K/20 in their experiments: the count then costs little
# (σ_Δ ≈ σ unless σ approaches K/10) and b̃ has noise std 0.05.
DEFAULT_COUNT_NOISE_PER_CLIENT = 0.05


def default_count_noise_std(expected_cohort: float) -> float:
    """σ_b = K/20, the paper's recommendation (Flower's default too)."""
    _require_positive_finite("expected_cohort", expected_cohort)
    return DEFAULT_COUNT_NOISE_PER_CLIENT * expected_cohort


def update_noise_multiplier(total_noise_multiplier: float, count_noise_std: float) -> float:
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2): the update's share of the overall σ.

    Andrew et al. 2021, Theorem 1: DP-FedAvg with adaptive clipping, noise
    multiplier σ_Δ on the clipped sum and noise std σ_b on the (centred, so
    sensitivity-½) clipped count, has exactly the privacy of non-adaptive
    DP-FedAvg with noise multiplier σ.

    Parameters
    ----------
    total_noise_multiplier : float
        σ ≥ 0, the multiplier the accountant composes. σ = 0 (no guarantee)
        gives σ_Δ = 0: there is no privacy to share.
    count_noise_std : float
        σ_b ≥ 0, the noise std on the count; ``math.inf`` gives σ_Δ = σ
        (an infinitely noisy count costs nothing and tells nothing).

    Raises
    ------
    ValueError
        If either is negative or NaN, σ is infinite, or σ > 0 and σ_b ≤ σ/2
        (then the count alone would spend more than the whole budget).
    """
    sigma, sigma_b = float(total_noise_multiplier), float(count_noise_std)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"total_noise_multiplier={total_noise_multiplier!r} must be a finite number ≥ 0")
    if math.isnan(sigma_b) or sigma_b < 0:
        raise ValueError(f"count_noise_std={count_noise_std!r} must be a number ≥ 0 (or inf)")
    if sigma == 0:
        return 0.0
    if sigma_b <= sigma / 2:
        raise ValueError(
            f"count_noise_std={count_noise_std!r} must exceed total_noise_multiplier/2 = {sigma / 2:g} "
            f"(total_noise_multiplier={total_noise_multiplier!r}): σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) is "
            "finite only for σ_b > σ/2; raise count_noise_std or lower the noise multiplier")
    if math.isinf(sigma_b):
        return sigma
    return (sigma ** -2 - (2 * sigma_b) ** -2) ** -0.5


@dataclass(frozen=True)
class AdaptiveClippingSettings:
    """How the clipping norm adapts.

    Parameters
    ----------
    initial_clipping_norm : float
        C_1 > 0, the norm that clips round 1 (the paper suggests 0.1; the
        geometric update forgets it at rate η_C per round).
    count_noise_std : float
        σ_b ≥ 0 (finite), noise std on the count of unclipped contributions
        (clients, not a multiplier); see :func:`default_count_noise_std`. Must exceed
        σ/2 for the run's noise multiplier σ (checked by :class:`AdaptiveClipping`).
    target_quantile : float
        γ_q in (0, 1): C tracks the norm below which this fraction of
        contributions fall (0.5: clip half of them, the paper's default).
    learning_rate : float
        η_C > 0 of the geometric update (paper: 0.2).
    """

    initial_clipping_norm: float
    count_noise_std: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2

    def __post_init__(self) -> None:
        _require_positive_finite("initial_clipping_norm", self.initial_clipping_norm)
        if not (math.isfinite(self.count_noise_std) and self.count_noise_std >= 0):
            raise ValueError(f"count_noise_std={self.count_noise_std!r} must be a finite number ≥ 0")
        if not 0 < self.target_quantile < 1:
            raise ValueError(f"target_quantile={self.target_quantile!r} must be in (0, 1)")
        _require_positive_finite("learning_rate", self.learning_rate)


@dataclass(frozen=True)
class ClippingStep:
    """What one :meth:`AdaptiveClipping.step` released and decided.

    ``noisy_unclipped_fraction`` (b̃, before clamping) is a DP release and may
    go into round metrics; the exact fraction of contributions under C is
    private and is deliberately not part of this record.
    """

    clipping_norm: float  # C_t, which clipped this round
    noisy_unclipped_fraction: float  # b̃_t
    next_clipping_norm: float  # C_t+1


class AdaptiveClipping:
    """The server's clipping norm, updated once per released round.

    Parameters
    ----------
    settings : AdaptiveClippingSettings
        Target quantile, learning rate, σ_b and C_1.
    total_noise_multiplier : float
        σ, the multiplier the accountant composes; the mechanism must add
        :attr:`update_noise_multiplier` (σ_Δ) instead.

    Raises
    ------
    ValueError
        As :func:`update_noise_multiplier` (σ_b ≤ σ/2, names both arguments).
    """

    def __init__(self, settings: AdaptiveClippingSettings, total_noise_multiplier: float) -> None:
        self.settings = settings
        self.total_noise_multiplier = float(total_noise_multiplier)
        self.update_noise_multiplier = update_noise_multiplier(total_noise_multiplier, settings.count_noise_std)
        self.clipping_norm = float(settings.initial_clipping_norm)
        self.steps = 0

    def __repr__(self) -> str:
        s = self.settings
        return (f"AdaptiveClipping(C={self.clipping_norm:.6g}, γ_q={s.target_quantile}, "
                f"η_C={s.learning_rate}, σ_b={s.count_noise_std:g}, σ={self.total_noise_multiplier:g}, "
                f"σ_Δ={self.update_noise_multiplier:.6g})")

    def step(
        self, norms_before_clip: Sequence[float], expected_cohort: float, bits: RandomBits
    ) -> ClippingStep:
        """Release b̃ for this round's contributions and move C to C_t+1.

        Parameters
        ----------
        norms_before_clip : sequence of float
            ‖u_i‖ of every contribution that entered the clipped sum this
            round, measured before clipping to the current C (may be empty).
        expected_cohort : float
            K, the same fixed denominator as the averaged update.
        bits : RandomBits
            The round's noise stream; the noisy count's N_ℤ(0, (σ_b/g)²) is drawn
            from it (nothing when σ_b = 0), after the model's noise.
        """
        _require_positive_finite("expected_cohort", expected_cohort)
        if not callable(getattr(bits, "words", None)):
            raise TypeError(f"bits={bits!r} must be a RandomBits stream (fedhog.privacy.randomness)")
        norms = [float(n) for n in norms_before_clip]
        bad = [n for n in norms if math.isnan(n) or n < 0]
        if bad:
            raise ValueError(f"norms_before_clip holds {bad[0]!r}; norms must be ≥ 0 and not NaN")
        current = self.clipping_norm
        centred_sum = sum(0.5 if n <= current else -0.5 for n in norms)
        sigma_b = self.settings.count_noise_std
        granularity = 2.0 ** (math.floor(math.log2(max(sigma_b, 1.0))) - LATTICE_BITS)  # divides ½
        noise = float(lattice_gaussian(bits, 1, sigma_b / granularity)[0]) * granularity if sigma_b > 0 else 0.0
        noisy_fraction = (centred_sum + noise) / expected_cohort + 0.5
        clamped = min(1.0, max(0.0, noisy_fraction))
        next_norm = current * math.exp(-self.settings.learning_rate * (clamped - self.settings.target_quantile))
        self.clipping_norm = next_norm
        self.steps += 1
        return ClippingStep(clipping_norm=current, noisy_unclipped_fraction=noisy_fraction,
                            next_clipping_norm=next_norm)

    def state_dict(self) -> dict[str, object]:
        """C for the next round and the number of steps taken (plain Python, for checkpoints)."""
        return {"clipping_norm": self.clipping_norm, "steps": self.steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        norm, steps = float(state["clipping_norm"]), int(state["steps"])
        _require_positive_finite("state['clipping_norm']", norm)
        if steps < 0:
            raise ValueError(f"state['steps']={steps!r} must be ≥ 0")
        self.clipping_norm, self.steps = norm, steps


def _require_positive_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
