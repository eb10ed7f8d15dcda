"""Distributed noise (``noise = "distributed"``): each client adds its share of discrete Gaussian noise.

Under SecAgg+ with central noise the server unmasks the exact sum before
noising it. Here every client adds d i.i.d. N_ℤ(0, σ_l²) (lattice steps) to
its quantised contribution before masking, so the server only ever unmasks
a noised sum and adds nothing (Kairouz, Liu & Steinke 2021). The plan —
the lattice, the m clients whose noise the accountant counts and σ_l — is a
function of public config and the model's dimension only: every client
computes the same one and needs nothing secret (or trusted) from the server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..privacy.distributed_gaussian import MIN_SHARES, DdgAccounting, DistributedGaussianAccountant, l2_sensitivity
from ..privacy.lattice import NoiseLattice
from ..privacy.mechanism import AggregateStats, Contribution, Mechanism, RowStats
from ..privacy.randomness import RandomBits, discrete_gaussian
from ..privacy.sampler_slack import discrete_sampler_slack
from .quantization import ModularLattice

if TYPE_CHECKING:
    from ..privacy.accounting import Accountant
    from ..privacy.sampling import SamplingKind


@dataclass(frozen=True)
class DistributedNoise:
    """What every client adds and what the accountant counts, fixed before the run.

    Parameters
    ----------
    lattice : ModularLattice
        g and M for the largest cohort, with room for its noise.
    clipping_norm : float
        C.
    local_std : float
        σ_l, each client's discrete Gaussian std in lattice steps.
    shares : int
        m: a sum of fewer contributions is never unmasked.
    dimension : int
        d.
    delta : float
        The δ at which ε is reported.
    """

    lattice: ModularLattice
    clipping_norm: float
    local_std: float
    shares: int
    dimension: int
    delta: float

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ = C/g + √d in lattice steps (a rounded contribution's L2 bound)."""
        return l2_sensitivity(self.clipping_norm, self.lattice.granularity, self.dimension)

    @property
    def noise_multiplier(self) -> float:
        """The equivalent total noise multiplier: the std of m shares over Δ₂."""
        return math.sqrt(self.shares) * self.local_std / self.l2_sensitivity

    @property
    def accountant_noise_multiplier(self) -> float:
        """The equivalent noise multiplier as the accountant sees it: halved, replace-one moves the sum by 2Δ₂."""
        return self.noise_multiplier / 2

    @property
    def accounting(self) -> DdgAccounting:
        """The accountant's view of one release: replace-one, sensitivity 2Δ₂."""
        return DdgAccounting(2 * self.l2_sensitivity, self.dimension, self.shares)

    def accountant(self) -> DistributedGaussianAccountant:
        """A fresh accountant of this run's releases."""
        return DistributedGaussianAccountant(self.accounting, self.local_std, self.delta, self.draws_per_release)

    @property
    def draws_per_release(self) -> int:
        """K·d: the discrete Gaussian values that can enter one release (d from each client of the largest cohort)."""
        return self.lattice.cohort * self.dimension

    def sample(self, bits: RandomBits) -> np.ndarray:
        """One client's noise share: d draws of N_ℤ(0, σ_l²) from its own stream (int64)."""
        return discrete_gaussian(bits, self.dimension, self.local_std)

    def record(self) -> dict[str, object]:
        """What ``metrics.json`` says of the noise (public figures only)."""
        return {"noise": "distributed", "noise_shares": self.shares, "local_noise_std_steps": self.local_std,
                "granularity": self.lattice.granularity, "total_noise_multiplier": self.noise_multiplier,
                "neighbouring_relation": "replace-one"}


@lru_cache(maxsize=8)
def plan_distributed_noise(clipping_norm: float, dimension: int, modulus_bits: int, cohort: int, threshold: float,
                           rounds: int, delta: float, target_epsilon: float, noise_multiplier: float
                           ) -> DistributedNoise:
    """The plan of a run of fixed-size cohorts of K, from public config and the model's dimension (the same on the
    server and every client).

    m = ``max(2, ⌈threshold·K⌉)``. σ_l: calibrated so that ε after ``rounds``
    releases at δ, the clients' sampler's slack included, meets ``target_epsilon`` (when > 0), else
    ``noise_multiplier``·Δ₂/√m (the sum of m shares carries the std the central
    mode adds). g: the finest power of two whose range holds the cohort and its
    noise (:meth:`ModularLattice.for_cohort`), each candidate g with its own σ_l.

    Raises
    ------
    ValueError
        If no g leaves 2 levels per contribution.
    """
    shares = max(MIN_SHARES, math.ceil(threshold * cohort))
    slack = discrete_sampler_slack(cohort * dimension, rounds, 0.0, delta).epsilon  # the clients' sampler's ε share
    stds: dict[float, float] = {}

    def local_std(granularity: float) -> float:
        if granularity not in stds:
            noise = DistributedNoise(ModularLattice(modulus_bits, granularity, cohort), clipping_norm, 1.0, shares,
                                     dimension, delta)
            stds[granularity] = (noise.accounting.calibrate(target_epsilon - slack, rounds, delta)
                                 if target_epsilon > 0 else noise_multiplier * noise.l2_sensitivity / math.sqrt(shares))
        return stds[granularity]

    lattice = ModularLattice.for_cohort(clipping_norm, cohort, modulus_bits,
                                        noise_std=lambda g: math.sqrt(cohort) * local_std(g))
    return DistributedNoise(lattice, clipping_norm, local_std(lattice.granularity), shares, dimension, delta)


@dataclass(frozen=True)
class DistributedGaussian(Mechanism):
    """Distributed noise (``noise = "distributed"``, under SecAgg+): ``inner`` bounds each contribution on its client,
    each client adds its share of discrete Gaussian noise before masking (:meth:`noise_share`), and the server adds
    none to the unmasked sum (:meth:`add_noise`). Accounted by the distributed discrete Gaussian's RDP
    (:class:`~fedhog.privacy.distributed_gaussian.DistributedGaussianAccountant`).
    """

    inner: Mechanism
    plan: DistributedNoise
    clipping_norm: float = field(init=False, repr=False, compare=False)  # the inner mechanism's C
    noise_multiplier: float = field(init=False, repr=False, compare=False)  # the config's σ (σ_l is the plan's)

    def __post_init__(self) -> None:
        object.__setattr__(self, "clipping_norm", self.inner.clipping_norm)
        object.__setattr__(self, "noise_multiplier", self.inner.noise_multiplier)

    @property
    def name(self) -> str:
        """The inner mechanism's name (the config's ``mechanism``)."""
        return self.inner.name

    @property
    def wants_term(self) -> bool:
        """Whether the inner mechanism mixes a term in."""
        return self.inner.wants_term

    def with_clipping(self, clipping_norm: float, noise_multiplier: float) -> DistributedGaussian:
        """Refused: the clients' noise plan (σ_l, the lattice) is calibrated to C, so C cannot change in a run."""
        raise ValueError("distributed noise cannot change its clipping norm: the clients' noise plan is calibrated "
                         "to it (adaptive clipping runs with a trusted server)")

    @property
    def has_guarantee(self) -> bool:
        """Always: the plan's σ_l > 0 (the config refuses distributed noise without a noise level)."""
        return True

    def describe(self) -> str:
        """The inner mechanism's per-contribution step, and who adds the noise."""
        return (f"{self.inner.describe().split(', the server adds')[0]} on each client, which adds its share of "
                f"noise, N_ℤ(0, σ_l²) with σ_l={self.plan.local_std:.6g} lattice steps; the server adds none")

    def constrain_sensitivity(self, updates: torch.Tensor, terms: torch.Tensor | None,
                              xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """The inner mechanism's (on each client)."""
        return self.inner.constrain_sensitivity(updates, terms, xis)

    def xis(self, stream: RandomBits, population: int, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """The inner mechanism's."""
        return self.inner.xis(stream, population, slots)

    def noise_share(self, levels: np.ndarray, bits: RandomBits) -> np.ndarray:
        """``levels`` plus this client's share: d draws of N_ℤ(0, σ_l²) from its own stream."""
        return levels + self.plan.sample(bits)

    def add_noise(self, lattice_sum: torch.Tensor, lattice: NoiseLattice, bits: RandomBits,
                  contributors: int) -> tuple[torch.Tensor, float]:
        """g·S as it is (every contributor's share is in it), and the std of those shares, √contributors·σ_l·g."""
        return (lattice_sum.to(torch.float64) * lattice.granularity,
                math.sqrt(contributors) * self.plan.local_std * lattice.granularity)

    def aggregate(self, contributions: list[Contribution], expected_cohort: float, xis: Sequence[float] | np.ndarray,
                  bits: RandomBits, numel: int,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, AggregateStats]:
        """Refused: a trusted server adds its own noise; distributed noise runs under secure aggregation only."""
        raise ValueError("distributed noise runs under secure aggregation only: the trusted server adds its own noise")

    def accountant(self, sampling: SamplingKind, sampling_rate: float, population: int, delta: float,
                   method: str) -> Accountant:
        """The plan's accountant: T releases of the distributed discrete Gaussian (its own RDP, the plan's δ)."""
        return self.plan.accountant()
