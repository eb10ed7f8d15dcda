"""The attacker's test statistics: what it computes from the releases it observes, one score per canary.

Every canary lives in its own block of two coordinates of the released
vector and pushes along c = (e₁ − e₂)/√2 (a gradient-space canary, Nasr et
al. 2021); a canary that is "out" pushes nothing (add/remove) or −c
(replace-one: a client sending the opposite replaced it). The attacker sees,
per round t and canary, the release's component along c, z_t (and the
component along the block's other direction, w_t), in units of the noise's
standard deviation, and knows the public parameters: the sampling rate q and
the canary's signal a_t (its clipped norm over the noise std).

Threat models (Andrew et al. 2024, Section 4):

- ``final-model``: only the last model, i.e. Σ_t z_t (the server steps by
  the releases: the final model's movement along c).
- ``every-round``: every round's release. The Neyman–Pearson statistic of
  the Poisson-subsampled Gaussian is the log-likelihood ratio
  Σ_t log(1 − q + q·exp(a_t z_t − a_t²/2)) (minus the mirrored term under
  replace-one); when the mechanism is the one accounted, no test does better.
  Two more statistics let the attacker exploit mechanisms that are not:
  ``centred-sum`` Σ_t (z_t − median_s z_s), which is exactly 0 for an absent
  canary when the noise repeats across rounds, and ``lr-block``, the
  likelihood ratio of a canary whose direction within its block is unknown
  (the HOG-mixed contribution, whose direction depends on the secret ξ).

Higher scores mean "in". Which statistic the audit uses is chosen on half of
the trials (:func:`fedhog.privacy.audit.bounds.select_decision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.special import i0e

Relation = Literal["add-remove", "replace-one"]
THREAT_MODELS = ("every-round", "final-model")


@dataclass(frozen=True)
class Observation:
    """What the attacker saw of ``n`` canaries over ``T`` rounds, and the truth to score it against.

    Parameters
    ----------
    along : ndarray [T, n]
        z_t: each round's release along each canary's direction, in noise standard deviations.
    across : ndarray [T, n]
        w_t: the release along the block's other direction, in noise standard deviations.
    signal : ndarray [T]
        a_t: the clipped canary's length over the noise std (what the accountant assumes it can be).
    labels : ndarray [n] of bool
        Whether each canary was in (the truth; not seen by the attacker).
    inclusion_rate : float
        q, the probability that a canary in the data set is sampled in a round.
    relation : {"add-remove", "replace-one"}
        What an absent canary sends: nothing, or −c.
    """

    along: np.ndarray
    across: np.ndarray
    signal: np.ndarray
    labels: np.ndarray
    inclusion_rate: float
    relation: Relation

    def __post_init__(self) -> None:
        if self.along.shape != self.across.shape or self.along.shape[1] != len(self.labels):
            raise ValueError(f"along {self.along.shape}, across {self.across.shape} and labels "
                             f"{len(self.labels)} do not describe the same T rounds of n canaries")

    def columns(self, start: int, stop: int) -> Observation:
        """The canaries ``start:stop``."""
        return Observation(self.along[:, start:stop], self.across[:, start:stop], self.signal,
                           self.labels[start:stop], self.inclusion_rate, self.relation)

    @staticmethod
    def concatenate(observations: list[Observation]) -> Observation:
        """Independent runs of the same mechanism as one observation of all their canaries."""
        first = observations[0]
        for other in observations[1:]:
            if other.along.shape[0] != first.along.shape[0] or other.relation != first.relation:
                raise ValueError("only runs with the same rounds and relation can be concatenated")
        signal = np.mean([o.signal for o in observations], axis=0)  # public, equal across runs up to C_t
        return Observation(np.concatenate([o.along for o in observations], axis=1),
                           np.concatenate([o.across for o in observations], axis=1), signal,
                           np.concatenate([o.labels for o in observations]), first.inclusion_rate, first.relation)


def _log_mixture(q: float, log_ratio: np.ndarray) -> np.ndarray:
    """log(1 − q + q·e^x), stable for large x."""
    return np.logaddexp(np.log1p(-q) if q < 1 else -np.inf, np.log(q) + log_ratio)


def likelihood_ratio(observation: Observation) -> np.ndarray:
    """Σ_t log[(1 − q)φ(z_t) + qφ(z_t − a_t)] / φ-baseline, the Neyman–Pearson score of a canary along c."""
    z, a, q = observation.along, observation.signal[:, None], observation.inclusion_rate
    score = _log_mixture(q, a * z - a * a / 2).sum(axis=0)
    if observation.relation == "replace-one":
        score -= _log_mixture(q, -a * z - a * a / 2).sum(axis=0)
    return score


def block_likelihood_ratio(observation: Observation) -> np.ndarray:
    """Σ_t log(1 − q + q·e^{−a²/2}·I₀(a·r_t)), r_t = ‖(z_t, w_t)‖: a canary of unknown direction in its block."""
    z, w, a, q = observation.along, observation.across, observation.signal[:, None], observation.inclusion_rate
    radius = np.hypot(z, w)
    log_bessel = np.log(i0e(a * radius)) + a * radius  # log I₀(x) = log(i0e(x)) + x
    return _log_mixture(q, log_bessel - a * a / 2).sum(axis=0)


CHUNK = 100_000  # canaries scored at once: the temporaries stay at T × CHUNK


def statistics(observation: Observation, threat_model: str) -> dict[str, np.ndarray]:
    """The scores, one per canary, of every statistic the attacker may use under ``threat_model``."""
    if threat_model not in THREAT_MODELS:
        raise ValueError(f"threat_model={threat_model!r} must be one of {THREAT_MODELS}")
    parts = [_statistics(observation.columns(start, start + CHUNK), threat_model)
             for start in range(0, len(observation.labels), CHUNK)]
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


def _statistics(observation: Observation, threat_model: str) -> dict[str, np.ndarray]:
    along = observation.along.astype(np.float64)
    final = along.sum(axis=0)
    if threat_model == "final-model":
        return {"final-sum": final}
    scores = {"likelihood-ratio": likelihood_ratio(observation),
              "centred-sum": (along - np.median(along, axis=0)).sum(axis=0),
              "final-sum": final}
    if observation.relation == "add-remove":
        scores["lr-block"] = block_likelihood_ratio(observation)
    return scores
