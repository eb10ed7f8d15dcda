"""What drawing the noise with fedhog's exact lattice sampler, not the accountant's continuous Gaussian, adds to (ε, δ).

The argument is in :mod:`fedhog.privacy.mechanism`'s docstring; the accountants
(:mod:`fedhog.privacy.accounting`, DP-SGD's) add this slack to every ε they report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .randomness import BULK_STDS, sampler_log_ratio_bound

MAX_TAIL_DELTA_SHARE = 0.01  # the sampler's slack may add at most this share of δ


@dataclass(frozen=True)
class SamplerSlack:
    """What drawing the noise with fedhog's sampler, not the accountant's continuous Gaussian, adds to (ε, δ).

    ``epsilon`` is added to the accountant's ε; ``delta`` is what the values
    beyond the analysed 20 standard deviations (and the factor on the rest)
    add to δ at the accountant's ε. The argument: :mod:`fedhog.privacy.mechanism`.
    """

    epsilon: float
    delta: float


def sampler_slack(accountant_noise_multiplier: float, std_steps: float, dimension: int, releases: int,
                  epsilon: float, delta: float) -> SamplerSlack:
    """The slack of ``releases`` releases of ``dimension`` lattice-noise coordinates of std ``std_steps`` steps.

    Per coordinate and value within 20 σ_ℤ: the sampler's pmf is within
    exp(±η) of N_ℤ(0, σ_ℤ²) (:func:`sampler_log_ratio_bound`), which is within
    exp(±17/σ_ℤ²) of round(N(0, σ_ℤ²)) (∫_{−½}^{½} e^{−(2ku+u²)/2σ²}du lies in
    [e^{−1/8σ²}, e^{k²/24σ⁴}]; the normaliser is 1 + O(e^{−2π²σ²})). Over the
    whole run's κ = T·d·(η + 17/σ_ℤ² + 3e^{−2π²σ_ℤ²}) this gives, against the
    accountant's (ε, δ) of the continuous mechanism, (ε + 2κ,
    e^κ·δ + p·(1 + e^{ε+κ})) with p = T·d·2.7·e^{−(20 − 1/σ)²/2} the chance
    that a value, or its neighbour's (shifted by at most 1/σ standard
    deviations, σ the accountant's multiplier), leaves the 20 σ_ℤ window.
    """
    if accountant_noise_multiplier <= 0 or releases == 0:
        return SamplerSlack(0.0, 0.0)
    per_value = (sampler_log_ratio_bound() + 17 / std_steps**2 + 3 * math.exp(-2 * math.pi**2 * std_steps**2))
    kappa = releases * dimension * per_value
    window = BULK_STDS - 1 / accountant_noise_multiplier
    outside = 1.0 if window <= 0 else min(1.0, releases * dimension * 2.7 * math.exp(-window**2 / 2))
    try:
        tail = outside * (1 + math.exp(epsilon + kappa))
    except OverflowError:
        tail = math.inf
    return SamplerSlack(2 * kappa, math.expm1(kappa) * delta + min(1.0, tail))
