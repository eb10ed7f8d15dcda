"""The higher-order mixing and the Gaussian mechanism on clipped contributions.

Vocabulary (one name per concept, as in the README): update Δ_i, third-order
term t_i, mixing strength γ, clipping norm C, noise multiplier σ, expected
cohort size K, model dimension d.

The mechanism is split as Apple's pfl-research splits one, so that the same
code can run per contribution wherever that happens (the trusted server
today, clients under secure aggregation) and on the aggregate:

1. :func:`constrain_sensitivity`, per contribution, in float64::

       u_i = Δ_i + γ · ξ_i · (‖Δ_i‖ / ‖t_i‖) · t_i        (γ = 0 for gaussian)
       c_i = clip_C(u_i)                                  ‖c_i‖ ≤ C for any finite input

2. :class:`NoiseLattice`: c_i is rounded onto the lattice g·ℤ^d (g a power of
   two, about 2⁻⁴⁰ of the noise std) and the integers are summed exactly::

       S = Σ_i round(c_i / g)        one contribution moves g·S by ≤ C + g√d/2

3. :func:`add_noise`, on the aggregate: integer noise n_j = round(Z_j · s / g),
   Z_j ~ N(0, 1) from :mod:`fedhog.privacy.randomness`, s = σ · (C + g√d/2)::

       ū = g · (S + n) / K

The privacy guarantee is that of the Gaussian mechanism on the lattice sum:
round(S + Z·s/g) = S + round(Z·s/g) is post-processing of S + Z·s/g, whose
sensitivity (C + g√d/2)/g is covered by the noise s/g = σ × that, so the
accountant composes σ exactly. Because S is an integer vector and the noise
is an integer vector, the release carries no floating-point residue of the
data: the attack of Mironov (CCS 2012) on textbook floating-point noise reads
the low-order bits of x + noise, which here are those of a lattice point
whatever x was. Google's differential-privacy library does the same (inputs
rounded to a power-of-two granularity, noise a multiple of it). The mixing
term adds no privacy of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from scipy.special import ndtr

from .randomness import MAX_STANDARD_NORMAL, RandomBits, standard_normal

MechanismKind = Literal["none", "gaussian", "hog"]
MECHANISMS: tuple[str, ...] = ("none", "gaussian", "hog")

LATTICE_BITS = 40  # g = 2^(⌊log2(max(σ, 1)·C)⌋ − 40): ~2^7 float64 values of the noise per lattice cell
CLIP_GUARD = 1 - 2.0**-40  # clip a hair inside C, so that float64 rounding of the norm cannot exceed C
MAX_TAIL_DELTA_SHARE = 0.01  # the sampler's truncation may add at most this share of δ
MAX_CONTRIBUTIONS = 2**21  # |round(c_i / g)| ≤ 2^41 each: the int64 sum of this many cannot overflow


@dataclass(frozen=True)
class MechanismSettings:
    """What the server does with the contributions of one round.

    Parameters
    ----------
    kind : {"none", "gaussian", "hog"}
        ``none`` is plain FedAvg (no clipping, no noise), ``gaussian`` is
        DP-FedAvg, ``hog`` is the higher-order mixing followed by DP-FedAvg.
    clipping_norm : float
        C, the L2 bound on each mixed contribution.
    noise_multiplier : float
        σ; the noise added to the sum has standard deviation σ·(C + g√d/2).
    mixing_strength : float
        γ; ignored unless ``kind == "hog"``.
    """

    kind: MechanismKind
    clipping_norm: float
    noise_multiplier: float
    mixing_strength: float = 0.0

    @property
    def has_guarantee(self) -> bool:
        """Whether the release is differentially private (ε < ∞)."""
        return self.kind != "none" and self.noise_multiplier > 0.0


@dataclass(frozen=True)
class Contribution:
    """One accepted client reply, flattened to 1-D float tensors.

    ``weight`` is the client's FedAvg weight under ``none`` (its number of
    examples, or 1 where counts are not sent); DP mechanisms ignore it.
    """

    update: torch.Tensor
    weight: float = 1.0
    term: torch.Tensor | None = None


@dataclass(frozen=True)
class AggregateStats:
    """What the mechanism did in one round, for logs and results."""

    num_contributions: int
    mean_norm_before_clip: float
    fraction_clipped: float
    noise_std: float  # standard deviation of the noise on the averaged update
    mean_mixing_ratio: float  # mean ‖γ ξ (‖Δ‖/‖t‖) t‖ / ‖Δ‖ over contributions
    norms_before_clip: tuple[float, ...] = ()  # ‖u_i‖ before clipping: private, for adaptive clipping only


def norms_of(vectors: Sequence[torch.Tensor]) -> tuple[list[float], list[bool]]:
    """Each vector's L2 norm (float64, scaled: no overflow for finite entries) and whether its entries are finite.

    Stacked :func:`rows_per_pass` vectors at a time, so K checks cost a few batched passes, not K.
    """
    norms: list[float] = []
    finite: list[bool] = []
    step = rows_per_pass(vectors[0].numel()) if vectors else 1
    for start in range(0, len(vectors), step):
        rows = torch.stack(list(vectors[start:start + step])).to(torch.float64)
        row_norms, largest = _row_norms_and_largest(rows)
        norms += row_norms.tolist()
        finite += torch.isfinite(largest).tolist()  # the largest |entry| is NaN or inf iff an entry is
    return norms, finite


def rows_per_pass(numel: int) -> int:
    """How many contributions are stacked at once: about 2 MiB of float64, which stays in cache."""
    return max(1, 2**18 // max(numel, 1))


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Each row's L2 norm, scaled by its largest entry (float64 rows in, [R] out; NaN or inf for such rows)."""
    return _row_norms_and_largest(rows)[0]


def _row_norms_and_largest(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    largest = rows.abs().amax(dim=1) if rows.shape[1] else torch.zeros(len(rows), dtype=rows.dtype)
    usable = (largest > 0) & torch.isfinite(largest)
    scale = torch.where(usable, largest, torch.ones_like(largest))
    return torch.where(usable, scale * torch.linalg.vector_norm(rows / scale[:, None], dim=1), largest), largest


def _unit_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row divided by its norm (zero rows stay zero) and the norms, without overflow."""
    norms = _row_norms(rows)
    if not bool(torch.isfinite(norms).all()):
        raise ValueError("a contribution with NaN or inf entries cannot be clipped; reject it before the mechanism")
    largest = rows.abs().amax(dim=1) if rows.shape[1] else torch.zeros_like(norms)
    scale = torch.where(largest > 0, largest, torch.ones_like(largest))
    relative = torch.where(largest > 0, norms / scale, torch.ones_like(norms))  # ‖row / largest‖ ∈ [1, √d]
    return rows / scale[:, None] / relative[:, None], norms


@dataclass(frozen=True)
class RowStats:
    """What :func:`constrain_sensitivity` saw of each contribution (private: operator diagnostics)."""

    norms_before_clip: tuple[float, ...]  # ‖u_i‖ (inf if it exceeds float64; then it is clipped)
    clipped: tuple[bool, ...]  # ‖u_i‖ > C
    mixing_ratios: tuple[float, ...]  # ‖u_i − Δ_i‖ / ‖Δ_i‖ = γ|ξ_i| (0: zero term or update; NaN: no mixing)


def constrain_sensitivity(
    updates: torch.Tensor, terms: torch.Tensor | None, xis: torch.Tensor, settings: MechanismSettings
) -> tuple[torch.Tensor, RowStats]:
    """Mix (``hog``) and clip stacked contributions ``[R, P]``: return c_i = clip_C(u_i) in float64 and stats.

    u = Δ + γ·ξ·(‖Δ‖/‖t‖)·t = ‖Δ‖·w with w = Δ/‖Δ‖ + γξ·t/‖t‖, and c is u when
    ‖u‖ ≤ C, else w scaled to norm C: no intermediate exceeds ‖Δ‖ or |γξ|, so
    c is finite and ‖c‖ < C for every finite Δ and t (subnormal, huge or
    zero). The bound is applied a hair inside C (:data:`CLIP_GUARD`) so that
    rounding in the norm cannot take c past C. A zero term carries no
    direction (u = Δ); a contribution that needs no clipping and no mixing
    comes back unchanged.

    Raises
    ------
    ValueError
        If a Δ or t is not finite (replies must be checked before), or ``hog``
        gets no terms.
    """
    if settings.kind == "none":
        raise ValueError("mechanism 'none' does not constrain contributions")
    updates = updates.to(torch.float64)
    bound = settings.clipping_norm * CLIP_GUARD
    if settings.kind == "gaussian":  # no mixing: scale each row by min(1, bound/‖Δ‖) (1.0 leaves it exact)
        norms = _row_norms(updates)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("a contribution with NaN or inf entries cannot be clipped; reject it before the mechanism")
        inside = norms <= bound
        factor = torch.where(inside, torch.ones_like(norms), bound / torch.where(inside, torch.ones_like(norms), norms))
        stats = RowStats(tuple(norms.tolist()), tuple((norms > settings.clipping_norm).tolist()),
                         (math.nan,) * len(norms))
        return updates * factor[:, None], stats
    direction, update_norms = _unit_rows(updates)
    rows = len(updates)
    mixed = torch.zeros(rows, dtype=torch.bool)
    ratios = torch.full((rows,), math.nan, dtype=torch.float64)
    if settings.kind == "hog":
        if terms is None:
            raise ValueError("mechanism 'hog' needs a third-order term in every contribution")
        term_direction, term_norms = _unit_rows(terms.to(torch.float64))
        coefficients = settings.mixing_strength * xis.to(torch.float64)
        mixed = (term_norms > 0) & (update_norms > 0) & (coefficients != 0)
        ratios = torch.where(mixed, coefficients.abs(), torch.zeros_like(coefficients))
        direction = direction + torch.where(mixed, coefficients, torch.zeros_like(coefficients))[:, None] * term_direction
    relative = torch.where(mixed, _row_norms(direction), torch.ones_like(update_norms))  # ‖u‖ / ‖Δ‖
    norms_before = update_norms * relative
    inside = norms_before <= bound
    scale = torch.where(inside, update_norms, bound / torch.where(relative > 0, relative, torch.ones_like(relative)))
    out = torch.where((inside & ~mixed)[:, None], updates, direction * scale[:, None])
    stats = RowStats(tuple(norms_before.tolist()), tuple((norms_before > settings.clipping_norm).tolist()),
                     tuple(ratios.tolist()))
    return out, stats


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
    def for_settings(cls, settings: MechanismSettings, dimension: int) -> "NoiseLattice":
        """g = 2^(⌊log2(max(σ, 1)·C)⌋ − 40): fine against the noise, coarse against float64 spacing."""
        scale = settings.clipping_norm * max(settings.noise_multiplier, 1.0)
        return cls(2.0 ** (math.floor(math.log2(scale)) - LATTICE_BITS), dimension)

    @property
    def rounding_slack(self) -> float:
        """g√d/2 (g√d for stochastic rounding): how far rounding onto the lattice can move one contribution (L2)."""
        return self.granularity * math.sqrt(self.dimension) * self.rounding_steps

    def quantize(self, vector: torch.Tensor) -> torch.Tensor:
        """round(vector / g) as int64 (|entries| ≤ C/g ≤ 2^41 for a clipped contribution)."""
        return torch.round(vector.to(torch.float64) / self.granularity).to(torch.int64)

    def sum_std(self, settings: MechanismSettings) -> float:
        """s = σ·(C + g√d/2): the noise std on the sum, calibrated to its sensitivity."""
        return settings.noise_multiplier * (settings.clipping_norm + self.rounding_slack)


def add_noise(
    lattice_sum: torch.Tensor, settings: MechanismSettings, lattice: NoiseLattice, bits: RandomBits
) -> tuple[torch.Tensor, float]:
    """g·(S + n), n_j = round(Z_j·s/g), in float64; and s, the noise std on the sum.

    ``lattice_sum`` is S (int64). The noise is drawn even for an empty round:
    then the noise alone is released.
    """
    std = lattice.sum_std(settings)
    if std == 0.0:
        return lattice_sum.to(torch.float64) * lattice.granularity, 0.0
    steps = rounded_gaussian(bits, lattice.dimension, std, lattice.granularity)
    return (lattice_sum + steps).to(torch.float64).mul_(lattice.granularity), std


def rounded_gaussian(bits: RandomBits, count: int, std: float, granularity: float) -> torch.Tensor:
    """round(Z·std/g) for ``count`` independent Z ~ N(0, 1): Gaussian noise in lattice steps (int64)."""
    return torch.from_numpy(standard_normal(bits, count)).mul_(std / granularity).round_().to(torch.int64)


def noise_tail_delta(accountant_noise_multiplier: float, dimension: int, releases: int = 1) -> float:
    """A bound on the δ that ``releases`` releases add because the normals stop at :data:`MAX_STANDARD_NORMAL`.

    The noise is a Gaussian truncated at R = 13.37 standard deviations. A
    neighbour shifts each coordinate by at most 1/σ standard deviations (σ the
    accountant's multiplier, sensitivity-normalised), so the outputs one
    dataset can produce and the other cannot have probability at most
    2·d·Φ(−(R − 1/σ)) per release; elsewhere the privacy loss is the Gaussian's.
    Runs refuse a σ for which this exceeds :data:`MAX_TAIL_DELTA_SHARE` of δ.
    """
    if accountant_noise_multiplier <= 0:
        return 1.0
    per_release = 2 * dimension * float(ndtr(-(MAX_STANDARD_NORMAL - 1 / accountant_noise_multiplier)))
    return min(1.0, releases * per_release)


def aggregate(
    contributions: list[Contribution],
    settings: MechanismSettings,
    expected_cohort: float,
    xis: list[float],
    bits: RandomBits,
    numel: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, AggregateStats]:
    """The trusted server's round: constrain every contribution, sum on the lattice, add noise, divide by K.

    Parameters
    ----------
    contributions : list[Contribution]
        Accepted replies; may be empty (then a DP mechanism releases pure noise).
    settings : MechanismSettings
        The mechanism to apply.
    expected_cohort : float
        K, the fixed denominator of DP-FedAvg (q·N for Poisson sampling, the
        cohort size for fixed-size sampling). Unused for ``none``.
    xis : list[float]
        ξ_i ~ N(0, 1), one per contribution, drawn by the server.
    bits : RandomBits
        The round's noise stream.
    numel, dtype
        Size and dtype of the flat model vector.
    """
    if settings.kind == "none":
        return _federated_average(contributions, numel, dtype)
    if len(xis) != len(contributions):
        raise ValueError(f"need one ξ per contribution, got {len(xis)} for {len(contributions)}")
    if len(contributions) > MAX_CONTRIBUTIONS:
        raise ValueError(f"{len(contributions)} contributions exceed the {MAX_CONTRIBUTIONS} the int64 sum holds")
    lattice = NoiseLattice.for_settings(settings, numel)
    total = torch.zeros(numel, dtype=torch.int64)
    norms, clipped, ratios = [], [], []
    step = rows_per_pass(numel)
    for start in range(0, len(contributions), step):
        chunk = contributions[start:start + step]
        terms = None if settings.kind != "hog" else _stack([c.term for c in chunk], "third-order term")
        rows, stats = constrain_sensitivity(torch.stack([c.update for c in chunk]), terms,
                                            torch.tensor(xis[start:start + step], dtype=torch.float64), settings)
        total += lattice.quantize(rows).sum(dim=0)
        norms += stats.norms_before_clip
        clipped += stats.clipped
        ratios += [r for r in stats.mixing_ratios if not math.isnan(r)]
    noisy_sum, sum_std = add_noise(total, settings, lattice, bits)
    stats = AggregateStats(
        num_contributions=len(contributions),
        mean_norm_before_clip=_mean(norms),
        fraction_clipped=_mean([float(c) for c in clipped]),
        noise_std=sum_std / expected_cohort,
        mean_mixing_ratio=_mean(ratios),
        norms_before_clip=tuple(norms),
    )
    return (noisy_sum / expected_cohort).to(dtype), stats


def _federated_average(
    contributions: list[Contribution], numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor, AggregateStats]:
    """Weighted mean of the updates (FedAvg), no privacy."""
    total = torch.zeros(numel, dtype=torch.float64)
    weight = sum(c.weight for c in contributions)
    norms: list[float] = []
    step = rows_per_pass(numel)
    for start in range(0, len(contributions), step):
        chunk = contributions[start:start + step]
        rows = torch.stack([c.update for c in chunk]).to(torch.float64)
        total += (rows * torch.tensor([float(c.weight) for c in chunk], dtype=torch.float64)[:, None]).sum(dim=0)
        norms += _row_norms(rows).tolist()
    stats = AggregateStats(len(contributions), _mean(norms), 0.0, 0.0, math.nan)
    return (total / weight if weight > 0 else total).to(dtype), stats


def _stack(tensors: list[torch.Tensor | None], what: str) -> torch.Tensor:
    if any(t is None for t in tensors):
        raise ValueError(f"mechanism 'hog' needs a {what} in every contribution")
    return torch.stack(tensors)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
