"""From attack scores to ε: a rigorous lower bound (Clopper–Pearson) and a Gaussian-DP estimate.

Pure functions of numbers; no mechanism, no config.

**The bound** (Jagielski, Ullman & Oprea 2020; Nasr et al. 2021). A
mechanism is (ε, δ)-DP for a canary when, for every set S of outputs,
P[M(D ∪ {canary}) ∈ S] ≤ e^ε·P[M(D) ∈ S] + δ and the same with the two
swapped. A test that says "in" when its score reaches a threshold τ has
TPR ≤ e^ε·FPR + δ and TNR ≤ e^ε·FNR + δ, so

    ε ≥ max( log((TPR − δ)/FPR), log((TNR − δ)/FNR) ).

With independent trials, TPR, FPR (or TNR, FNR) are binomial proportions;
replacing the one in the numerator by its Clopper–Pearson lower bound and the
one in the denominator by its upper bound, each at level α/2, gives a bound
that holds with probability ≥ 1 − α. The statistic, its direction and τ are
chosen on one half of the trials (:func:`select_decision`) and the bound is
computed on the other half (:func:`bound_of`), so the choice costs no
confidence.

**The estimate** (Dong, Roth & Su 2022; Nasr et al. 2023). A μ-GDP mechanism
has the trade-off FNR = Φ(Φ⁻¹(1 − FPR) − μ); μ̂ = Φ⁻¹(1 − FPR) − Φ⁻¹(FNR) at the
chosen test's threshold, on the held-out trials, turned into the ε(δ) of
μ̂-GDP, is a point estimate of the privacy the test observed — neither a
bound nor a guarantee.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import ndtr, ndtri
from scipy.stats import beta

MAX_THRESHOLDS = 4000  # candidate thresholds tried per statistic and direction
# A threshold fewer calibration trials pass is too noisy to choose (10 left a heavy lower tail).
MIN_CALIBRATION_HITS = 30


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """The one-sided Clopper–Pearson bounds (lower, upper) on a binomial proportion, each at level ``alpha``.

    Exact: P[p < lower] ≤ α and P[p > upper] ≤ α for any true p.
    """
    if not 0 <= successes <= trials:
        raise ValueError(f"successes={successes} must be in 0..trials={trials}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    if trials == 0:
        return 0.0, 1.0
    lower = 0.0 if successes == 0 else float(beta.ppf(alpha, successes, trials - successes + 1))
    upper = 1.0 if successes == trials else float(beta.ppf(1 - alpha, successes + 1, trials - successes))
    return lower, upper


def epsilon_from_rates(hit_rate: float, false_rate: float, delta: float) -> float:
    """log((hit − δ)/false): the ε a test with this pair of rates proves (0 when it proves nothing)."""
    if hit_rate - delta <= 0:
        return 0.0
    if false_rate <= 0:
        return math.inf
    return max(0.0, math.log((hit_rate - delta) / false_rate))


@dataclass(frozen=True)
class Decision:
    """A decision rule on scores: ``direction`` +1 says "in" when score ≥ τ, −1 when score ≤ τ."""

    statistic: str
    direction: int
    threshold: float


@dataclass(frozen=True)
class Bound:
    """The lower bound one test proves on a set of trials, with the counts behind it."""

    epsilon: float  # the rigorous lower bound at ``confidence``
    confidence: float
    hits: int  # trials of the numerator's world the test flags ("in" trials flagged in for direction +1)
    hit_trials: int
    false_alarms: int  # trials of the other world it flags
    false_trials: int
    hit_rate_lower: float
    false_rate_upper: float


def _flagged(scores: np.ndarray, test: Decision) -> np.ndarray:
    return scores >= test.threshold if test.direction > 0 else scores <= test.threshold


def bound_of(scores: np.ndarray, labels: np.ndarray, test: Decision, delta: float, confidence: float) -> Bound:
    """The bound ``test`` proves on these trials (``labels`` True: canary in).

    Direction +1 bounds log((TPR − δ)/FPR) (flag = "in"); direction −1 bounds
    log((TNR − δ)/FNR) (flag = "out").
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    alpha = (1 - confidence) / 2
    flagged = _flagged(scores, test)
    numerator_world = labels if test.direction > 0 else ~labels
    hits, hit_trials = int(flagged[numerator_world].sum()), int(numerator_world.sum())
    false_alarms, false_trials = int(flagged[~numerator_world].sum()), int((~numerator_world).sum())
    hit_lower, _ = clopper_pearson(hits, hit_trials, alpha)
    _, false_upper = clopper_pearson(false_alarms, false_trials, alpha)
    return Bound(epsilon_from_rates(hit_lower, false_upper, delta), confidence, hits, hit_trials, false_alarms,
                 false_trials, hit_lower, false_upper)


def select_decision(statistics: dict[str, np.ndarray], labels: np.ndarray, delta: float, confidence: float,
                    scale: float = 1.0) -> Decision:
    """The statistic, direction and threshold with the largest bound on these (calibration) trials.

    ``scale`` is how many times more trials the bound will be computed on: the
    counts are scaled by it, so the choice favours the thresholds whose rare
    events that many trials can measure. Candidate thresholds are the trials'
    own scores (at most :data:`MAX_THRESHOLDS` of them, spread over the
    range). Ties go to the first statistic given.
    """
    labels = np.asarray(labels, dtype=bool)
    alpha = (1 - confidence) / 2
    best, best_epsilon = None, -1.0
    for name, scores in statistics.items():
        scores = np.asarray(scores, dtype=np.float64)
        for direction in (1, -1):
            signed = direction * scores
            positives = np.sort(signed[labels if direction > 0 else ~labels])
            negatives = np.sort(signed[~labels if direction > 0 else labels])
            if not len(positives) or not len(negatives):
                continue
            candidates = np.unique(signed)
            if len(candidates) > MAX_THRESHOLDS:
                candidates = candidates[np.linspace(0, len(candidates) - 1, MAX_THRESHOLDS).astype(int)]
            n_pos, n_neg = scale * len(positives), scale * len(negatives)
            hits = scale * (len(positives) - np.searchsorted(positives, candidates, side="left"))
            falses = scale * (len(negatives) - np.searchsorted(negatives, candidates, side="left"))
            hit_lower = np.where(hits > 0, beta.ppf(alpha, np.maximum(hits, 1), n_pos - hits + 1), 0.0)
            false_upper = np.where(falses < n_neg, beta.ppf(1 - alpha, falses + 1, np.maximum(n_neg - falses, 1)), 1.0)
            with np.errstate(divide="ignore", invalid="ignore"):
                epsilons = np.where((hit_lower > delta) & (hits >= scale * MIN_CALIBRATION_HITS),
                                    np.log((hit_lower - delta) / false_upper), 0.0)
            index = int(np.argmax(epsilons))
            if epsilons[index] > best_epsilon:
                best_epsilon = float(epsilons[index])
                best = Decision(name, direction, float(direction * candidates[index]))
    if best is None:
        raise ValueError("select_decision needs trials of both worlds (canary in and canary out)")
    return best


def gdp_mu(true_positive_rate: float, false_positive_rate: float) -> float:
    """μ = Φ⁻¹(1 − FPR) − Φ⁻¹(1 − TPR): the μ of the Gaussian-DP trade-off through this point (≥ 0)."""
    clipped = [min(max(r, 1e-12), 1 - 1e-12) for r in (true_positive_rate, false_positive_rate)]
    return max(0.0, float(ndtri(1 - clipped[1]) - ndtri(1 - clipped[0])))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The ε at which μ-GDP is (ε, δ)-DP (Dong, Roth & Su 2022, Corollary 2.13): the root of
    δ = Φ(−ε/μ + μ/2) − e^ε·Φ(−ε/μ − μ/2)."""
    if mu <= 0:
        return 0.0

    def gap(epsilon: float) -> float:
        return float(ndtr(-epsilon / mu + mu / 2) - math.exp(epsilon) * ndtr(-epsilon / mu - mu / 2)) - delta

    if gap(0.0) <= 0:
        return 0.0
    upper = 1.0
    while gap(upper) > 0:
        upper *= 2
    return float(brentq(gap, 0.0, upper, xtol=1e-10))


def gdp_estimate(scores: np.ndarray, labels: np.ndarray, decision: Decision, delta: float) -> tuple[float, float]:
    """(μ̂, ε(δ) of μ̂-GDP) of ``decision`` on these trials (held out from its choice): an estimate, not a bound.

    μ̂ = Φ⁻¹(1 − FPR) − Φ⁻¹(1 − TPR) at the decision's own threshold, a rate of 0 or 1 read as half a
    trial from the edge. Not the largest μ̂ over thresholds: over thousands of them the largest is a far-tail point
    chosen for its luck, and a subsampled mechanism's trade-off curve is not Gaussian, so its tail's μ exceeds
    the μ of the test (``tests/test_audit.py`` shows the largest over-reading a mixture by more than 0.5).
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    in_world = labels if decision.direction > 0 else ~labels
    if in_world.all() or not in_world.any():
        return 0.0, 0.0
    flagged = _flagged(scores, decision)
    floor = 0.5 / min(int(in_world.sum()), int((~in_world).sum()))
    tpr = min(max(float(flagged[in_world].mean()), floor), 1 - floor)
    fpr = min(max(float(flagged[~in_world].mean()), floor), 1 - floor)
    mu = gdp_mu(tpr, fpr)
    return mu, gdp_epsilon(mu, delta)
