"""``fedhog audit``: run a config's mechanism with canaries, score them, bound ε, write the results.

The orchestration only: which code runs is :mod:`fedhog.auditing.harness`,
what the attacker computes is :mod:`fedhog.privacy.audit.attacks`, the bound is
:mod:`fedhog.privacy.audit.bounds`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..aggregators import aggregator_of
from ..choices import TERM_MECHANISMS
from ..config import ConfigError, RunConfig, load_config
from ..privacy.audit import attacks, bounds
from . import harness

DEFAULT_RUNS = 4
DEFAULT_CONFIDENCE = 0.95
DEFAULT_CANARY_NORM = 100.0  # in units of C: far beyond any clipping norm, so that clipping is what bounds it
MAX_CANARIES = {"vectorized": 2_000_000, "strategy": 20_000, "secure": 20_000, "flower-dp": 5_000, "dpsgd": 20_000}
DEFAULT_CANARIES = {"vectorized": 100_000, "strategy": 2_000, "secure": 2_000, "flower-dp": 1_000, "dpsgd": 2_000}
CALIBRATION_SHARE = 5  # every 5th trial chooses the test; the other 4 of 5 bound ε with it
# the audit reads each release off the model, so the server steps by it unchanged (any other step is post-processing)
AUDIT_OVERRIDES = {"server-optimizer": "sgd", "server-learning-rate": 1.0, "server-step": "none",
                   "max-epsilon": math.inf, "metrics-port": -1, "results-dir": "", "resume": False}


@dataclass(frozen=True)
class ThreatModelResult:
    """What one threat model's attacker proved and estimated."""

    threat_model: str
    epsilon_lower_bound: float
    statistic: str
    direction: int
    threshold: float
    hits: int
    hit_trials: int
    false_alarms: int
    false_trials: int
    gdp_mu_estimate: float
    epsilon_estimate_gdp: float


@dataclass(frozen=True)
class AuditResult:
    """An audit's figures (``to_json`` is what ``fedhog audit --json`` prints)."""

    mechanism: str
    harness: str
    relation: str
    epsilon_accounted: float
    delta: float
    confidence: float
    threat_model: str  # the one ``epsilon_lower_bound`` refers to
    epsilon_lower_bound: float
    epsilon_estimate_gdp: float
    runs: int
    canaries_per_run: int
    rounds: int
    inclusion_rate: float
    noise_multiplier: float
    canary_norm: float
    seconds: float
    threat_models: dict[str, ThreatModelResult] = field(default_factory=dict)
    results_dir: str = ""

    @property
    def violated(self) -> bool:
        """Whether the audit proved more ε than the accountant reports: the mechanism is broken (at ``confidence``)."""
        return self.epsilon_lower_bound > self.epsilon_accounted

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types; ∞ as the string "inf"."""
        def clean(value: Any) -> Any:
            if isinstance(value, float) and math.isinf(value):
                return "inf" if value > 0 else "-inf"
            if isinstance(value, dict):
                return {k: clean(v) for k, v in value.items()}
            return value
        return clean({**asdict(self), "violated": self.violated})


def mechanism_name(config: RunConfig) -> str:
    """A short name of what is audited: ``gaussian/poisson``, ``hog/fixed``, ``secagg+/distributed``, ..."""
    if config.client_dp == "dpsgd":
        return "dpsgd (record-level)"
    if aggregator_of(config).audit_harness is not None:  # a baseline, audited as a whole
        return config.aggregator
    name = config.mechanism + (f" ({config.hog_term} term)" if config.mechanism in TERM_MECHANISMS else "")
    name += f"/{config.sampling}"
    if config.adaptive_clipping:
        name += "/adaptive-clipping"
    if config.secure_aggregation != "off":
        name += f"/secagg+ {config.noise} noise"
    return name


def prepare(config: str | Path | Mapping[str, Any] | RunConfig | None, overrides: Mapping[str, Any]) -> RunConfig:
    """The config as the audit runs it: validated, σ calibrated, the server stepping by the releases."""
    if isinstance(config, RunConfig):
        config = {k: v for k, v in config.to_mapping().items()
                  if not (k == "noise-multiplier" and config.target_epsilon > 0)}
    if isinstance(config, Mapping):
        config = {k.replace("_", "-"): v for k, v in config.items()}
    loaded = load_config(config, {k.replace("_", "-"): v for k, v in overrides.items()})
    return loaded.with_overrides(AUDIT_OVERRIDES).calibrated()


def audit(config: str | Path | Mapping[str, Any] | RunConfig | None = None, *, runs: int = DEFAULT_RUNS,
          canaries: int = 0, confidence: float = DEFAULT_CONFIDENCE, threat_model: str = "every-round",
          canary_norm: float = DEFAULT_CANARY_NORM, results_dir: str | Path | None = None,
          harness_name: str = "vectorized", strategy_hook: harness.StrategyHook | None = None,
          **overrides: Any) -> AuditResult:
    """Audit a config's mechanism: an empirical lower bound on ε, next to the ε its accountant reports.

    Parameters
    ----------
    config : path, mapping, RunConfig or None
        As for :func:`fedhog.run`; ``**overrides`` are config keys.
    runs : int
        Independent runs; every run has ``canaries`` canaries (trials).
    canaries : int
        Canaries (trials) per run; 0: :data:`DEFAULT_CANARIES` of the harness (the
        strategy's, secure aggregation's and Flower's: at most the population). Records of one DP-SGD
        client under ``client-dp = "dpsgd"``; a multiple of the population for fixed-size sampling on
        the vectorized harness.
    confidence : float
        1 − α of the lower bound.
    threat_model : {"every-round", "final-model"}
        Which attacker ``epsilon_lower_bound`` reports; both are computed.
    canary_norm : float
        A canary's update length in units of the clipping norm (DP-SGD: fixed by the records).
    results_dir : path, optional
        Write ``audit.json`` and ``scores.png`` there (a new folder, or an empty one).
    harness_name : {"vectorized", "strategy"}
        How a trusted-server config runs (:mod:`fedhog.audit.harness`); other configs have one harness.
    strategy_hook : callable, optional
        Called with each run's strategy before it starts (tests break mechanisms with it).
    """
    started = time.perf_counter()
    if threat_model not in attacks.THREAT_MODELS:
        raise ConfigError(f"threat-model={threat_model!r} is not allowed; expected one of "
                          f"{', '.join(attacks.THREAT_MODELS)}")
    if not (isinstance(runs, int) and runs >= 1):
        raise ConfigError(f"runs={runs!r} is not allowed; expected an integer ≥ 1")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence={confidence!r} is not allowed; expected a number in (0, 1)")
    if not (math.isfinite(canary_norm) and canary_norm > 0):
        raise ConfigError(f"canary-norm={canary_norm!r} is not allowed; expected a finite number > 0")
    if harness_name not in ("vectorized", "strategy"):
        raise ConfigError(f"harness={harness_name!r} is not allowed; expected vectorized or strategy")
    resolved = prepare(config, overrides)
    kind = harness.harness_of(resolved, harness_name)
    if kind != "dpsgd" and not resolved.privacy_mechanism.has_guarantee:
        raise ConfigError(f"mechanism={resolved.mechanism!r} with noise-multiplier={resolved.noise_multiplier:g} has "
                          "no DP guarantee (ε = ∞): there is no accounted ε to audit; expected mechanism 'gaussian' "
                          "or 'hog' with noise")
    count, limit = canaries, MAX_CANARIES[kind]
    if kind in ("strategy", "secure", "flower-dp"):  # every canary is a client of the population
        limit = min(limit, resolved.population)
    if count == 0:
        count = min(DEFAULT_CANARIES[kind], limit)
        if kind == "vectorized" and resolved.sampling == "fixed":
            count = max(1, count // resolved.population) * resolved.population
    if not (isinstance(count, int) and 2 <= count <= limit):
        raise ConfigError(f"canaries={count!r} is not allowed; expected an integer in 2..{limit} "
                          + ("(records of the DP-SGD client)" if kind == "dpsgd" else
                             "(at most the population: every canary is a client)" if limit < MAX_CANARIES[kind]
                             else ""))
    if kind == "vectorized" and resolved.sampling == "fixed" and count % resolved.population:
        raise ConfigError(f"canaries={count} is not allowed with sampling=\"fixed\"; expected a multiple of "
                          f"population={resolved.population} (each group of canaries is sampled as one population)")
    directory = _claim(results_dir)
    rng = np.random.default_rng()  # which canaries are in: the audit's randomness, not the mechanism's
    norm = canary_norm * (resolved.dpsgd_max_grad_norm if kind == "dpsgd" else resolved.clipping_norm)
    run = harness.HARNESSES[kind]
    outcomes = [run(resolved, harness.CanarySet.draw(count, norm, rng), strategy_hook) for _ in range(runs)]
    observation = attacks.Observation.concatenate([o.observation for o in outcomes])
    delta = resolved.dpsgd_delta if kind == "dpsgd" else resolved.delta
    results = {model: evaluate(observation, model, delta, confidence) for model in attacks.THREAT_MODELS}
    chosen = results[threat_model]
    result = AuditResult(
        mechanism=mechanism_name(resolved), harness=kind, relation=observation.relation,
        epsilon_accounted=float(outcomes[0].epsilon), delta=delta, confidence=confidence, threat_model=threat_model,
        epsilon_lower_bound=chosen.epsilon_lower_bound, epsilon_estimate_gdp=chosen.epsilon_estimate_gdp,
        runs=runs, canaries_per_run=count, rounds=observation.along.shape[0],
        inclusion_rate=observation.inclusion_rate,
        noise_multiplier=resolved.dpsgd_noise_multiplier if kind == "dpsgd" else resolved.noise_multiplier,
        canary_norm=norm, seconds=time.perf_counter() - started, threat_models=results,
        results_dir=str(directory) if directory else "")
    if directory is not None:
        _write(directory, result, observation)
    return result


def evaluate(observation: attacks.Observation, threat_model: str, delta: float,
             confidence: float) -> ThreatModelResult:
    """Choose the attacker's test on every 5th trial; bound ε and estimate μ-GDP with it on the others."""
    scores = attacks.statistics(observation, threat_model)
    labels = observation.labels
    index = np.arange(len(labels))
    calibration, held_out = index[index % CALIBRATION_SHARE == 0], index[index % CALIBRATION_SHARE != 0]
    decision = bounds.select_decision({k: v[calibration] for k, v in scores.items()}, labels[calibration],
                                      delta, confidence, len(held_out) / max(len(calibration), 1))
    bound = bounds.bound_of(scores[decision.statistic][held_out], labels[held_out], decision, delta, confidence)
    mu, estimate = bounds.gdp_estimate(scores[decision.statistic][held_out], labels[held_out], decision, delta)
    return ThreatModelResult(threat_model, bound.epsilon, decision.statistic, decision.direction,
                             decision.threshold, bound.hits, bound.hit_trials, bound.false_alarms,
                             bound.false_trials, mu, estimate)


def _claim(results_dir: str | Path | None) -> Path | None:
    if results_dir is None or str(results_dir) == "":
        return None
    directory = Path(results_dir).expanduser().absolute()
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise ConfigError(f"results-dir={str(directory)!r} is not allowed: it is not an empty folder; "
                          "expected a new or empty folder for audit.json and scores.png")
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _write(directory: Path, result: AuditResult, observation: attacks.Observation) -> None:
    """``audit.json`` (the result) and ``scores.png`` (the chosen statistics' scores, canaries in vs out)."""
    from ..files import atomic_write

    atomic_write(directory / "audit.json", (json.dumps(result.to_json(), indent=2) + "\n").encode())
    plot_scores(directory / "scores.png", result, observation)


def plot_scores(path: Path, result: AuditResult, observation: attacks.Observation) -> None:
    """Histograms of each threat model's chosen statistic, included vs excluded canaries, with its threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(result.threat_models), figsize=(5.5 * len(result.threat_models), 3.6))
    for axis, (model, outcome) in zip(np.atleast_1d(axes), result.threat_models.items(), strict=True):
        scores = attacks.statistics(observation, model)[outcome.statistic]
        finite = scores[np.isfinite(scores)]
        edges = np.histogram_bin_edges(finite, bins=60) if len(finite) else 10
        axis.hist(scores[observation.labels], bins=edges, alpha=0.6, label="canary in", density=True)
        axis.hist(scores[~observation.labels], bins=edges, alpha=0.6, label="canary out", density=True)
        axis.axvline(outcome.threshold, color="black", linestyle="--", linewidth=1, label="threshold")
        axis.set_yscale("log")
        axis.set_title(f"{model}: {outcome.statistic}\nε ≥ {outcome.epsilon_lower_bound:.3g} "
                       f"(accounted {result.epsilon_accounted:.3g})", fontsize=9)
        axis.set_xlabel("score")
        axis.legend(fontsize=7)
    figure.suptitle(f"{result.mechanism}: {result.runs} runs × {result.canaries_per_run} canaries", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
