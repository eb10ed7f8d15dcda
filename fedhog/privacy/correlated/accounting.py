"""Amplified BandMF: the privacy event of b-banded correlated noise with b participation groups.

The scheme (Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023, Algorithm 2 and Theorem 4): the N clients
are split into b fixed groups; round t (0-based) samples group t mod b only, each of its clients independently
with probability p = K·b/N, so that the expected cohort stays K. A client then participates only in rounds b
apart, and a b-banded C makes its participations touch disjoint blocks of rows of C·X + Z; Theorem 4 shows the
whole run is then as private as ⌈T/b⌉ adaptive compositions of the Poisson-sampled Gaussian mechanism with
sampling probability p and noise multiplier σ, where σ is the std of Z divided by one participation's
sensitivity, max‖C[:, s]‖ times the clipping norm (:func:`~.sensitivity.max_column_norm`).

This is ``jax_privacy``'s ``accounting.amplified_bandmf_event`` (``dpsgd_event`` at ``iterations = ⌈T/b⌉``),
expressed here with ``dp_accounting`` and accounted by its PLD (on fedhog's grid width) or RDP accountant; σ is
calibrated by :func:`fedhog.privacy.calibration.calibrate_event_noise_multiplier`, the calibration fedhog uses
for DP-FedAvg. b = 1 is DP-FedAvg's Poisson-subsampled Gaussian, T times, exactly.

Assumptions the mechanism must meet for this event to hold (the integration's obligations): groups fixed before
training and independent of the data; Poisson sampling within the active group with probability exactly p; C
b-banded and lower-triangular; every client's contribution clipped; add/remove-one neighbours; when
N is not a multiple of b the groups differ in size by one, and p (not the cohort) is what is accounted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dp_accounting import dp_event, rdp
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation

from ..accounting import ACCOUNTANTS, PLD_VALUE_DISCRETIZATION_INTERVAL, privacy_config
from ..calibration import calibrate_event_noise_multiplier


@dataclass(frozen=True)
class BandedParticipation:
    """Who may take part in which round under amplified BandMF.

    Parameters
    ----------
    population : int
        N.
    cohort : int
        K, the expected number of clients a round (K·b ≤ N).
    rounds : int
        T.
    bands : int
        b, the number of groups and of C's bands (1 ≤ b ≤ T).
    """

    population: int
    cohort: int
    rounds: int
    bands: int

    def __post_init__(self) -> None:
        for name in ("population", "cohort", "rounds", "bands"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.bands > self.rounds:
            raise ValueError(f"bands={self.bands} exceeds rounds={self.rounds}")
        if self.cohort * self.bands > self.population:
            raise ValueError(f"cohort={self.cohort} × bands={self.bands} exceeds population={self.population}: a "
                             "group of N/b clients cannot yield K a round")

    @property
    def sampling_probability(self) -> float:
        """p = K·b/N: each client of the active group takes part with this probability."""
        return self.cohort * self.bands / self.population

    @property
    def cycles(self) -> int:
        """⌈T/b⌉: the most rounds one client can take part in, and the compositions accounted."""
        return math.ceil(self.rounds / self.bands)

    def group_of(self, client: int) -> int:
        """The group of client ``client`` (0..N−1): fixed, public, independent of the data."""
        if not 0 <= client < self.population:
            raise ValueError(f"client={client!r} must be in 0..{self.population - 1}")
        return client % self.bands

    def active_group(self, server_round: int) -> int:
        """The group round ``server_round`` (0-based) samples from."""
        return server_round % self.bands


def amplified_bandmf_event(noise_multiplier: float, participation: BandedParticipation) -> dp_event.DpEvent:
    """⌈T/b⌉ compositions of the Poisson-sampled Gaussian (p = K·b/N, σ relative to C's column norm)."""
    if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be positive and finite")
    sampled = dp_event.PoissonSampledDpEvent(participation.sampling_probability,
                                             dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(sampled, participation.cycles)


def banded_epsilon(noise_multiplier: float, participation: BandedParticipation, delta: float,
                   accountant: str = "pld") -> float:
    """ε at δ of :func:`amplified_bandmf_event` by ``dp_accounting``'s PLD (fedhog's grid) or RDP accountant."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} must be one of {ACCOUNTANTS}")
    if not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1)")
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE
    backend = (PLDAccountant(relation, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
               if accountant == "pld" else rdp.RdpAccountant(neighboring_relation=relation))
    return float(backend.compose(amplified_bandmf_event(noise_multiplier, participation)).get_epsilon(delta))


def calibrate_banded_noise_multiplier(target_epsilon: float, delta: float, participation: BandedParticipation,
                                      accountant: str = "pld", tolerance: float = 1e-3) -> float:
    """The smallest σ (relative to C's column norm) whose amplified BandMF ε is at most ``target_epsilon``.

    The same search as DP-FedAvg's (:func:`~fedhog.privacy.calibration.calibrate_event_noise_multiplier`) over
    the same event: Flower's ``GaussianPrivacyEvent(σ, K·b, N)`` under Poisson sampling is
    ``PoissonSampledDpEvent(K·b/N, GaussianDpEvent(σ))``, composed ⌈T/b⌉ times.
    """
    config = privacy_config("poisson", participation.population, delta)
    return calibrate_event_noise_multiplier(target_epsilon, delta, participation.cycles, config,
                                            participation.cohort * participation.bands, accountant, tolerance)
