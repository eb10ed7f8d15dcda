"""The lattice g·ℤ^d that clipped contributions are rounded onto, summed on exactly, and noised on.

c_i is rounded onto g·ℤ^d (g a power of two, about 2⁻⁴⁰ of the noise std) and
the integers are summed exactly, S = Σ_i round(c_i / g): one contribution moves
g·S by at most C + g√d/2. Why the noise drawn on this lattice is exactly what
the accountant assumes: :mod:`fedhog.privacy.mechanism`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

LATTICE_BITS = 40  # g = 2^(⌊log2(max(σ, 1)·C)⌋ − 40): ~2^7 float64 values of the noise per lattice cell
MAX_CONTRIBUTIONS = 2**21  # |round(c_i / g)| ≤ 2^41 each: the int64 sum of this many cannot overflow


class ClippedNoise(Protocol):
    """What the lattice reads of a mechanism: its clipping norm C and noise multiplier σ."""

    @property
    def clipping_norm(self) -> float: ...

    @property
    def noise_multiplier(self) -> float: ...


@dataclass(frozen=True)
class NoiseLattice:
    """The lattice g·ℤ^d that contributions are rounded onto and the noise lives on.

    Parameters
    ----------
    granularity : float
        g, a power of two.
    dimension : int
        d, the length of the flat model vector.
    rounding_steps : float
        How far rounding moves a coordinate at most, in steps g: ½ for
        rounding to nearest (the trusted server), 1 for stochastic rounding
        (clients under secure aggregation).
    """

    granularity: float
    dimension: int
    rounding_steps: float = 0.5

    @classmethod
    def for_settings(cls, mechanism: ClippedNoise, dimension: int) -> NoiseLattice:
        """The trusted server's lattice for a mechanism's C and σ: g = 2^(⌊log2(max(σ, 1)·C)⌋ − 40), fine against
        the noise, coarse against float64 spacing."""
        scale = mechanism.clipping_norm * max(mechanism.noise_multiplier, 1.0)
        return cls(2.0 ** (math.floor(math.log2(scale)) - LATTICE_BITS), dimension)

    @property
    def rounding_slack(self) -> float:
        """g√d/2 (g√d for stochastic rounding): how far rounding onto the lattice can move one contribution (L2)."""
        return self.granularity * math.sqrt(self.dimension) * self.rounding_steps

    def quantize(self, vector: torch.Tensor) -> torch.Tensor:
        """round(vector / g) as int64 (|entries| ≤ C/g ≤ 2^41 for a clipped contribution)."""
        return torch.round(vector.to(torch.float64) / self.granularity).to(torch.int64)

    def sum_std(self, mechanism: ClippedNoise) -> float:
        """s = σ·(C + g√d/2): the noise std on the sum, calibrated to its sensitivity."""
        return mechanism.noise_multiplier * (mechanism.clipping_norm + self.rounding_slack)
