"""Client-level privacy accounting over what the aggregator really released.

The accountant's noise multiplier is the noise standard deviation divided by
the L2 sensitivity of the clipped sum under the accountant's neighbouring
relation: C for add/remove-one (Poisson sampling) but 2C for replace-one
(fixed-size sampling), so fixed-size sampling composes σ/2, not σ.

Two accountants bound ε: PLD (tight; :class:`~fedhog.privacy.pld.PldAccountant`)
and RDP (Flower's ``RdpAccountant``), found by name in :data:`ACCOUNTANT_REGISTRY`
(its names are :data:`fedhog.choices.ACCOUNTANTS`). dp_accounting's PLD accountant
cannot account sampling without replacement, so fixed-size sampling is always
accounted with RDP (:func:`effective_accountant`).

What the strategy holds is an :class:`Accountant`: :class:`ClientLevelAccountant`
here, or :class:`~fedhog.privacy.distributed_gaussian.DistributedGaussianAccountant`
when the clients add the noise; each describes itself, so the strategy never asks which.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Protocol

from flwr.common import log
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyAccountant,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant  # its home (flwr.serverapp re-exports it)

from ..choices import ACCOUNTANTS
from .sampler_slack import SamplerSlack, sampler_slack
from .sampling import SamplingKind, expected_cohort_size
from .schedule import EpsilonSchedule

# PLD grid width. Rounding is pessimistic: against dp_accounting's default 1e-4 grid, ε is
# overstated by < 1e-3 when ε ≥ 1 (T ≤ 1000) but by up to 0.02 when ε < 0.1, and ε after
# T rounds costs ~0.05 s instead of 0.3–1.3 s.
PLD_VALUE_DISCRETIZATION_INTERVAL = 1e-3

# dp-accounting logs a warning for every RDP order it drops as numerically unstable
# (large q); the orders left still bound ε, so these warnings only bury the run's log.
logging.getLogger("absl").setLevel(logging.ERROR)

_ACCOUNTING_MODELS: dict[str, tuple[SamplingMethod, NeighboringRelation, float]] = {
    # sampling -> (Flower sampling method, neighbouring relation, sensitivity / C)
    "poisson": (SamplingMethod.POISSON, NeighboringRelation.ADD_OR_REMOVE_ONE, 1.0),
    "fixed": (SamplingMethod.WITHOUT_REPLACEMENT, NeighboringRelation.REPLACE_ONE, 2.0),
}


def accountant_noise_multiplier(noise_multiplier: float, sampling: SamplingKind) -> float:
    """σ as the accountant must see it: noise std ÷ the sum's sensitivity."""
    return noise_multiplier / _ACCOUNTING_MODELS[sampling][2]


def effective_accountant(accountant: str, sampling: SamplingKind) -> str:
    """The accountant that really bounds ε: PLD falls back to RDP for fixed-size sampling.

    Raises
    ------
    ValueError
        If ``accountant`` is not one of :data:`ACCOUNTANTS` or ``sampling`` is unknown.
    """
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} must be one of {ACCOUNTANTS}")
    if sampling not in _ACCOUNTING_MODELS:
        raise ValueError(f"sampling={sampling!r} must be one of {tuple(_ACCOUNTING_MODELS)}")
    return "rdp" if sampling == "fixed" else accountant


def privacy_config(sampling: SamplingKind, population: int, delta: float) -> PrivacyConfig:
    """Flower's privacy configuration of fedhog's sampling scheme."""
    method, relation, _ = _ACCOUNTING_MODELS[sampling]
    return PrivacyConfig(target_delta=delta, population_size=population,
                         neighboring_relation=relation, sampling_method=method)


class Accountant(Protocol):
    """What the strategy asks of an accountant (Opacus' ``IAccountant``, for releases of whole rounds)."""

    method: str  # the accountant that bounds ε ("pld", "rdp", "ddg-rdp")
    delta: float
    releases: int

    @property
    def has_guarantee(self) -> bool:
        """Whether any finite ε can be reported."""

    @property
    def noise_multiplier(self) -> float | None:
        """σ as the accountant composes it (noise std ÷ the sum's sensitivity); None without a guarantee."""

    def describe(self) -> str:
        """One line for the strategy's start-up log: what is accounted, and how."""

    def cover_sampler(self, std_steps: float, values_per_release: int) -> None:
        """Count the slack of the server's lattice sampler in ε and δ (nothing where the clients add the noise)."""

    def sampler_slack(self, releases: int) -> SamplerSlack | None:
        """What the server's lattice sampler adds to ε and δ after ``releases`` releases; None where no sampler of
        the server's is accounted (no guarantee, or the clients draw the noise)."""

    def plan(self, rounds: int) -> None:
        """Say that up to ``rounds`` releases will be asked for (their ε may be computed ahead)."""

    def compose_round(self) -> None:
        """Record one released round."""

    def epsilon(self) -> float:
        """ε spent so far at δ."""

    def would_exceed(self, max_epsilon: float) -> bool:
        """Whether releasing one more round would push ε past ``max_epsilon``."""

    def state_dict(self) -> dict[str, object]:
        """Serializable state (for checkpoints)."""

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""


def _pld(config: PrivacyConfig) -> PrivacyAccountant:
    from .pld import PldAccountant  # dp-accounting's PLD: imported by servers only, not clients

    return PldAccountant(config, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)


# accountant name -> a fresh Flower-protocol accountant for a privacy configuration (Opacus' registry)
ACCOUNTANT_REGISTRY: dict[str, Callable[[PrivacyConfig], PrivacyAccountant]] = {"pld": _pld, "rdp": RdpAccountant}


def new_backend(config: PrivacyConfig, accountant: str) -> PrivacyAccountant:
    """A fresh Flower-protocol accountant: ``"pld"`` (fedhog's grid width) or ``"rdp"``."""
    if accountant not in ACCOUNTANT_REGISTRY:
        raise ValueError(f"accountant={accountant!r} must be one of {ACCOUNTANTS}")
    return ACCOUNTANT_REGISTRY[accountant](config)


class ClientLevelAccountant:
    """ε(δ) of the sampled Gaussian mechanism, or ∞ where there is no guarantee.

    Parameters
    ----------
    noise_multiplier : float
        σ of the mechanism (noise std on the sum = σ·C). 0 means no guarantee.
    sampling : {"poisson", "fixed"}
        What the strategy really does each round.
    sampling_rate : float
        q; the expected cohort size q·N is a whole number.
    population : int
        N, the number of clients that can be sampled.
    delta : float
        The δ at which ε is reported.
    has_guarantee : bool
        False for mechanisms that add no calibrated noise (ε = ∞).
    accountant : {"pld", "rdp"}
        Requested accountant; :attr:`method` is the one used (RDP for fixed-size sampling).
        The default stays "rdp" so existing callers keep their figures; the run config chooses.
    """

    def __init__(
        self,
        noise_multiplier: float,
        sampling: SamplingKind,
        sampling_rate: float,
        population: int,
        delta: float,
        has_guarantee: bool = True,
        accountant: str = "rdp",
    ) -> None:
        self.method = effective_accountant(accountant, sampling)
        if self.method != accountant:
            log(logging.WARNING, "accountant=%r cannot account %s sampling: using %r",
                accountant, sampling, self.method)
        self.delta = delta
        self.sampling = sampling
        self._backend: PrivacyAccountant | None = None
        self._event: GaussianPrivacyEvent | None = None
        self.releases = 0
        self._noise_values: tuple[float, int] | None = None  # (std in lattice steps, values drawn a release)
        self._schedule = EpsilonSchedule(self._epsilon_after)  # ε after n releases of the round's (fixed) event
        self._scheduled = accountant == "pld" == self.method  # ε read from the schedule (while the ledger is its own)
        if has_guarantee and noise_multiplier > 0:
            self._backend = new_backend(privacy_config(sampling, population, delta), self.method)
            self._event = GaussianPrivacyEvent(
                noise_multiplier=accountant_noise_multiplier(noise_multiplier, sampling),
                sample_size=expected_cohort_size(population, sampling_rate),
                population_size=population,
            )

    @property
    def has_guarantee(self) -> bool:
        """Whether any finite ε can be reported."""
        return self._backend is not None

    @property
    def event(self) -> GaussianPrivacyEvent | None:
        """The event composed for each round's release (None without a guarantee)."""
        return self._event

    @property
    def noise_multiplier(self) -> float | None:
        """The event's σ (halved for replace-one); None without a guarantee."""
        return None if self._event is None else self._event.noise_multiplier

    def describe(self) -> str:
        """The accountant, sampling and event of each release (or that there is no guarantee)."""
        if self._event is None:
            return f"no accounting: ε = ∞ ({self.method} accountant, {self.sampling} sampling)"
        event = self._event
        return (f"accounting: {self.method}, {self.sampling} sampling, accountant σ={event.noise_multiplier:g}, "
                f"expected cohort {event.sample_size:d} of {event.population_size:d}, δ={self.delta:g}")

    def cover_sampler(self, std_steps: float, values_per_release: int) -> None:
        """Count the slack of fedhog's lattice sampler (:func:`~fedhog.privacy.mechanism.sampler_slack`) in ε and δ:
        each release draws ``values_per_release`` values of std ``std_steps`` lattice steps."""
        self._noise_values = (std_steps, values_per_release)

    def sampler_slack(self, releases: int) -> SamplerSlack | None:
        """What the sampler adds to ε and δ after ``releases`` releases (δ's share at the ε they reach); None
        without a guarantee."""
        if self._backend is None:
            return None
        if self._noise_values is None or releases == 0:
            return SamplerSlack(0.0, 0.0)
        _, event = self._accounted()
        return sampler_slack(event.noise_multiplier, *self._noise_values, releases, self._projected(releases),
                             self.delta)

    def _epsilon_slack(self, releases: int) -> float:
        """The sampler's share of ε after ``releases`` releases (it does not depend on ε: no composition)."""
        if self._backend is None or self._noise_values is None or releases == 0:
            return 0.0
        _, event = self._accounted()
        return sampler_slack(event.noise_multiplier, *self._noise_values, releases, 0.0, self.delta).epsilon

    def plan(self, rounds: int) -> None:
        """Compute ε after each release up to ``rounds`` ahead, in the background (PLD: the same values, off the
        rounds' path; RDP composes in constant time and needs no plan)."""
        if self._backend is not None and self._scheduled:
            self._schedule.plan(self.releases + 1, rounds)

    def compose_round(self) -> None:
        """Record one released round."""
        self.releases += 1
        if self._backend is not None:
            backend, event = self._accounted()
            backend.compose(event)

    def epsilon(self) -> float:
        """ε spent so far at δ (∞ without a guarantee, 0 before any release)."""
        if self._backend is None:
            return math.inf if self.releases else 0.0
        if self.releases == 0:
            return 0.0
        # PLD: the committed n releases of one fixed event are one composition with count n, which the schedule holds
        composed = self._projected(self.releases) if self._scheduled else self._backend.get_epsilon(self.delta)
        return composed + self._epsilon_slack(self.releases)

    def would_exceed(self, max_epsilon: float) -> bool:
        """Whether releasing one more round would push ε past ``max_epsilon``."""
        if math.isinf(max_epsilon):
            return False
        if self._backend is None:
            return True
        slack = self._epsilon_slack(self.releases + 1)
        if self.method == "pld":
            if max_epsilon - slack <= 0 or not self._scheduled:  # the backend refuses a non-positive limit, naming it
                backend, event = self._accounted()
                return backend.would_exceed(event, max_epsilon - slack)
            return self._projected(self.releases + 1) > max_epsilon - slack
        return self._projected(self.releases + 1) + slack > max_epsilon

    def _projected(self, releases: int) -> float:
        """ε after ``releases`` releases of the round's event, remembered (the run's start asks for the planned
        rounds twice; each round asks for its own)."""
        return self._schedule(releases)

    def _epsilon_after(self, releases: int) -> float:
        """ε after ``releases`` releases of the round's event: one composition with that count (RDP: in constant
        time; Flower's would_exceed replays every event)."""
        backend, event = self._accounted()
        projected = new_backend(backend.config, self.method)
        projected.compose(event, count=releases)
        return projected.get_epsilon(self.delta)

    def _accounted(self) -> tuple[PrivacyAccountant, GaussianPrivacyEvent]:
        """The backend and the event it composes each release (callers have checked :attr:`has_guarantee`)."""
        if self._backend is None or self._event is None:
            raise RuntimeError("this accountant has no guarantee: it composes nothing")
        return self._backend, self._event

    def state_dict(self) -> dict[str, object]:
        """Serializable state (for checkpoints)."""
        backend = None if self._backend is None else self._backend.state_dict()
        return {"releases": self.releases, "backend": backend}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""
        releases, backend = state["releases"], state["backend"]
        if isinstance(releases, bool) or not isinstance(releases, int) or not isinstance(backend, dict | None):
            raise ValueError(f"an accountant state holds releases={releases!r} and a backend state of type "
                             f"{type(backend).__name__}; expected an integer and a dict (or None)")
        self.releases = releases
        if self._backend is not None:
            if backend is None:
                raise ValueError("the accountant state has no backend state, and this accountant has a guarantee")
            self._backend.load_state_dict(backend)
            self._scheduled = self.method == "pld" and self._ledger_is_own()

    def _ledger_is_own(self) -> bool:
        """Whether the backend holds exactly :attr:`releases` releases of this accountant's event, on its grid
        (a restored state could hold others: then ε is the backend's, not the schedule's)."""
        backend, own_event = self._accounted()
        state = backend.state_dict()
        event = {"noise_multiplier": own_event.noise_multiplier, "sample_size": own_event.sample_size,
                 "population_size": own_event.population_size}
        own = [{"event": event, "count": self.releases}] if self.releases else []
        return (state["compositions"] == own
                and state["value_discretization_interval"] == PLD_VALUE_DISCRETIZATION_INTERVAL)
