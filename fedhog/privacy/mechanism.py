"""The higher-order mixing and the Gaussian mechanism on clipped contributions.

Vocabulary (one name per concept, as in the README):
update Δ_i, third-order term t_i, mixing strength γ, clipping norm C,
noise multiplier σ, expected cohort size K.

For ``hog`` and ``gaussian`` the released aggregate is::

    u_i  = Δ_i + γ · ξ_i · (‖Δ_i‖ / ‖t_i‖) · t_i        (γ = 0 for gaussian)
    ū    = (Σ_i clip_C(u_i) + N(0, σ² C² I)) / K

The privacy guarantee is that of the Gaussian mechanism on the clipped sum:
clipping bounds every client's contribution to C whatever u_i holds, and the
noise is calibrated to that bound. The mixing term adds no privacy of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

MechanismKind = Literal["none", "gaussian", "hog"]
MECHANISMS: tuple[str, ...] = ("none", "gaussian", "hog")


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
        σ; the noise added to the sum has standard deviation σ·C.
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
    """One accepted client reply, flattened to 1-D float tensors."""

    update: torch.Tensor
    num_examples: int
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


def mix_third_order(
    update: torch.Tensor, term: torch.Tensor, mixing_strength: float, xi: float
) -> torch.Tensor:
    """Return u = Δ + γ · ξ · (‖Δ‖ / ‖t‖) · t.

    A zero term (‖t‖ = 0) carries no direction, so u = Δ.
    """
    term_norm = torch.linalg.vector_norm(term)
    if term_norm == 0:
        return update.clone()
    scale = mixing_strength * xi * torch.linalg.vector_norm(update) / term_norm
    return update + scale * term


def clip_to_norm(vector: torch.Tensor, clipping_norm: float) -> tuple[torch.Tensor, float]:
    """Scale ``vector`` down to L2 norm at most C; return it and its norm before."""
    norm = float(torch.linalg.vector_norm(vector))
    if norm <= clipping_norm:
        return vector.clone(), norm
    return vector * (clipping_norm / norm), norm


def gaussian_noise(
    numel: int, std: float, generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """Draw N(0, std² I) of length ``numel`` from a dedicated generator."""
    noise = torch.randn(numel, generator=generator, dtype=torch.float64)
    return (noise * std).to(dtype)


def aggregate(
    contributions: list[Contribution],
    settings: MechanismSettings,
    expected_cohort: float,
    xis: list[float],
    generator: torch.Generator,
    numel: int,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, AggregateStats]:
    """Aggregate one round's contributions into the averaged update.

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
    generator : torch.Generator
        The dedicated source of the Gaussian noise.
    numel, dtype
        Size and dtype of the flat model vector.
    """
    if settings.kind == "none":
        return _federated_average(contributions, numel, dtype)
    if len(xis) != len(contributions):
        raise ValueError(f"need one ξ per contribution, got {len(xis)} for {len(contributions)}")
    total = torch.zeros(numel, dtype=torch.float64)
    norms, ratios = [], []
    for contribution, xi in zip(contributions, xis):
        mixed = contribution.update
        if settings.kind == "hog":
            if contribution.term is None:
                raise ValueError("mechanism 'hog' needs a third-order term in every contribution")
            mixed = mix_third_order(contribution.update, contribution.term, settings.mixing_strength, xi)
            update_norm = float(torch.linalg.vector_norm(contribution.update))
            if update_norm > 0:
                ratios.append(float(torch.linalg.vector_norm(mixed - contribution.update)) / update_norm)
        clipped, norm = clip_to_norm(mixed, settings.clipping_norm)
        norms.append(norm)
        total += clipped.to(torch.float64)
    sum_std = settings.noise_multiplier * settings.clipping_norm
    if sum_std > 0:
        total += gaussian_noise(numel, sum_std, generator, torch.float64)
    stats = AggregateStats(
        num_contributions=len(contributions),
        mean_norm_before_clip=_mean(norms),
        fraction_clipped=_mean([float(n > settings.clipping_norm) for n in norms]),
        noise_std=sum_std / expected_cohort,
        mean_mixing_ratio=_mean(ratios),
        norms_before_clip=tuple(norms),
    )
    return (total / expected_cohort).to(dtype), stats


def _federated_average(
    contributions: list[Contribution], numel: int, dtype: torch.dtype
) -> tuple[torch.Tensor, AggregateStats]:
    """Example-weighted mean of the updates (FedAvg), no privacy."""
    total = torch.zeros(numel, dtype=torch.float64)
    weight = sum(c.num_examples for c in contributions)
    for contribution in contributions:
        total += contribution.update.to(torch.float64) * contribution.num_examples
    norms = [float(torch.linalg.vector_norm(c.update)) for c in contributions]
    stats = AggregateStats(len(contributions), _mean(norms), 0.0, 0.0, math.nan)
    return (total / weight if weight > 0 else total).to(dtype), stats


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
