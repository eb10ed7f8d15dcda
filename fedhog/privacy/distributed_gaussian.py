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

Poisson subsampling with rate q: the general upper bound of Zhu & Wang
(ICML 2019, "Poisson Subsampled Rényi Differential Privacy") for integer
orders α ≥ 2, taken as the minimum with the unamplified ε(α). T rounds
compose additively; dp_accounting converts RDP to (ε, δ).

Neighbouring relation and whose noise counts. The accountant counts the noise
of m clients other than the one whose privacy is at stake, as Kairouz et al.
do (a fixed number of noise shares in every neighbouring output; the
client's own share, and any survivor beyond m, are extra independent noise).
Poisson sampling is accounted add/remove-one with sensitivity Δ₂; fixed-size
sampling replace-one, without amplification (q = 1), with sensitivity 2Δ₂
(2Δ₁): simple and honest, as dp_accounting has no amplification bound for
sampling without replacement of a non-Gaussian mechanism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy.special import gammaln, logsumexp
from scipy.stats import binom

ORDERS: tuple[int, ...] = tuple(range(2, 257))  # integer orders: Zhu & Wang's bound needs ε(j) at every j ≤ α
MIN_SHARES = 2
TAIL_SHARE_OF_DELTA = 0.1  # the binomial tail of Poisson sampling may take at most this share of δ
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


def poisson_subsampled_rdp(rdp: np.ndarray, rate: float, orders: tuple[int, ...] = ORDERS) -> np.ndarray:
    """Zhu & Wang's general upper bound on the RDP of a Poisson-subsampled mechanism, min'd with ``rdp``.

    ``rdp`` holds the unamplified ε(j) at ``orders``, which must be the integers 2..max.
    For integer α: ε'(α) ≤ 1/(α−1)·log[(1−q)^{α−1}(αq−q+1) + C(α,2)q²(1−q)^{α−2}e^{ε(2)}
    + 3Σ_{j=3}^{α} C(α,j)q^j(1−q)^{α−j}e^{(j−1)ε(j)}].
    """
    if tuple(orders) != tuple(range(2, len(orders) + 2)):
        raise ValueError("the subsampling bound needs the integer orders 2..max, each of them")
    if not 0 < rate <= 1:
        raise ValueError(f"rate={rate!r} must be in (0, 1]")
    rdp = np.asarray(rdp, dtype=np.float64)
    if rate == 1:
        return rdp
    weights = _subsampling_log_weights(rate, len(orders))  # [α, j] for j = 0..α_max, −inf beyond α
    exponents = np.concatenate([[0.0, 0.0], (np.arange(2, len(orders) + 2) - 1) * rdp])  # (j−1)·ε(j); 0 for j < 2
    alpha = np.asarray(orders, dtype=np.float64)
    return np.minimum(logsumexp(weights + exponents, axis=1) / (alpha - 1), rdp)


@lru_cache(maxsize=16)
def _subsampling_log_weights(rate: float, count: int) -> np.ndarray:
    """log of Zhu & Wang's coefficients for α = 2..count+1 (rows) and j = 0..count+1 (columns).

    Column 0 holds (1−q)^{α−1}(αq − q + 1) (the j = 0 and 1 terms), column 1 nothing,
    column 2 C(α,2)q²(1−q)^{α−2}, columns j ≥ 3 3·C(α,j)q^j(1−q)^{α−j}.
    """
    alpha = np.arange(2, count + 2, dtype=np.float64)[:, None]
    j = np.arange(count + 2, dtype=np.float64)[None, :]
    with np.errstate(invalid="ignore"):
        weights = (gammaln(alpha + 1) - gammaln(j + 1) - gammaln(np.maximum(alpha - j, 0) + 1)
                   + j * math.log(rate) + (alpha - j) * math.log1p(-rate))
    weights[:, 3:] += math.log(3)
    weights[:, 0] = (alpha[:, 0] - 1) * math.log1p(-rate) + np.log(alpha[:, 0] * rate - rate + 1)
    weights[:, 1] = -np.inf
    weights[j.repeat(count, axis=0) > alpha] = -np.inf
    return weights


def few_contributors_delta(sampling: str, sampling_rate: float, population: int, rounds: int,
                           minimum: int = MIN_SHARES) -> float:
    """What rounds whose cohort may fall below ``minimum`` add to δ over ``rounds`` rounds.

    Such a round releases nothing (secure aggregation refuses to unmask it),
    and whether it happens depends on who was sampled. Under Poisson sampling
    the other N − 1 clients give fewer than ``minimum`` with probability
    P[Bin(N − 1, q) ≤ minimum − 1], with or without any one client, so the run
    is (ε, δ + rounds · that). A fixed cohort of K ≥ ``minimum`` never falls
    below it by sampling: 0. ``minimum = 2`` is SecAgg+'s own floor.
    """
    if sampling != "poisson":
        return 0.0
    return min(1.0, rounds * float(binom.cdf(minimum - 1, population - 1, sampling_rate)))


def poisson_noise_shares(sampling_rate: float, population: int, rounds: int, delta: float) -> int:
    """The largest m ≥ 2 with rounds · P[Bin(N−1, q) ≤ m−1] ≤ δ/10.

    Raises
    ------
    ValueError
        If even m = 2 charges more than δ/10 (too small a population or rate for this δ).
    """
    budget = TAIL_SHARE_OF_DELTA * delta / rounds
    others = np.arange(population)  # m − 1 = 0..N−1
    feasible = np.flatnonzero(binom.cdf(others, population - 1, sampling_rate) <= budget)
    shares = int(feasible[-1]) + 1 if feasible.size else 0
    if shares < MIN_SHARES:
        raise ValueError(f"under Poisson sampling (q={sampling_rate:g}, N={population}) even {MIN_SHARES} noise shares "
                         f"fail with probability above δ/10 = {TAIL_SHARE_OF_DELTA * delta:g} over {rounds} rounds")
    return shares


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
    sampling_rate : float
        q for Poisson amplification; 1 for none.
    """

    l2: float
    dimension: int
    shares: int
    sampling_rate: float

    def rdp(self, local_std: float) -> np.ndarray:
        """ε(α) of one release at :data:`ORDERS`."""
        return poisson_subsampled_rdp(ddg_rdp(local_std, self.shares, self.l2, self.dimension), self.sampling_rate)

    def epsilon(self, local_std: float, releases: int, delta: float) -> float:
        """ε at δ after ``releases`` releases (0 before any)."""
        if releases == 0:
            return 0.0
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
    """ε(δ) of the releases of a distributed-noise run: T releases of one :class:`DdgAccounting` at σ_l.

    The interface of :class:`~fedhog.privacy.accounting.ClientLevelAccountant`
    that the strategy uses. ``delta`` is the accountant's δ (the run's δ less
    the binomial tail charged for Poisson sampling).
    """

    method = "ddg-rdp"
    has_guarantee = True
    event = None  # no continuous-Gaussian event: the PLD and Flower's accountants do not apply

    def __init__(self, accounting: DdgAccounting, local_std: float, delta: float) -> None:
        self.accounting = accounting
        self.local_std = local_std
        self.delta = delta
        self.releases = 0

    def __repr__(self) -> str:
        a = self.accounting
        return (f"DistributedGaussianAccountant(σ_l={self.local_std:.6g}, m={a.shares}, Δ₂={a.l2:.6g}, "
                f"d={a.dimension}, q={a.sampling_rate:g}, δ={self.delta:g})")

    def compose_round(self) -> None:
        """Record one released round."""
        self.releases += 1

    def epsilon(self) -> float:
        """ε spent so far at δ (0 before any release)."""
        return self.accounting.epsilon(self.local_std, self.releases, self.delta)

    def would_exceed(self, max_epsilon: float) -> bool:
        """Whether releasing one more round would push ε past ``max_epsilon``."""
        if math.isinf(max_epsilon):
            return False
        return self.accounting.epsilon(self.local_std, self.releases + 1, self.delta) > max_epsilon

    def state_dict(self) -> dict[str, object]:
        """Serializable state (for checkpoints)."""
        return {"releases": self.releases}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""
        self.releases = int(state["releases"])
