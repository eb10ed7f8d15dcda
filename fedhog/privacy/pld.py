"""Privacy-loss-distribution accounting behind Flower's ``PrivacyAccountant`` protocol.

:class:`PldAccountant` mirrors Flower's ``RdpAccountant`` (constructor shape, event
ledger, JSON state with a schema version) but bounds ε with ``dp_accounting``'s
PLD accountant, which is tight where RDP is loose. That accountant has no
``SampledWithoutReplacementDpEvent``: (WITHOUT_REPLACEMENT, REPLACE_ONE) is refused
at construction, and callers must account fixed-size sampling with RDP.

The ledger merges identical events, and the composed privacy loss distribution
is rebuilt from it on demand exactly as ``dp_accounting``'s ``PLDAccountant``
composes it (one self-composition per distinct event, ``count`` included), with
each event's own PLD built once per process: ε after T identical releases costs
one self-composition, not T, and a run's per-round ε does not rebuild the
subsampled Gaussian's PLD every round.
"""

from __future__ import annotations

import functools
import math
from math import isfinite

from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from dp_accounting.privacy_accountant import NeighboringRelation as DpNeighboringRelation
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    PrivacyConfig,
    PrivacySpent,
    SamplingMethod,
)

from ..compat import (
    parse_compositions,
    parse_config,
    validate_count,
    validate_delta,
    validate_epsilon,
    validate_positive_epsilon,
)
from .self_composition import SelfComposition

_STATE_SCHEMA_VERSION = 1
_ACCOUNTING_METHOD = "pld"
_CACHED_BACKENDS = 2  # the committed ledger and one projection (would_exceed)

Ledger = tuple[tuple[GaussianPrivacyEvent, int], ...]


def to_dp_event(event: GaussianPrivacyEvent, sampling_method: SamplingMethod) -> dp_event.DpEvent:
    """The ``dp_accounting`` event of one release, as Flower's ``RdpAccountant`` builds it."""
    gaussian = dp_event.GaussianDpEvent(event.noise_multiplier)
    if sampling_method is SamplingMethod.POISSON:
        return dp_event.PoissonSampledDpEvent(event.sample_size / event.population_size, gaussian)
    if sampling_method is SamplingMethod.WITHOUT_REPLACEMENT:
        return dp_event.SampledWithoutReplacementDpEvent(
            event.population_size, event.sample_size, gaussian)
    if sampling_method is SamplingMethod.NO_AMPLIFICATION:
        return gaussian
    raise ValueError(f"sampling_method={sampling_method!r} is not a Flower sampling method")


class PldAccountant:
    """Cumulative client-level (ε, δ) from privacy loss distributions.

    Parameters
    ----------
    config : PrivacyConfig
        Flower's privacy configuration; sampling must be POISSON or NO_AMPLIFICATION.
    value_discretization_interval : float
        Width of the privacy-loss grid. Rounding is pessimistic, so a coarser grid
        overstates ε slightly (by about the interval) and runs faster.

    Raises
    ------
    ValueError
        For WITHOUT_REPLACEMENT sampling, which ``dp_accounting``'s PLD accountant
        does not support, or a non-positive interval.
    """

    def __init__(self, config: PrivacyConfig, value_discretization_interval: float = 1e-4) -> None:
        if config.sampling_method is SamplingMethod.WITHOUT_REPLACEMENT:
            raise ValueError(
                "config.sampling_method='without-replacement': dp_accounting's PLD accountant "
                "does not support SampledWithoutReplacementDpEvent; use RdpAccountant")
        _validate_interval(value_discretization_interval)
        self._config = config
        self._interval = float(value_discretization_interval)
        self._ledger: dict[GaussianPrivacyEvent, int] = {}
        self._backends: dict[Ledger, _ComposedPld] = {}

    @property
    def config(self) -> PrivacyConfig:
        """The privacy configuration."""
        return self._config

    @property
    def value_discretization_interval(self) -> float:
        """Width of the privacy-loss grid."""
        return self._interval

    @property
    def num_releases(self) -> int:
        """Number of composed releases."""
        return sum(self._ledger.values())

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        """Record ``count`` identical releases of ``event``."""
        self._validate_event(event)
        validate_count(count)
        self._ledger[event] = self._ledger.get(event, 0) + count

    def get_epsilon(self, delta: float) -> float:
        """Cumulative ε at ``delta``."""
        validate_delta(delta)
        return float(self._backend(self._key()).get_epsilon(delta))

    def get_delta(self, epsilon: float) -> float:
        """Cumulative δ at ``epsilon``."""
        validate_epsilon(epsilon)
        return float(self._backend(self._key()).get_delta(epsilon))

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        """Cumulative expenditure at ``delta`` (the config's target δ by default)."""
        target_delta = self._config.target_delta if delta is None else delta
        return PrivacySpent(
            epsilon=self.get_epsilon(target_delta),
            delta=target_delta,
            num_releases=self.num_releases,
            accounting_method=_ACCOUNTING_METHOD,
        )

    def would_exceed(
        self,
        event: GaussianPrivacyEvent,
        max_epsilon: float | None = None,
        count: int = 1,
    ) -> bool:
        """Whether composing ``count`` more ``event`` would push ε (at the target δ) past the limit.

        The committed state does not change; the projection is cached, so composing
        that same release next makes the following :meth:`get_epsilon` free.
        """
        self._validate_event(event)
        validate_count(count)
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            raise ValueError("max_epsilon must be supplied either in PrivacyConfig or to would_exceed()")
        validate_positive_epsilon("max_epsilon", limit)
        projected = dict(self._ledger)
        projected[event] = projected.get(event, 0) + count
        epsilon = self._backend(tuple(projected.items())).get_epsilon(self._config.target_delta)
        return bool(epsilon > limit)

    def state_dict(self) -> dict[str, object]:
        """JSON-serializable state, in the layout of Flower's ``RdpAccountant``."""
        config = self._config
        return {
            "schema_version": _STATE_SCHEMA_VERSION,
            "backend": _ACCOUNTING_METHOD,
            "config": {
                "target_delta": config.target_delta,
                "population_size": config.population_size,
                "neighboring_relation": config.neighboring_relation.value,
                "sampling_method": config.sampling_method.value,
                "max_epsilon": config.max_epsilon,
            },
            "value_discretization_interval": self._interval,
            "compositions": [
                {
                    "event": {
                        "noise_multiplier": event.noise_multiplier,
                        "sample_size": event.sample_size,
                        "population_size": event.population_size,
                    },
                    "count": count,
                }
                for event, count in self._ledger.items()
            ],
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output of an accountant with the same configuration."""
        schema_version = state.get("schema_version")
        if schema_version != _STATE_SCHEMA_VERSION:
            raise ValueError(f"Unsupported accountant state schema_version={schema_version!r}")
        if state.get("backend") != _ACCOUNTING_METHOD:
            raise ValueError(f"Accountant state backend={state.get('backend')!r} is not 'pld'")
        restored_config = parse_config(state.get("config"))
        if restored_config != self._config:
            raise ValueError(
                f"Accountant state config={restored_config} does not match this accountant's "
                f"config={self._config}")
        interval = state.get("value_discretization_interval")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)):
            raise ValueError(f"Accountant state value_discretization_interval={interval!r} is not a number")
        _validate_interval(float(interval))
        ledger: dict[GaussianPrivacyEvent, int] = {}
        for event, count in parse_compositions(state.get("compositions")):
            self._validate_event(event)
            ledger[event] = ledger.get(event, 0) + count
        self._interval = float(interval)
        self._ledger = ledger
        self._backends = {}

    def _key(self) -> Ledger:
        return tuple(self._ledger.items())

    def _backend(self, ledger: Ledger) -> _ComposedPld:
        """The composed PLD of ``ledger``: one self-composition per distinct event."""
        if ledger in self._backends:
            return self._backends[ledger]
        relation = self._config.neighboring_relation.name
        composed: PrivacyLossDistribution = pld_lib.identity(value_discretization_interval=self._interval)
        private = True
        for event, count in ledger:
            release = _release_pld(event, self._config.sampling_method, count, relation, self._interval)
            if release is _NOT_DP:
                private = False
                break
            if release is not None:
                composed = composed.compose(release)
        backend = _ComposedPld(composed if private else None)
        if len(self._backends) >= _CACHED_BACKENDS:
            del self._backends[next(iter(self._backends))]
        self._backends[ledger] = backend
        return backend

    def _validate_event(self, event: GaussianPrivacyEvent) -> None:
        if event.population_size != self._config.population_size:
            raise ValueError(
                f"event.population_size={event.population_size} does not match "
                f"config.population_size={self._config.population_size}")


_NOT_DP = object()  # a release with σ = 0: ε = ∞


class _ComposedPld:
    """ε(δ) and δ(ε) of a composed PLD (None: a release without DP in it), as ``PLDAccountant`` reports them."""

    def __init__(self, pld: PrivacyLossDistribution | None) -> None:
        self._pld = pld

    def get_epsilon(self, delta: float) -> float:
        return math.inf if self._pld is None else self._pld.get_epsilon_for_delta(delta)

    def get_delta(self, epsilon: float) -> float:
        return 1.0 if self._pld is None else self._pld.get_delta_for_epsilon(epsilon)


def _release_pld(event: GaussianPrivacyEvent, sampling_method: SamplingMethod, count: int, relation: str,
                 interval: float) -> object:
    """``count`` releases of ``event`` as ``dp_accounting``'s ``PLDAccountant`` composes them.

    None for a release that reveals nothing (q = 0), :data:`_NOT_DP` for σ = 0.
    The subsampled Gaussian's PLD is built once per event (:func:`_subsampled_gaussian`; about 50 ms), then
    self-composed with what does not depend on ``count`` memoised (:mod:`.self_composition`; a few ms).
    """
    dp = to_dp_event(event, sampling_method)
    neighbours = DpNeighboringRelation[relation]
    if isinstance(dp, dp_event.PoissonSampledDpEvent):
        if dp.sampling_probability == 0:
            return None
        if dp.event.noise_multiplier == 0:
            return _NOT_DP
        return _subsampled_gaussian(dp.event.noise_multiplier, dp.sampling_probability, relation, interval)(count)
    if dp.noise_multiplier == 0:
        return _NOT_DP
    return pld_lib.from_gaussian_mechanism(  # closed form: T Gaussians are one with σ/√T
        standard_deviation=dp.noise_multiplier / math.sqrt(count), value_discretization_interval=interval,
        neighboring_relation=neighbours)


def composition_bytes(noise_multiplier: float, sampling_probability: float, count: int,
                      relation: str = "ADD_OR_REMOVE_ONE",
                      interval: float = 1e-3) -> int:
    """The memory ε after ``count`` releases of a Poisson-subsampled Gaussian takes to compose (its FFTs), found
    from the one-release PLD's truncation bounds without composing it; 0 where nothing is composed."""
    if sampling_probability == 0 or noise_multiplier == 0:
        return 0
    return _subsampled_gaussian(noise_multiplier, sampling_probability, relation, interval).working_bytes(count)


@functools.lru_cache(maxsize=16)
def _subsampled_gaussian(noise_multiplier: float, sampling_probability: float, relation: str,
                         interval: float) -> SelfComposition:
    """The one-release PLD of a subsampled Gaussian, as its n-fold self-composition for any n."""
    return SelfComposition(pld_lib.from_gaussian_mechanism(
        standard_deviation=noise_multiplier, value_discretization_interval=interval,
        sampling_prob=sampling_probability, neighboring_relation=DpNeighboringRelation[relation]))


def _validate_interval(value: float) -> None:
    if not isfinite(value) or value <= 0:
        raise ValueError(f"value_discretization_interval={value!r} must be positive and finite")
