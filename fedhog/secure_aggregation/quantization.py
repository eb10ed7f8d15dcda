"""Clipped contributions as integers modulo M = 2^b, so that masked vectors sum exactly.

A client's clipped contribution c (‖c‖ ≤ C, so |c_j| ≤ C) is stochastically
rounded onto the lattice g·ℤ^d: q_j = ⌊c_j/g⌋ + Bernoulli(c_j/g − ⌊c_j/g⌋), an
unbiased estimate with |q_j·g − c_j| < g. It is sent as q mod M. The sum of n
such vectors satisfies |Σ q_j| ≤ n·(C/g + 1) < M/2, so the centred residue of
the sum mod M is the integer sum itself: no wrap-around for honest clients.
g is the smallest power of two for which that holds with the largest cohort
n the sampling can produce (the population N under Poisson sampling, K under
fixed-size sampling), so the precision is what the modulus allows,
g ≈ 2·n·C/M, and g, which the release reveals, is fixed before the run: it
does not depend on who was sampled.

Error of the released sum against the unquantised one: each coordinate is
off by less than n·g (and by g·√(n/4) in standard deviation, the rounding
being unbiased); in L2, less than n·g·√d. Sensitivity: one contribution's
lattice vector has norm at most C + g√d, which is what the server's noise is
calibrated to (:attr:`ModularLattice.noise_lattice`); with distributed noise
the range also holds the noise of the largest cohort (:meth:`ModularLattice.for_cohort`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..choices import MAX_MODULUS_BITS, MIN_MODULUS_BITS
from ..privacy.lattice import NoiseLattice
from ..privacy.randomness import RandomBits, uniform

WRAP_STDS = 10  # the range holds the noise of a full cohort to 10 standard deviations


@dataclass(frozen=True)
class ModularLattice:
    """The lattice g·ℤ^d, reduced modulo M = 2^``modulus_bits``, for sums of up to ``cohort`` contributions.

    Parameters
    ----------
    modulus_bits : int
        b, with M = 2^b.
    granularity : float
        g, a power of two.
    cohort : int
        n, the most contributions a sum may hold.
    """

    modulus_bits: int
    granularity: float
    cohort: int

    @classmethod
    def for_cohort(cls, clipping_norm: float, cohort: int, modulus_bits: int,
                   noise_std: Callable[[float], float] | None = None) -> ModularLattice:
        """The finest power-of-two g for which n·(C/g + 1) + 10·σ(g) < M/2.

        ``noise_std(g)`` is the std σ of the noise a sum of n contributions
        carries, in steps of g (distributed noise; none by default). The
        discrete Gaussian noise of n clients is nσ_l²-subgaussian (Canonne,
        Kamath & Steinke 2020), so the noised sum of a coordinate wraps around
        with probability below 2·exp(−50) < 10⁻²⁰. A wrap is post-processing
        of the noised sum: it can cost accuracy, never privacy.

        Raises
        ------
        ValueError
            If the modulus is too small for the cohort (fewer than 2 levels per contribution).
        """
        if not MIN_MODULUS_BITS <= modulus_bits <= MAX_MODULUS_BITS:
            raise ValueError(f"modulus_bits={modulus_bits} must be in {MIN_MODULUS_BITS}..{MAX_MODULUS_BITS}")
        cohort = max(cohort, 1)
        levels = (2 ** (modulus_bits - 1) - 1) // cohort - 1  # C/g may be at most this
        if levels < 2:
            raise ValueError(f"a modulus of 2^{modulus_bits} leaves fewer than 2 levels per contribution "
                             f"for a cohort of {cohort}")
        granularity = 2.0 ** math.ceil(math.log2(clipping_norm / levels))
        if noise_std is not None:
            half = 2 ** (modulus_bits - 1)
            while cohort * (clipping_norm / granularity + 1) + WRAP_STDS * noise_std(granularity) >= half:
                granularity *= 2
                if clipping_norm / granularity < 2:
                    raise ValueError(f"a modulus of 2^{modulus_bits} leaves fewer than 2 levels per contribution "
                                     f"for a cohort of {cohort} and its noise")
        return cls(modulus_bits, granularity, cohort)

    @property
    def modulus(self) -> int:
        """M = 2^b."""
        return 1 << self.modulus_bits

    @property
    def wire_dtype(self) -> np.dtype:
        """The unsigned integer type a residue travels in (uint32 up to 32 bits)."""
        return np.dtype(np.uint32) if self.modulus_bits <= 32 else np.dtype(np.uint64)

    def noise_lattice(self, dimension: int) -> NoiseLattice:
        """The lattice the server's noise is added on: stochastic rounding moves a contribution by < g√d."""
        return NoiseLattice(self.granularity, dimension, rounding_steps=1.0)

    def sum_error_bound(self, contributions: int, dimension: int) -> float:
        """An L2 bound on ‖g·Σq_i − Σc_i‖: each coordinate is off by less than n·g."""
        return contributions * self.granularity * math.sqrt(dimension)

    def stochastic_round(self, contribution: torch.Tensor, bits: RandomBits) -> np.ndarray:
        """q = ⌊c/g⌋ + Bernoulli(frac): unbiased integers (int64) for one clipped contribution [d].

        Raises
        ------
        ValueError
            If an integer would leave the range that keeps the cohort's sum free of wrap-around
            (a contribution that was not clipped to C).
        """
        scaled = contribution.detach().to(torch.float64).cpu().numpy() / self.granularity
        floor = np.floor(scaled)
        levels = floor.astype(np.int64) + (uniform(bits, scaled.size) < (scaled - floor))
        if levels.size and int(np.abs(levels).max()) > self.max_level:
            raise ValueError(f"a quantised coordinate exceeds {self.max_level} levels: clip the contribution first")
        return levels

    @property
    def max_level(self) -> int:
        """The largest |q_j| the range allows: n of them sum to less than M/2."""
        return (2 ** (self.modulus_bits - 1) - 1) // self.cohort

    def encode(self, levels: np.ndarray) -> np.ndarray:
        """Integers as residues mod M (uint64)."""
        return levels.astype(np.uint64) & np.uint64(self.modulus - 1)

    def decode_sum(self, residues: np.ndarray) -> torch.Tensor:
        """The centred lift of a sum mod M: the integer in [−M/2, M/2) (int64)."""
        residues = residues.astype(np.uint64) & np.uint64(self.modulus - 1)
        signed = residues.astype(np.int64)
        signed[signed >= self.modulus // 2] -= self.modulus
        return torch.from_numpy(signed)
