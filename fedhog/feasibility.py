"""Whether this machine can run a config at all, checked before anything trains.

A valid config can still be out of reach: ε after ``rounds`` releases under PLD
accounting composes one release's privacy-loss distribution with itself by FFT,
and the FFT grows about linearly with the rounds (``rounds = 1000000000`` at
σ = 1 asks for 46 GiB). :func:`check_feasible` computes what those FFTs take
from the one-release distribution's truncation bounds (milliseconds, nothing is
composed) and refuses the config in one line when the memory available now
does not hold it.
"""

from __future__ import annotations

from .config import ConfigError, RunConfig


def available_memory() -> int:
    """Bytes of memory available to a new allocation now (psutil's ``available``)."""
    import psutil

    return int(psutil.virtual_memory().available)


def accounting_bytes(config: RunConfig) -> tuple[int, float]:
    """The memory ε after ``rounds`` releases takes under PLD accounting at its peak, and the σ it peaks at.

    σ is the run's ``noise-multiplier``, or, when σ is calibrated to
    ``target-epsilon``, 1, where the calibration starts: a lower bound on what the
    run needs. (0, σ) where nothing is PLD-composed (RDP, fixed-size
    sampling, no guarantee).
    """
    from .privacy.accounting import PLD_VALUE_DISCRETIZATION_INTERVAL, effective_accountant
    from .privacy.pld import composition_bytes

    if effective_accountant(config.accountant, config.sampling) != "pld" or config.aggregator != "fedhog" \
            or (not config.privacy_mechanism.has_guarantee and not config.target_epsilon > 0):
        return 0, config.noise_multiplier
    sigma = 1.0 if config.target_epsilon > 0 else config.noise_multiplier
    return composition_bytes(sigma, config.sampling_rate, config.rounds,
                             interval=PLD_VALUE_DISCRETIZATION_INTERVAL), sigma


def check_feasible(config: RunConfig) -> None:
    """Refuse a config whose accounting cannot fit in this machine's available memory, naming ``rounds``.

    Raises
    ------
    ConfigError
        ``rounds=…`` with the memory its accounting needs and the memory available.
    """
    needed, sigma = accounting_bytes(config)
    available = available_memory()
    if needed > available:
        raise ConfigError(
            f"rounds={config.rounds} is not allowed on this machine: PLD accounting of {config.rounds} releases at "
            f"σ = {sigma:g} (q = {config.sampling_rate:g}) needs at least {needed / 2**30:.1f} GiB and "
            f"{available / 2**30:.1f} GiB are available; expected fewer rounds, or accountant=\"rdp\" "
            "(constant memory)")
