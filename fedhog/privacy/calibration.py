"""The smallest noise multiplier that keeps ε within a budget after a number of rounds.

ε falls monotonically as σ grows, so ``dp_accounting``'s
``mechanism_calibration.calibrate_dp_mechanism`` (Brent's method with a guaranteed
feasible end) finds σ; it searches log σ, so its absolute tolerance there is a
relative tolerance on σ. Each evaluation composes ``rounds`` releases at once on
the same backend, model and PLD grid width that :class:`ClientLevelAccountant` uses.
"""

from __future__ import annotations

import math

from dp_accounting import dp_event, mechanism_calibration, rdp
from dp_accounting.pld import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation as DpNeighboringRelation
from dp_accounting.privacy_accountant import PrivacyAccountant as DpPrivacyAccountant
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)

from ..choices import SAMPLING_METHODS
from .accounting import (
    ACCOUNTANTS,
    PLD_VALUE_DISCRETIZATION_INTERVAL,
    accountant_noise_multiplier,
    effective_accountant,
    privacy_config,
)
from .pld import to_dp_event
from .sampling import SamplingKind, expected_cohort_size

_MAX_BRACKET_STEPS = 40  # σ is searched in [2⁻⁴⁰, 2⁴⁰]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    rounds: int,
    sampling: SamplingKind,
    sampling_rate: float,
    population: int,
    accountant: str = "pld",
    tolerance: float = 1e-3,
) -> float:
    """Smallest mechanism σ whose ε after ``rounds`` releases is at most ``target_epsilon``.

    Parameters
    ----------
    target_epsilon : float
        Budget ε at ``delta``.
    delta : float
        δ in (0, 1).
    rounds : int
        Number of released rounds T.
    sampling : {"poisson", "fixed"}
        fedhog's sampling scheme; fixed-size sampling composes σ/2 and is accounted with RDP.
    sampling_rate : float
        q in (0, 1]; q·N must be a whole number.
    population : int
        N.
    accountant : {"pld", "rdp"}
        Requested accountant (see :func:`~fedhog.privacy.accounting.effective_accountant`).
    tolerance : float
        Relative tolerance in (0, 1): ``σ·(1 - tolerance)`` exceeds the budget.

    Returns
    -------
    float
        σ of the mechanism (noise std on the clipped sum = σ·C).

    Raises
    ------
    ValueError
        Naming the first invalid argument.
    """
    _check_budget(target_epsilon, delta, rounds, tolerance)
    _check_positive_int("population", population)
    if sampling not in SAMPLING_METHODS:
        raise ValueError(f"sampling={sampling!r} must be one of {SAMPLING_METHODS}")
    if isinstance(sampling_rate, bool) or not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate={sampling_rate!r} must be in (0, 1]")
    cohort = expected_cohort_size(population, sampling_rate)
    if cohort < 1 or not math.isclose(cohort, sampling_rate * population, abs_tol=1e-9):
        raise ValueError(
            f"sampling_rate={sampling_rate!r} times population={population} must be a whole "
            "number ≥ 1")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} must be one of {ACCOUNTANTS}")
    sensitivity = 1.0 / accountant_noise_multiplier(1.0, sampling)
    return sensitivity * calibrate_event_noise_multiplier(
        target_epsilon, delta, rounds, privacy_config(sampling, population, delta), cohort,
        effective_accountant(accountant, sampling), tolerance)


def calibrate_unamplified_noise_multiplier(
    target_epsilon: float,
    delta: float,
    rounds: int,
    population: int,
    cohort: int,
    tolerance: float = 1e-3,
) -> float:
    """σ for Flower's accounted fixed-clipping wrappers: every release a Gaussian on the clipped
    sum (add/remove one client), composed ``rounds`` times by RDP without sampling amplification.

    This is the model Flower's ``RdpAccountant`` applies with ``SamplingMethod.NO_AMPLIFICATION``
    (the only one its ``DifferentialPrivacy*FixedClipping`` wrappers accept).
    """
    config = unamplified_privacy_config(population, delta)
    return calibrate_event_noise_multiplier(target_epsilon, delta, rounds, config, cohort, "rdp", tolerance)


def unamplified_privacy_config(population: int, delta: float, max_epsilon: float | None = None) -> PrivacyConfig:
    """Flower's accounting model for its fixed-clipping wrappers: add/remove one, no amplification."""
    return PrivacyConfig(delta, population, NeighboringRelation.ADD_OR_REMOVE_ONE,
                         SamplingMethod.NO_AMPLIFICATION, max_epsilon)


def calibrate_event_noise_multiplier(
    target_epsilon: float,
    delta: float,
    rounds: int,
    config: PrivacyConfig,
    sample_size: int,
    accountant: str,
    tolerance: float = 1e-3,
) -> float:
    """Smallest accountant σ of ``GaussianPrivacyEvent(σ, sample_size, N)`` meeting the budget.

    Parameters
    ----------
    target_epsilon, delta, rounds, tolerance
        As in :func:`calibrate_noise_multiplier`.
    config : PrivacyConfig
        Flower's accounting model (any sampling method the backend supports); its
        ``target_delta`` is ignored in favour of ``delta``.
    sample_size : int
        Sample size of each release (K).
    accountant : {"pld", "rdp"}
        Backend; PLD does not support WITHOUT_REPLACEMENT.

    Returns
    -------
    float
        Noise std ÷ sensitivity, as the accountant composes it.
    """
    _check_budget(target_epsilon, delta, rounds, tolerance)
    _check_positive_int("sample_size", sample_size)
    if sample_size > config.population_size:
        raise ValueError(
            f"sample_size={sample_size} exceeds config.population_size={config.population_size}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant={accountant!r} must be one of {ACCOUNTANTS}")
    if accountant == "pld" and config.sampling_method is SamplingMethod.WITHOUT_REPLACEMENT:
        raise ValueError(
            "accountant='pld' cannot account sampling_method='without-replacement'; use 'rdp'")

    relation = DpNeighboringRelation[config.neighboring_relation.name]

    def make_fresh_accountant() -> DpPrivacyAccountant:
        if accountant == "pld":
            return PLDAccountant(relation, value_discretization_interval=PLD_VALUE_DISCRETIZATION_INTERVAL)
        return rdp.RdpAccountant(neighboring_relation=relation)

    def make_event(log_sigma: float) -> dp_event.DpEvent:
        event = GaussianPrivacyEvent(math.exp(log_sigma), sample_size, config.population_size)
        return dp_event.SelfComposedDpEvent(to_dp_event(event, config.sampling_method), rounds)

    def epsilon(log_sigma: float) -> float:
        return make_fresh_accountant().compose(make_event(log_sigma)).get_epsilon(delta)

    # calibrate_dp_mechanism only expands brackets upwards: find one around σ = 1 here.
    low, high = 0.0, 0.0
    step = math.log(2.0)
    for _ in range(_MAX_BRACKET_STEPS):
        if epsilon(high) <= target_epsilon:
            break
        low, high = high, high + step
    else:
        raise ValueError(f"target_epsilon={target_epsilon!r} is out of reach below σ = 2^{_MAX_BRACKET_STEPS}")
    if low == high:
        for _ in range(_MAX_BRACKET_STEPS):
            low -= step
            if epsilon(low) > target_epsilon:
                break
            high = low
        else:
            raise ValueError(
                f"target_epsilon={target_epsilon!r} is met even at σ = 2^-{_MAX_BRACKET_STEPS}")
    log_sigma = mechanism_calibration.calibrate_dp_mechanism(
        make_fresh_accountant, make_event, target_epsilon, delta,
        bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
        tol=-math.log1p(-tolerance) / 2,
    )
    return math.exp(log_sigma)


def _check_budget(target_epsilon: float, delta: float, rounds: int, tolerance: float) -> None:
    if isinstance(target_epsilon, bool) or not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon={target_epsilon!r} must be positive and finite")
    if isinstance(delta, bool) or not 0 < delta < 1:
        raise ValueError(f"delta={delta!r} must be in (0, 1)")
    _check_positive_int("rounds", rounds)
    if isinstance(tolerance, bool) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance={tolerance!r} must be in (0, 1)")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")
