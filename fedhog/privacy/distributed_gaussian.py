"""Accounting of the distributed discrete Gaussian mechanism (secure aggregation with noise from the clients).

Each client stochastically rounds its clipped contribution c_i (‖c_i‖ ≤ C)
onto g·ℤ^d and adds d i.i.d. discrete Gaussians N_ℤ(0, σ_l²) (lattice
units) before masking; the server unmasks only the noised integer sum.

Sensitivity in lattice units. Stochastic rounding moves each coordinate by
less than one step, so a rounded contribution has L2 norm at most
Δ₂ = C/g + √d (the deterministic bound of Kairouz, Liu & Steinke 2021,
"The Distributed Discrete Gaussian Mechanism for Federated Learning with
Secure Aggregation", Theorem 1 with β = 0) and, being an integer vector,
L1 norm at most Δ₁ = Δ₂·min(√d, Δ₂).

RDP of the sum of m i.i.d. N_ℤ(0, σ_l²) per coordinate (their Proposition 14),
with τ = 10·Σ_{k=1}^{m−1} exp(−2π²σ_l²·k/(k+1)), s₂ = Δ₂/(√m σ_l),
s₁ = Δ₁/(√m σ_l)::

    ε(α) = min( α/2·s₂² + τd,  α/2·(s₂² + 2s₁τ + τ²d),  α/2·(s₂ + √d·τ)² )

T rounds compose additively; dp_accounting converts RDP to (ε, δ).

Neighbouring relation and whose noise counts: fixed-size cohorts of K,
replace-one (one client's data changed), sensitivity 2Δ₂ (2Δ₁), no
amplification by sampling. A round is released only when at least m
contributions are in the sum; every contributor's share is in both
neighbouring outputs, so m shares are always there, and survivors beyond m
add independent noise (post-processing). Poisson sampling is not offered:
under add/remove-one the client at stake brings (or not) its own noise
share, so neighbouring outputs differ in their noise's variance as well as
their mean, which Proposition 14 does not bound.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp

from .sampler_slack import SamplerSlack, discrete_sampler_slack

ORDERS: tuple[int, ...] = tuple(range(2, 257))
MIN_SHARES = 2
_MAX_BISECTION_STEPS = 200
_MAX_STD = 2.0**60  # σ_l is searched in [2⁻⁶⁰, 2⁶⁰] lattice steps


def l2_sensitivity(clipping_norm: float, granularity: float, dimension: int) -> float:
    """Δ₂ = C/g + √d: one stochastically rounded contribution's L2 norm bound, in lattice steps."""
    return clipping_norm / granularity + math.sqrt(dimension)


def l1_sensitivity(l2: float, dimension: int) -> float:
    """Δ₁ = Δ₂·min(√d, Δ₂): the L1 bound of an integer vector of L2 norm ≤ Δ₂."""
    return l2 * min(math.sqrt(dimension), l2)


def log_tau(local_std: float, shares: int) -> float:
    """log τ, τ = 10·Σ_{k=1}^{m−1} exp(−2π²σ_l²·k/(k+1)), by log-sum-exp: finite however large σ_l is
    (τ = exp(log τ) then underflows cleanly to 0); −inf when m = 1."""
    if shares < 2:
        return -math.inf
    k = np.arange(1, shares, dtype=np.float64)
    return math.log(10.0) + float(logsumexp(-2 * math.pi**2 * local_std**2 * k / (k + 1)))


def ddg_rdp(local_std: float, shares: int, l2: float, dimension: int,
            orders: np.ndarray | tuple[int, ...] = ORDERS) -> np.ndarray:
    """ε(α) of one release of the sum of ``shares`` clients' discrete Gaussian noise (Kairouz et al., Prop. 14).

    ``l2`` is the L2 sensitivity in lattice steps under the neighbouring relation
    (Δ₂, or 2Δ₂ for replace-one); the L1 sensitivity is derived from it.
    """
    alpha = np.asarray(orders, dtype=np.float64)
    scale = math.sqrt(shares) * local_std
    s2, s1 = l2 / scale, l1_sensitivity(l2, dimension) / scale
    tau = math.exp(log_tau(local_std, shares))  # 0.0 once σ_l ≳ 2
    return np.minimum.reduce([
        alpha / 2 * s2**2 + tau * dimension,
        alpha / 2 * (s2**2 + 2 * s1 * tau + tau**2 * dimension),
        alpha / 2 * (s2 + math.sqrt(dimension) * tau) ** 2,
    ])


@dataclass(frozen=True)
class DdgAccounting:
    """What one release of the distributed discrete Gaussian costs, as the accountant sees it.

    Parameters
    ----------
    l2 : float
        L2 sensitivity in lattice steps under the neighbouring relation (Δ₂ or 2Δ₂).
    dimension : int
        d.
    shares : int
        m, the clients whose noise the accountant counts.
    """

    l2: float
    dimension: int
    shares: int

    def rdp(self, local_std: float) -> np.ndarray:
        """ε(α) of one release at :data:`ORDERS`."""
        return ddg_rdp(local_std, self.shares, self.l2, self.dimension)

    def epsilon(self, local_std: float, releases: int, delta: float) -> float:
        """ε at δ after ``releases`` releases (0 before any)."""
        if releases == 0:
            return 0.0
        # imported here: the ClientApp imports this module, and loads no accountant unless a client accounts
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        return float(compute_epsilon(ORDERS, releases * self.rdp(local_std), delta)[0])

    def calibrate(self, target_epsilon: float, releases: int, delta: float, tolerance: float = 0.005) -> float:
        """The σ_l whose ε after ``releases`` at δ is in [(1 − tolerance)·target, target] (bisection on log σ_l)."""
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon={target_epsilon!r} must be positive and finite")
        low = high = 1.0
        while self.epsilon(high, releases, delta) > target_epsilon:
            low, high = high, high * 2
            if high > _MAX_STD:
                raise ValueError(f"target_epsilon={target_epsilon!r} is out of reach below σ_l = {_MAX_STD:g}")
        while low == high or self.epsilon(low, releases, delta) <= target_epsilon:
            low /= 2
            if low < 1 / _MAX_STD:
                raise ValueError(f"target_epsilon={target_epsilon!r} is met even at σ_l = {low:g}")
        for _ in range(_MAX_BISECTION_STEPS):
            if self.epsilon(high, releases, delta) >= (1 - tolerance) * target_epsilon:
                break
            middle = math.sqrt(low * high)
            if self.epsilon(middle, releases, delta) > target_epsilon:
                low = middle
            else:
                high = middle
        return high


class DistributedGaussianAccountant:
    """ε(δ) of the releases of a distributed-noise run: T releases of one :class:`DdgAccounting` at σ_l, plus what
    the clients' sampler adds (:func:`~fedhog.privacy.sampler_slack.discrete_sampler_slack`: each share is N_ℤ up
    to a factor exp(±η) per value; ``values_per_release`` is every draw that can enter one release, K·d).

    An :class:`~fedhog.privacy.accounting.Accountant`, as
    :class:`~fedhog.privacy.accounting.ClientLevelAccountant` is.
    """

    method = "ddg-rdp"
    has_guarantee = True

    def __init__(self, accounting: DdgAccounting, local_std: float, delta: float, values_per_release: int) -> None:
        self.accounting = accounting
        self.local_std = local_std
        self.delta = delta
        self.values_per_release = values_per_release
        self.releases = 0

    def __repr__(self) -> str:
        a = self.accounting
        return (f"DistributedGaussianAccountant(σ_l={self.local_std:.6g}, m={a.shares}, Δ₂={a.l2:.6g}, "
                f"d={a.dimension}, δ={self.delta:g})")

    def describe(self) -> str:
        """Who adds the noise, and this accountant."""
        return f"distributed noise: each client adds N_Z(0, σ_l²); accounting: {self!r}"

    @property
    def noise_multiplier(self) -> float:
        """The equivalent noise multiplier as composed: the std of m shares over the replace-one sensitivity 2Δ₂."""
        return math.sqrt(self.accounting.shares) * self.local_std / (self.accounting.l2 / 2) / 2

    def cover_sampler(self, std_steps: float, values_per_release: int) -> None:
        """Nothing: the clients draw the noise; their draws are counted from the plan (``values_per_release``)."""

    def sampler_slack(self, releases: int) -> SamplerSlack:
        """What the clients' sampler adds to ε and δ after ``releases`` releases (δ's share at the ε they reach)."""
        pure = self.accounting.epsilon(self.local_std, releases, self.delta)
        return discrete_sampler_slack(self.values_per_release, releases, pure, self.delta)

    def _epsilon_after(self, releases: int) -> float:
        """ε at δ after ``releases`` releases, the sampler's slack included."""
        if releases == 0:
            return 0.0
        return self.accounting.epsilon(self.local_std, releases, self.delta) + self.sampler_slack(releases).epsilon

    def plan(self, rounds: int) -> None:
        """Nothing to compute ahead: ε after n releases is n·RDP, in constant time."""

    def compose_round(self) -> None:
        """Record one released round."""
        self.releases += 1

    def epsilon(self) -> float:
        """ε spent so far at δ, the sampler's slack included (0 before any release)."""
        return self._epsilon_after(self.releases)

    def would_exceed(self, max_epsilon: float) -> bool:
        """Whether releasing one more round would push ε past ``max_epsilon``."""
        if math.isinf(max_epsilon):
            return False
        return self._epsilon_after(self.releases + 1) > max_epsilon

    def state_dict(self) -> dict[str, object]:
        """Serializable state (for checkpoints)."""
        return {"releases": self.releases}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.releases = int(state["releases"])
