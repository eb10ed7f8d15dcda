"""The mechanisms a round can apply: FedAvg, DP-FedAvg, the higher-order mixing, distributed noise.

Vocabulary (one name per concept, as in the README): update Δ_i, third-order
term t_i, mixing strength γ, clipping norm C, noise multiplier σ, expected
cohort size K, model dimension d.

Each mechanism is a small object, split as Apple's pfl-research splits one
(``CentrallyApplicablePrivacyMechanism``), so that the same code runs per
contribution wherever that happens (the trusted server, or each client under
secure aggregation) and on the aggregate. :data:`MECHANISM_REGISTRY` maps the
config's ``mechanism`` names to :class:`NoPrivacy` (``none``, FedAvg),
:class:`GaussianMechanism` (``gaussian``, DP-FedAvg) and :class:`HogMechanism`
(``hog``); :class:`~fedhog.secure_aggregation.distributed_noise.DistributedGaussian`
wraps one of the last two when the clients add the noise (``noise =
"distributed"``). What every DP mechanism does:

1. :meth:`Mechanism.constrain_sensitivity`, per contribution, in float64::

       u_i = Δ_i + γ · ξ_i · (‖Δ_i‖ / ‖t_i‖) · t_i        (γ = 0 for gaussian; hog's random-sign mixing)
       u_i = Δ_i − ½ κ τ² · t_i                           (hog's noise-aware mixing, :mod:`.noise_aware`)
       c_i = clip_C(u_i)                                  ‖c_i‖ ≤ C for any finite input

2. :class:`~fedhog.privacy.lattice.NoiseLattice`: c_i is rounded onto the lattice g·ℤ^d (g a power of
   two, about 2⁻⁴⁰ of the noise std) and the integers are summed exactly::

       S = Σ_i round(c_i / g)        one contribution moves g·S by ≤ C + g√d/2

3. :meth:`Mechanism.add_noise`, on the aggregate: integer noise n ~ N_ℤ(0, (s/g)²)^d,
   the discrete Gaussian drawn exactly on the lattice
   (:func:`fedhog.privacy.randomness.discrete_gaussian`), s = σ · (C + g√d/2)::

       ū = g · (S + n) / K

4. :meth:`Mechanism.accountant`: what composes the releases (the sampled
   Gaussian mechanism's event, or the distributed discrete Gaussian's).

Why the accountant's σ covers this release. The neighbour's lattice sum S′
differs from S by one rounded contribution, ‖round(c/g)‖ ≤ C/g + √d/2 = s/(gσ)
(add/remove; twice that for replace-one, which the accountant composes as σ/2).
Shifting N_ℤ(0, σ_ℤ²) by an integer vector changes its pmf exactly as it changes
the continuous density: the privacy loss at every output is the Gaussian
mechanism's. The accountants (PLD, RDP) assume the continuous Gaussian; the
discrete one is, coordinate by coordinate within 20 σ_ℤ of its mean, within a
factor exp(±17/σ_ℤ²) of the *rounded* continuous Gaussian round(N(0, σ_ℤ²)),
which is post-processing of the continuous Gaussian mechanism and so has at
most its (ε, δ). fedhog's sampler draws N_ℤ(0, σ_ℤ²) up to a factor exp(±η)
per value (float64 probabilities, each Bernoulli exact for its float:
:func:`~fedhog.privacy.randomness.sampler_log_ratio_bound`, η ≈ 2.7·10⁻¹³).
:func:`~fedhog.privacy.sampler_slack.sampler_slack` turns these per-coordinate factors into what a run adds
to ε (2·T·d·(η + 17/σ_ℤ²), at most 3·10⁻⁴ for 5M parameters over 100 rounds) and
to δ (the mass beyond 20 σ_ℤ); the accountant adds them to what it reports.

Because S and n are integer vectors, the release carries no floating-point
residue of the data (the attack of Mironov, CCS 2012, reads the low-order
bits of x + noise; here they are those of a lattice point whatever x was),
and because n is drawn on the lattice with every integer possible, it has no
holes: a float normal rounded onto a lattice finer than its resolution
leaves lattice points it can never produce, and the outputs a neighbour can
reach but the dataset cannot then carry an infinite privacy loss. Google's
differential-privacy library likewise draws its lattice noise with an exact
integer sampler. The mixing term adds no privacy of its own.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from .lattice import MAX_CONTRIBUTIONS, NoiseLattice
from .noise_aware import NoiseAwareMixing
from .randomness import RandomBits, lattice_gaussian, standard_normal

if TYPE_CHECKING:
    from .accounting import Accountant
    from .sampling import SamplingKind

CLIP_GUARD = 1 - 2.0**-40  # clip a hair inside C, so that float64 rounding of the norm cannot exceed C


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
    """Each vector's L2 norm (float64, no overflow for finite entries) and whether its entries are finite.

    Stacked :func:`rows_per_pass` vectors at a time, so K checks cost a few batched passes, not K.
    """
    norms: list[float] = []
    finite: list[bool] = []
    step = rows_per_pass(vectors[0].numel()) if vectors else 1
    for start in range(0, len(vectors), step):
        rows = torch.stack(list(vectors[start:start + step])).to(torch.float64)
        row_norms = _row_norms(rows)
        entries_finite = torch.isfinite(row_norms)  # a NaN or inf entry makes the norm NaN or inf
        if not bool(entries_finite.all()):  # or a norm past float64's range: then the entries may be finite
            entries_finite[~entries_finite] = torch.isfinite(_largest(rows[~entries_finite]))
        norms += row_norms.tolist()
        finite += entries_finite.tolist()
    return norms, finite


def rows_per_pass(numel: int) -> int:
    """How many contributions are stacked at once: about 2 MiB of float64, which stays in cache."""
    return max(1, 2**18 // max(numel, 1))


DIRECT_NORM_FLOOR = 2.0**-300
"""A float64 row whose norm, summed directly, comes out finite and at least this is done: a square that overflowed
would have made it inf, and the squares lost to underflow (each under 2⁻¹⁰⁷⁴) move its square (≥ 2⁻⁶⁰⁰) by less
than d·2⁻⁴⁷⁴ relatively. The other rows (zero, tiny, huge, NaN or inf entries) are summed again scaled by their
largest |entry| (:func:`_scaled_rows`). Every finite float32 row but a zero one is done in one pass (its
nonzero entries are at least 2⁻¹⁴⁹ and their squares at most 2²⁵⁶)."""


def _needs_scaling(norms: torch.Tensor) -> torch.Tensor:
    """The rows whose directly summed ``norms`` :data:`DIRECT_NORM_FLOOR` does not vouch for (NaN included)."""
    return ~(norms >= DIRECT_NORM_FLOOR) | torch.isinf(norms)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Each row's L2 norm without overflow (float64 rows in, [R] out; NaN or inf for such rows)."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    redo = _needs_scaling(norms)
    if bool(redo.any()):
        norms[redo] = _scaled_rows(rows[redo])[0]
    return norms


def _largest(rows: torch.Tensor) -> torch.Tensor:
    """Each row's largest |entry| (NaN or inf for a row with such entries; 0 for rows of no entries)."""
    return rows.abs().amax(dim=1) if rows.shape[1] else torch.zeros(len(rows), dtype=rows.dtype)


def _scaled_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's norm summed scaled by its largest |entry| (no square overflows or vanishes), that largest
    |entry|, and the row divided by it (by 1 where it is 0, NaN or inf)."""
    largest = _largest(rows)
    usable = (largest > 0) & torch.isfinite(largest)
    scale = torch.where(usable, largest, torch.ones_like(largest))
    scaled = rows / scale[:, None]
    return torch.where(usable, scale * torch.linalg.vector_norm(scaled, dim=1), largest), largest, scaled


def _unit_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row divided by its norm (zero rows stay zero) and the norms, without overflow."""
    norms = torch.linalg.vector_norm(rows, dim=1)
    redo = _needs_scaling(norms)
    unit = rows / torch.where(redo, torch.ones_like(norms), norms)[:, None]
    if bool(redo.any()):
        redo_norms, largest, scaled = _scaled_rows(rows[redo])
        if not bool(torch.isfinite(redo_norms).all()):
            raise ValueError("a contribution with NaN or inf entries cannot be clipped; reject it before the "
                             "mechanism")
        scale = torch.where(largest > 0, largest, torch.ones_like(largest))
        relative = torch.where(largest > 0, redo_norms / scale, torch.ones_like(redo_norms))  # ‖row/largest‖ ∈ [1, √d]
        unit[redo] = scaled / relative[:, None]
        norms[redo] = redo_norms
    return unit, norms


@dataclass(frozen=True)
class RowStats:
    """What :meth:`Mechanism.constrain_sensitivity` saw of each contribution (private: operator diagnostics)."""

    norms_before_clip: tuple[float, ...]  # ‖u_i‖ (inf if it exceeds float64; then it is clipped)
    clipped: tuple[bool, ...]  # ‖u_i‖ > C
    mixing_ratios: tuple[float, ...]  # ‖u_i − Δ_i‖ / ‖Δ_i‖: γ|ξ_i| or ½κτ²‖t_i‖/‖Δ_i‖ (0: no term; NaN: no mixing)


class Mechanism(ABC):
    """What a round does with its contributions: per contribution, on the sum, and how its releases are accounted.

    The strategy, the ClientApp, the engines and the audit ask the mechanism
    (:attr:`wants_term`, :meth:`constrain_sensitivity`, :meth:`add_noise`, ...)
    and never which one it is. Mechanisms are immutable: adaptive clipping runs
    a round with :meth:`with_clipping`. Each mechanism class sets :attr:`name`
    and :attr:`wants_term` as class constants (:data:`MECHANISM_REGISTRY` reads them).
    """

    #: Bounds each contribution (a sensitivity): it can be noised and summed under secure aggregation, and a round
    #: with no accepted contribution still releases (the noise alone: withholding it would tell who replied).
    clips: ClassVar[bool] = True
    clipping_norm: float  # C
    noise_multiplier: float  # σ

    @property
    @abstractmethod
    def name(self) -> str:
        """The config's ``mechanism`` value."""

    @property
    @abstractmethod
    def wants_term(self) -> bool:
        """Whether each client also sends its third-order term t_i."""

    @property
    def has_guarantee(self) -> bool:
        """Whether the release is differentially private (ε < ∞)."""
        return self.noise_multiplier > 0.0

    @abstractmethod
    def with_clipping(self, clipping_norm: float, noise_multiplier: float) -> Mechanism:
        """This mechanism with clipping norm C = ``clipping_norm`` and σ = ``noise_multiplier``, all else the same
        (adaptive clipping's round)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the run's log: what each contribution goes through, and the noise."""

    @abstractmethod
    def constrain_sensitivity(self, updates: torch.Tensor, terms: torch.Tensor | None,
                              xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """Stacked contributions ``[R, P]`` (their terms, their ξ_i) -> c_i in float64, ‖c_i‖ ≤ C, and what was seen.

        Raises
        ------
        ValueError
            If a Δ or t is not finite (replies must be checked before), a term
            is missing where the mechanism needs one, or the mechanism bounds nothing.
        """

    def xis(self, stream: RandomBits, population: int, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """ξ_i (float64) of the contributions of ``slots``: 0 here (no mixing); nothing is drawn from ``stream``."""
        return np.zeros(len(slots))

    @abstractmethod
    def add_noise(self, lattice_sum: torch.Tensor, lattice: NoiseLattice, bits: RandomBits,
                  contributors: int) -> tuple[torch.Tensor, float]:
        """The released sum g·(S + n) in float64 for the int64 lattice sum S of ``contributors`` contributions, and
        the std of its noise. The noise is drawn even for an empty round: then the noise alone is released."""

    def noise_share(self, levels: np.ndarray, bits: RandomBits) -> np.ndarray:
        """A client's quantised contribution as it enters the secure sum: unchanged (the server adds the noise)."""
        return levels

    def aggregate(self, contributions: list[Contribution], expected_cohort: float, xis: Sequence[float] | np.ndarray,
                  bits: RandomBits, numel: int,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, AggregateStats]:
        """The trusted server's round: constrain every contribution, sum on the lattice, add noise, divide by K.

        Parameters
        ----------
        contributions : list[Contribution]
            Accepted replies; may be empty (then the noise alone is released).
        expected_cohort : float
            K, the fixed denominator of DP-FedAvg (q·N for Poisson sampling, the
            cohort size for fixed-size sampling).
        xis : sequence of float
            ξ_i ~ N(0, 1), one per contribution, drawn by the server (:meth:`xis`).
        bits : RandomBits
            The round's noise stream.
        numel, dtype
            Size and dtype of the flat model vector.
        """
        if len(xis) != len(contributions):
            raise ValueError(f"need one ξ per contribution, got {len(xis)} for {len(contributions)}")
        if len(contributions) > MAX_CONTRIBUTIONS:
            raise ValueError(f"{len(contributions)} contributions exceed the {MAX_CONTRIBUTIONS} the int64 sum holds")
        lattice = NoiseLattice.for_settings(self, numel)
        total, seen = self.sum_on_lattice(contributions, xis, lattice)
        noisy_sum, sum_std = self.add_noise(total, lattice, bits, len(contributions))
        stats = AggregateStats(
            num_contributions=len(contributions),
            mean_norm_before_clip=_mean(list(seen.norms_before_clip)),
            fraction_clipped=_mean([float(c) for c in seen.clipped]),
            noise_std=sum_std / expected_cohort,
            mean_mixing_ratio=_mean([r for r in seen.mixing_ratios if not math.isnan(r)]),
            norms_before_clip=seen.norms_before_clip,
        )
        return (noisy_sum / expected_cohort).to(dtype), stats

    def sum_on_lattice(self, contributions: Sequence[Contribution], xis: Sequence[float] | np.ndarray,
                       lattice: NoiseLattice) -> tuple[torch.Tensor, RowStats]:
        """Every contribution constrained (:meth:`constrain_sensitivity`, with its ξ), rounded onto ``lattice`` and
        summed, a few rows at a time: the exact int64 sum and what constraining saw of each, in order."""
        device = contributions[0].update.device if contributions else None  # the sum stays where they are
        total = torch.zeros(lattice.dimension, dtype=torch.int64, device=device)
        every_xi = torch.tensor(np.asarray(xis, dtype=np.float64), device=device)
        norms: list[float] = []
        clipped: list[bool] = []
        ratios: list[float] = []
        step = rows_per_pass(lattice.dimension)
        for start in range(0, len(contributions), step):
            chunk = contributions[start:start + step]
            terms = stack_terms(chunk) if self.wants_term else None
            rows, seen = self.constrain_sensitivity(torch.stack([c.update for c in chunk]), terms,
                                                    every_xi[start:start + step])
            total += lattice.quantize(rows).sum(dim=0)
            norms += seen.norms_before_clip
            clipped += seen.clipped
            ratios += seen.mixing_ratios
        return total, RowStats(tuple(norms), tuple(clipped), tuple(ratios))

    def accountant(self, sampling: SamplingKind, sampling_rate: float, population: int, delta: float,
                   method: str) -> Accountant:
        """A fresh accountant of this mechanism's releases: the sampled Gaussian mechanism's event each round,
        composed with ``method`` (``pld`` or ``rdp``; ε = ∞ without a guarantee)."""
        from .accounting import ClientLevelAccountant  # Flower's accountants: servers only

        return ClientLevelAccountant(self.noise_multiplier, sampling, sampling_rate, population, delta,
                                     has_guarantee=self.has_guarantee, accountant=method)

@dataclass(frozen=True)
class NoPrivacy(Mechanism):
    """``none``: plain FedAvg, the example-weighted mean of the updates; no clipping, no noise (ε = ∞).

    C and σ are kept only to be reported.
    """

    clipping_norm: float
    noise_multiplier: float = 0.0
    name: ClassVar[str] = "none"
    wants_term: ClassVar[bool] = False
    clips: ClassVar[bool] = False

    @property
    def has_guarantee(self) -> bool:
        """Never: nothing bounds a contribution."""
        return False

    def describe(self) -> str:
        """FedAvg, without privacy."""
        return "none: FedAvg (example-weighted mean), no clipping, no noise: ε = ∞"

    def with_clipping(self, clipping_norm: float, noise_multiplier: float) -> NoPrivacy:
        """The same FedAvg, reporting these C and σ."""
        return replace(self, clipping_norm=clipping_norm, noise_multiplier=noise_multiplier)

    def constrain_sensitivity(self, updates: torch.Tensor, terms: torch.Tensor | None,
                              xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """Refused: FedAvg bounds nothing."""
        raise ValueError("mechanism 'none' does not constrain contributions")

    def add_noise(self, lattice_sum: torch.Tensor, lattice: NoiseLattice, bits: RandomBits,
                  contributors: int) -> tuple[torch.Tensor, float]:
        """Refused: FedAvg adds no noise."""
        raise ValueError("mechanism 'none' adds no noise")

    def aggregate(self, contributions: list[Contribution], expected_cohort: float, xis: Sequence[float] | np.ndarray,
                  bits: RandomBits, numel: int,
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, AggregateStats]:
        """Weighted mean of the updates (FedAvg); ``expected_cohort``, ``xis`` and ``bits`` are unused."""
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


@dataclass(frozen=True)
class GaussianMechanism(Mechanism):
    """``gaussian``: DP-FedAvg. Clip each update to C, sum on the lattice, add N_ℤ(0, (s/g)²)^d on the server."""

    clipping_norm: float
    noise_multiplier: float = 0.0
    name: ClassVar[str] = "gaussian"
    wants_term: ClassVar[bool] = False

    def describe(self) -> str:
        """Clipping and the server's lattice noise."""
        return (f"gaussian: clip each update to C={self.clipping_norm:g}, the server adds discrete Gaussian noise "
                f"σ={self.noise_multiplier:g} to the lattice sum")

    def with_clipping(self, clipping_norm: float, noise_multiplier: float) -> GaussianMechanism:
        """This mechanism (its class and γ too) with another C and σ."""
        return replace(self, clipping_norm=clipping_norm, noise_multiplier=noise_multiplier)

    def constrain_sensitivity(self, updates: torch.Tensor, terms: torch.Tensor | None,
                              xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """c_i = Δ_i · min(1, C′/‖Δ_i‖) with C′ a hair inside C (:data:`CLIP_GUARD`); a row within C comes back
        exact. ``terms`` and ``xis`` are unused."""
        updates = updates.to(torch.float64)
        bound = self.clipping_norm * CLIP_GUARD
        norms = _row_norms(updates)
        if not bool(torch.isfinite(norms).all()):
            raise ValueError("a contribution with NaN or inf entries cannot be clipped; reject it before the mechanism")
        inside = norms <= bound
        factor = torch.where(inside, torch.ones_like(norms), bound / torch.where(inside, torch.ones_like(norms), norms))
        stats = RowStats(tuple(norms.tolist()), tuple((norms > self.clipping_norm).tolist()),
                         (math.nan,) * len(norms))
        return updates * factor[:, None], stats

    def add_noise(self, lattice_sum: torch.Tensor, lattice: NoiseLattice, bits: RandomBits,
                  contributors: int) -> tuple[torch.Tensor, float]:
        """g·(S + n), n ~ N_ℤ(0, (s/g)²)^d, in float64; and s = σ·(C + rounding slack), the noise std on the sum."""
        std = lattice.sum_std(self)
        if std == 0.0:
            return lattice_sum.to(torch.float64) * lattice.granularity, 0.0
        steps = torch.from_numpy(lattice_gaussian(bits, lattice.dimension, std / lattice.granularity))
        steps = steps.to(lattice_sum.device)  # drawn on the CPU from the private stream, whatever the device
        return (lattice_sum + steps).to(torch.float64).mul_(lattice.granularity), std


@dataclass(frozen=True)
class HogMechanism(GaussianMechanism):
    """``hog``: mix each update with its client's third-order term, then DP-FedAvg (:class:`GaussianMechanism`).

    Random-sign mixing (``noise_aware`` None, ``hog-mixing = "random-sign"``) adds γ·ξ_i·(‖Δ_i‖/‖t_i‖)·t_i with
    the server's ξ_i ~ N(0, 1); noise-aware mixing (:mod:`.noise_aware`) subtracts ½κτ²·t_i, where each client's
    t_i = λ_i ĝ_i is its scaled estimate of ∇ tr ∇²L and τ follows from this mechanism's σ and C.
    """

    mixing_strength: float = 0.0  # γ
    noise_aware: NoiseAwareMixing | None = None
    name: ClassVar[str] = "hog"
    wants_term: ClassVar[bool] = True

    def describe(self) -> str:
        """The mixing, then DP-FedAvg."""
        if self.noise_aware is not None:
            tau = self.noise_aware.noise_std(self.noise_multiplier, self.clipping_norm)
            mixing = (f"hog: subtract ½κτ² × each client's scaled ∇tr∇²L estimate (noise-aware, "
                      f"κ={self.noise_aware.strength:g}, τ={tau:.3g})")
        else:
            mixing = f"hog: mix each update with its third-order term (random-sign, γ={self.mixing_strength:g})"
        return (f"{mixing}, clip to C={self.clipping_norm:g}, the server adds discrete Gaussian noise "
                f"σ={self.noise_multiplier:g} to the lattice sum")

    def xis(self, stream: RandomBits, population: int, slots: Sequence[int] | np.ndarray) -> np.ndarray:
        """ξ ~ N(0, 1) for each slot of the population from ``stream``, so that a client's ξ does not depend on who
        else replied; those of ``slots``. Noise-aware mixing has no ξ: zeros, nothing drawn."""
        if self.noise_aware is not None:
            return np.zeros(len(slots))
        return standard_normal(stream, population)[np.asarray(slots, dtype=np.int64)]

    def constrain_sensitivity(self, updates: torch.Tensor, terms: torch.Tensor | None,
                              xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """Mix and clip: u = Δ + γ·ξ·(‖Δ‖/‖t‖)·t (random-sign) or u = Δ − ½κτ²·t (noise-aware), c = clip_C(u).

        Random-sign: u = ‖Δ‖·w with w = Δ/‖Δ‖ + γξ·t/‖t‖, and c is u when ‖u‖ ≤ C, else w
        scaled to norm C: no intermediate exceeds ‖Δ‖ or |γξ|, so c is finite
        and ‖c‖ < C for every finite Δ and t (subnormal, huge or zero). The
        bound is applied a hair inside C (:data:`CLIP_GUARD`) so that rounding
        in the norm cannot take c past C. A zero term carries no direction
        (u = Δ); a contribution that needs no clipping and no mixing comes back
        unchanged. Noise-aware: :meth:`_noise_aware_rows`.
        """
        if terms is None:
            raise ValueError("mechanism 'hog' needs a third-order term in every contribution")
        if self.noise_aware is not None:
            return self._noise_aware_rows(updates.to(torch.float64), terms.to(torch.float64), xis)
        updates = updates.to(torch.float64)
        bound = self.clipping_norm * CLIP_GUARD
        direction, update_norms = _unit_rows(updates)
        term_direction, term_norms = _unit_rows(terms.to(torch.float64))
        coefficients = self.mixing_strength * xis.to(torch.float64)
        mixed = (term_norms > 0) & (update_norms > 0) & (coefficients != 0)
        ratios = torch.where(mixed, coefficients.abs(), torch.zeros_like(coefficients))
        mixing = torch.where(mixed, coefficients, torch.zeros_like(coefficients))
        direction = direction + mixing[:, None] * term_direction
        relative = torch.where(mixed, _row_norms(direction), torch.ones_like(update_norms))  # ‖u‖ / ‖Δ‖
        norms_before = update_norms * relative
        inside = norms_before <= bound
        scale = torch.where(inside, update_norms,
                            bound / torch.where(relative > 0, relative, torch.ones_like(relative)))
        out = torch.where((inside & ~mixed)[:, None], updates, direction * scale[:, None])
        stats = RowStats(tuple(norms_before.tolist()), tuple((norms_before > self.clipping_norm).tolist()),
                         tuple(ratios.tolist()))
        return out, stats

    def _noise_aware_rows(self, updates: torch.Tensor, terms: torch.Tensor,
                          xis: torch.Tensor) -> tuple[torch.Tensor, RowStats]:
        """u = Δ − ½κτ²·t in float64, clipped as :class:`GaussianMechanism` clips (κ = 0 or t = 0: its bits).

        A row whose u overflows float64 (finite Δ and t, a huge product) is rebuilt from unit rows,
        u/m = (‖Δ‖/m)·Δ/‖Δ‖ − (½κτ²‖t‖/m)·t/‖t‖ with m the larger of the two lengths, and clipped to C along it.
        """
        assert self.noise_aware is not None  # the caller's branch
        coefficient = self.noise_aware.coefficient(self.noise_multiplier, self.clipping_norm)
        term_norms = _row_norms(terms)
        update_norms = _row_norms(updates)
        mixed = updates - coefficient * terms
        overflowed = ~torch.isfinite(mixed).all(dim=1)
        if bool(overflowed.any()):
            direction, lengths = _unit_rows(updates[overflowed])
            term_direction, term_lengths = _unit_rows(terms[overflowed])
            term_lengths = coefficient * term_lengths
            largest = torch.maximum(lengths, term_lengths)
            finite_largest = torch.where(torch.isfinite(largest), largest, torch.ones_like(largest))
            part = torch.where(torch.isfinite(term_lengths), term_lengths / finite_largest, torch.ones_like(largest))
            own = torch.where(torch.isfinite(term_lengths), lengths / finite_largest, torch.zeros_like(largest))
            rebuilt = own[:, None] * direction - part[:, None] * term_direction
            mixed[overflowed] = rebuilt * (1.0 / _row_norms(rebuilt))[:, None] * (2 * self.clipping_norm)
        out, seen = GaussianMechanism.constrain_sensitivity(self, mixed, None, xis)
        norms = torch.tensor(seen.norms_before_clip, dtype=torch.float64)
        norms[overflowed] = math.inf
        ratios = (coefficient * term_norms / update_norms).tolist()  # ‖u − Δ‖/‖Δ‖
        ratios = [math.nan if u == 0 else r for r, u in zip(ratios, update_norms.tolist(), strict=True)]
        return out, RowStats(tuple(norms.tolist()), tuple((norms > self.clipping_norm).tolist()), tuple(ratios))


#: The config's ``mechanism`` names (:data:`fedhog.choices.MECHANISMS`) -> their classes.
MECHANISM_REGISTRY: dict[str, type[NoPrivacy | GaussianMechanism]] = {
    NoPrivacy.name: NoPrivacy, GaussianMechanism.name: GaussianMechanism, HogMechanism.name: HogMechanism}


def build_mechanism(name: str, clipping_norm: float, noise_multiplier: float = 0.0,
                    mixing_strength: float = 0.0, noise_aware: NoiseAwareMixing | None = None) -> Mechanism:
    """The mechanism called ``name`` (a key of :data:`MECHANISM_REGISTRY`); γ and ``noise_aware`` (noise-aware
    mixing instead of random-sign) are used by ``hog`` only.

    Raises
    ------
    ValueError
        If there is no mechanism of that name.
    """
    if name not in MECHANISM_REGISTRY:
        raise ValueError(f"mechanism={name!r} must be one of {tuple(MECHANISM_REGISTRY)}")
    if MECHANISM_REGISTRY[name].wants_term:
        return HogMechanism(clipping_norm, noise_multiplier, mixing_strength, noise_aware)
    return MECHANISM_REGISTRY[name](clipping_norm, noise_multiplier)


def stack_terms(contributions: Sequence[Contribution]) -> torch.Tensor:
    """The contributions' third-order terms as rows ``[R, P]``; ValueError if one has none."""
    terms = [c.term for c in contributions if c.term is not None]
    if len(terms) != len(contributions):
        raise ValueError("mechanism 'hog' needs a third-order term in every contribution")
    return torch.stack(terms)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
