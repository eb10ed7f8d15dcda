"""Settings records that config validation builds: pure frozen dataclasses that check their own fields.

They live on the bottom floor (no torch, no Flower), so that :mod:`fedhog.config`
validates a run without loading what runs it; the modules that run them
re-export them (``fedhog.dpsgd.DpSgdSettings``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .choices import DPSGD_ACCOUNTANTS, DPSGD_NOISE


def dpsgd_error(key: str, value: object, expected: str) -> ValueError:
    """The ``ValueError`` that names a refused DP-SGD setting (config validation maps ``key`` to its config key)."""
    return ValueError(f"dpsgd: {key}={value!r} is not allowed; expected {expected}")


def is_number(value: object) -> bool:
    """A real number (Python or NumPy), not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DpSgdSettings:
    """How DP-SGD privatises one client's local training.

    Attributes
    ----------
    noise_multiplier : float
        σ: noise std ÷ the sensitivity; ≥ 0 (0 clips without noise: ε = ∞).
    max_grad_norm : float
        C: each example's gradient is clipped to this L2 norm; > 0.
    delta : float
        The δ at which ε is reported, in (0, 1).
    accountant : str
        Opacus's ``"prv"`` (tight, numerical) or ``"rdp"`` (Rényi DP).
    noise : str
        ``"fedhog"`` (lattice noise from the client's random bits) or
        ``"opacus-secure"`` (Opacus's secure mode; needs ``torchcsprng``).
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    accountant: str = "prv"
    noise: str = "fedhog"

    def __post_init__(self) -> None:
        sigma, clip, delta = self.noise_multiplier, self.max_grad_norm, self.delta
        if not is_number(sigma) or not (math.isfinite(sigma) and sigma >= 0):
            raise dpsgd_error("noise_multiplier", sigma, "a finite number ≥ 0")
        if not is_number(clip) or not (math.isfinite(clip) and clip > 0):
            raise dpsgd_error("max_grad_norm", clip, "a finite number > 0")
        if not is_number(delta) or not 0 < delta < 1:
            raise dpsgd_error("delta", delta, "a number in (0, 1)")
        if self.accountant not in DPSGD_ACCOUNTANTS:
            raise dpsgd_error("accountant", self.accountant, f"one of {DPSGD_ACCOUNTANTS}")
        if self.noise not in DPSGD_NOISE:
            raise dpsgd_error("noise", self.noise, f"one of {DPSGD_NOISE}")
