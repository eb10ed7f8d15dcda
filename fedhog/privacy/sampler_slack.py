"""What drawing the noise with fedhog's lattice sampler, not the accountant's ideal distribution, adds to (ε, δ).

The sampler's pmf is within exp(±η) of N_ℤ(0, σ_ℤ²) on every value within 20
σ_ℤ (:func:`~fedhog.privacy.randomness.sampler_log_ratio_bound`): exact up to
that factor, not exact. :func:`sampler_slack` bounds what this (and N_ℤ against
the accountant's continuous Gaussian) adds for the trusted server's noise; the
argument is in :mod:`fedhog.privacy.mechanism`'s docstring.
:func:`discrete_sampler_slack` bounds it for the clients' shares of
distributed noise, whose accountant analyses N_ℤ itself. The accountants
(:mod:`fedhog.privacy.accounting`, DP-SGD's, the distributed discrete
Gaussian's) add this slack to every ε they report.
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


def sampler_label() -> str:
    """How ``metrics.json`` names the noise's sampler (the slack it adds is reported next to it)."""
    eta = sampler_log_ratio_bound()
    return f"discrete Gaussian on the lattice, exact up to a factor exp(±η) per value, η = {eta:.2g}"


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


def discrete_sampler_slack(values_per_release: int, releases: int, epsilon: float, delta: float) -> SamplerSlack:
    """The slack of ``releases`` releases, each computed from ``values_per_release`` draws of N_ℤ(0, σ_ℤ²), against
    an accountant of exact N_ℤ draws at (``epsilon``, ``delta``); η does not depend on σ_ℤ.

    Each draw's pmf is within exp(±η) of N_ℤ's on |x| ≤ 20 σ_ℤ; the draws are
    independent, so on the event that all of them are in that window the joint
    pmf, and therefore the pmf of anything computed from the draws (the noised
    sum), is within exp(±κ) of the exact mechanism's, κ = T·v·η. Outside it
    (probability p ≤ T·v·2.7·e^{−20²/2} under either sampler, the neighbour's
    shift does not move the draws) the bound is lost. Against the exact
    mechanism's (ε, δ) this gives (ε + 2κ, e^κ·δ + p·(1 + e^{ε+κ})), as
    :func:`sampler_slack` without its rounding terms.
    """
    if releases == 0 or values_per_release == 0:
        return SamplerSlack(0.0, 0.0)
    draws = releases * values_per_release
    kappa = draws * sampler_log_ratio_bound()
    outside = min(1.0, draws * 2.7 * math.exp(-BULK_STDS**2 / 2))
    try:
        tail = outside * (1 + math.exp(epsilon + kappa))
    except OverflowError:
        tail = math.inf
    return SamplerSlack(2 * kappa, math.expm1(kappa) * delta + min(1.0, tail))
