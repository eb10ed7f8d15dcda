"""The privacy audit: its mathematics against independent references, and that it can fail.

The broken mechanisms live here only. Each is fedhog's own code with one
fault put in (by wrapping the real function or hooking the real strategy),
and the audit must prove more ε than the accountant reports for every one;
the real mechanisms, audited the same way, must not exceed it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest
import torch
from scipy.stats import binom

from fedhog.auditing import harness, runner
from fedhog.config import ConfigError
from fedhog.privacy import mechanism
from fedhog.privacy.audit import attacks, bounds

logging.getLogger("flwr").setLevel(logging.WARNING)

# Small enough for CI (each audit takes a few seconds on one core), large enough to catch every fault.
SMALL = {"population": 1000, "sampling-rate": 0.1, "rounds": 5, "mechanism": "gaussian", "target-epsilon": 2.0}


def small_audit(runs: int = 1, canaries: int = 10_000, **overrides):
    return runner.audit({**SMALL, **{k.replace("_", "-"): v for k, v in overrides.pop("config", {}).items()}},
                        runs=runs, canaries=canaries, **overrides)


# --- the mathematics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("successes, trials", [(0, 10), (3, 10), (10, 10), (17, 1000), (500, 1000)])
def test_clopper_pearson_matches_the_binomial_tails(successes, trials):
    """The lower bound p solves P[Bin(n, p) ≥ k] = α, the upper P[Bin(n, p) ≤ k] = α (independent: scipy's binom)."""
    alpha = 0.025
    lower, upper = bounds.clopper_pearson(successes, trials, alpha)
    if successes > 0:
        assert binom.sf(successes - 1, trials, lower) == pytest.approx(alpha, rel=1e-6)
    else:
        assert lower == 0.0
    if successes < trials:
        assert binom.cdf(successes, trials, upper) == pytest.approx(alpha, rel=1e-6)
    else:
        assert upper == 1.0


@pytest.mark.parametrize("sigma", [0.7, 1.0, 2.0])
def test_gdp_epsilon_agrees_with_the_pld_accountant(sigma):
    """ε(δ) of μ-GDP with μ = 1/σ is the Gaussian mechanism's: dp_accounting's PLD says the same."""
    from dp_accounting import pld

    delta = 1e-5
    reference = pld.privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=1e-4).get_epsilon_for_delta(delta)
    assert bounds.gdp_epsilon(1 / sigma, delta) == pytest.approx(reference, abs=2e-3)


def _gaussian_trials(mu: float, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.random(n) < 0.5
    return rng.standard_normal(n) + mu * labels, labels


def test_the_bound_stays_below_the_true_epsilon_and_has_power():
    """On scores of an exact μ-GDP mechanism the rigorous bound is below its ε and above half of it."""
    rng = np.random.default_rng(7)
    mu, delta = 1.5, 1e-5
    scores, labels = _gaussian_trials(mu, 200_000, rng)
    observation = attacks.Observation(scores[None], np.zeros((1, len(scores))), np.array([mu]), labels, 1.0,
                                      "add-remove")
    result = runner.evaluate(observation, "final-model", delta, 0.95)
    truth = bounds.gdp_epsilon(mu, delta)
    assert 0.5 * truth < result.epsilon_lower_bound < truth
    assert result.epsilon_estimate_gdp == pytest.approx(truth, rel=0.25)


def test_the_gdp_estimate_is_read_at_the_tests_own_threshold_not_the_luckiest_one():
    """A canary that moves its score by 2 one time in ten (subsampled: its trade-off curve is no Gaussian's).

    At the test's threshold μ̂ is that threshold's exact μ; the largest μ̂ over thousands of thresholds (the old
    rule) reads a far tail, more than 0.5 larger. The audit reads μ̂ with its chosen test on the held-out trials.
    """
    from scipy.special import ndtr, ndtri

    rng = np.random.default_rng(11)
    n, q, shift, threshold = 200_000, 0.1, 2.0, 1.0
    labels = rng.random(n) < 0.5
    scores = rng.standard_normal(n) + shift * (labels & (rng.random(n) < q))
    mu, epsilon = bounds.gdp_estimate(scores, labels, bounds.Decision("s", 1, threshold), 1e-5)
    fpr = ndtr(-threshold)
    exact = ndtri(1 - fpr) - ndtri(1 - ((1 - q) * fpr + q * ndtr(shift - threshold)))
    assert mu == pytest.approx(exact, abs=0.05) and epsilon == pytest.approx(bounds.gdp_epsilon(mu, 1e-5))
    inside, outside = np.sort(scores[labels]), np.sort(scores[~labels])
    candidates = np.quantile(scores, np.linspace(0, 1, 4000))
    hits = len(inside) - np.searchsorted(inside, candidates)
    falses = len(outside) - np.searchsorted(outside, candidates)
    usable = (hits >= 100) & (falses >= 100)
    largest = max(bounds.gdp_mu(h / len(inside), f / len(outside))
                  for h, f in zip(hits[usable], falses[usable], strict=True))
    assert largest > mu + 0.5

    observation = attacks.Observation(scores[None], np.zeros((1, n)), np.array([shift]), labels, 1.0, "add-remove")
    result = runner.evaluate(observation, "final-model", 1e-5, 0.95)
    held_out = np.arange(n) % runner.CALIBRATION_SHARE != 0
    decision = bounds.Decision("final-sum", result.direction, result.threshold)
    assert (result.gdp_mu_estimate, result.epsilon_estimate_gdp) == bounds.gdp_estimate(
        scores[held_out], labels[held_out], decision, 1e-5)


def test_the_bound_is_zero_when_nothing_leaks():
    rng = np.random.default_rng(8)
    scores, labels = _gaussian_trials(0.0, 50_000, rng)
    decision = bounds.select_decision({"s": scores[::2]}, labels[::2], 1e-5, 0.95)
    assert bounds.bound_of(scores[1::2], labels[1::2], decision, 1e-5, 0.95).epsilon < 0.2


def test_the_likelihood_ratio_is_the_subsampled_gaussian_one():
    """Against a direct evaluation of Π_t ((1 − q)φ(z) + qφ(z − a)) / φ(z)."""
    rng = np.random.default_rng(9)
    z, q, a = rng.standard_normal((4, 3)), 0.2, np.array([0.5, 1.0, 1.5, 2.0])
    observation = attacks.Observation(z, z, a, np.array([True, False, True]), q, "add-remove")
    phi = lambda x: np.exp(-x ** 2 / 2)  # noqa: E731
    direct = np.log(((1 - q) * phi(z) + q * phi(z - a[:, None])) / phi(z)).sum(axis=0)
    np.testing.assert_allclose(attacks.likelihood_ratio(observation), direct, rtol=1e-10)


# --- the vectorized harness is the strategy's computation ---------------------------------------------------
@pytest.mark.parametrize("config", [
    {},
    {"mechanism": "hog"},
    {"adaptive-clipping": True},
    pytest.param({"sampling": "fixed", "target-epsilon": -1.0, "noise-multiplier": 1.2},
                 marks=pytest.mark.slow),  # RDP without replacement, every round of the strategy: ~7 s
])
def test_the_vectorized_harness_releases_what_the_strategy_releases(config):
    """With a fixed privacy seed both draw the same cohorts, ξ and noise: the releases must agree.

    The strategy runs its own round loop with one reply per canary (validation, ``aggregate``, the server
    step on a float32 model); the vectorized harness batches the canaries' blocks. Equal observations
    mean the fast path audits the code the runs execute.
    """
    resolved = runner.prepare({**SMALL, "population": 200, "rounds": 3, "privacy-seed": 5, **config}, {})
    canaries = harness.CanarySet.draw(200, 100.0, np.random.default_rng(3))
    batched = harness.run_batched(resolved, canaries).observation
    strategy = harness.run_trusted(resolved, canaries).observation
    np.testing.assert_allclose(batched.along, strategy.along, atol=1e-3)
    np.testing.assert_allclose(batched.across, strategy.across, atol=1e-3)
    np.testing.assert_allclose(batched.signal, strategy.signal, rtol=1e-9)
    assert np.abs(batched.along).max() > 1  # not two empty observations


# --- the real mechanisms are not flagged -------------------------------------------------------------------
@pytest.mark.parametrize("config", [
    {},
    {"sampling": "fixed", "target-epsilon": -1.0, "noise-multiplier": 1.2},  # no calibration: RDP without
    {"mechanism": "hog"},                                                  # replacement costs seconds
    {"adaptive-clipping": True},
])
def test_real_trusted_mechanisms_stay_within_their_accounted_epsilon(config):
    result = small_audit(config=config, canaries=5_000 if config.get("sampling") == "fixed" else 20_000)
    assert result.harness == "vectorized"
    for outcome in result.threat_models.values():
        assert outcome.epsilon_lower_bound <= result.epsilon_accounted
    assert not result.violated


def test_the_audit_has_power_on_the_real_gaussian_mechanism():
    """Not only silent: with 100 000 trials of 3 releases the bound on the real mechanism is a share of ε.

    Through the Python entry point ``fedhog.audit``. (The README's figures, with ten times the trials, reach
    more than half of ε; this checks that the bound is not vacuous, with a margin for the selection's luck.)
    """
    import fedhog

    result = fedhog.audit({**SMALL, "sampling-rate": 0.5, "rounds": 3}, runs=1, canaries=100_000)
    best = max(o.epsilon_lower_bound for o in result.threat_models.values())
    assert 0.2 * result.epsilon_accounted < best <= result.epsilon_accounted


@pytest.mark.parametrize("config, harness_name", [
    ({"population": 200}, "strategy"),
    ({"population": 200, "secure-aggregation": "secagg+"}, "vectorized"),
    ({"population": 200, "secure-aggregation": "secagg+", "noise": "distributed", "sampling": "fixed"}, "vectorized"),
    ({"population": 200, "aggregator": "flower-dp", "sampling": "fixed", "accountant": "rdp"}, "vectorized"),
])
def test_real_end_to_end_and_mechanism_level_paths_stay_within(config, harness_name):
    result = small_audit(config=config, canaries=0, harness_name=harness_name)
    assert result.harness == {"strategy": "strategy"}.get(harness_name, result.harness)
    assert result.canaries_per_run == 200
    assert not result.violated


@pytest.mark.slow  # Opacus's import and hooks: ~5 s
def test_real_dpsgd_stays_within_its_record_level_epsilon():
    result = small_audit(config={"client-dp": "dpsgd", "target-epsilon": -1.0, "dpsgd-noise-multiplier": 1.0,
                                 "batch-size": 50}, canaries=500)
    assert result.harness == "dpsgd" and math.isfinite(result.epsilon_accounted)
    assert not result.violated


# --- broken mechanisms are flagged ---------------------------------------------------------------------------
def _violated(result) -> bool:
    return max(o.epsilon_lower_bound for o in result.threat_models.values()) > result.epsilon_accounted


def test_noise_a_tenth_of_what_the_accountant_is_told_is_flagged():
    def weaker_noise(strategy):
        strategy.mechanism = dataclasses.replace(strategy.mechanism,
                                                 noise_multiplier=strategy.mechanism.noise_multiplier / 10)

    assert _violated(small_audit(strategy_hook=weaker_noise))


def test_weaker_noise_is_flagged_end_to_end_through_the_strategy():
    def weaker_noise(strategy):
        strategy.mechanism = dataclasses.replace(strategy.mechanism,
                                                 noise_multiplier=strategy.mechanism.noise_multiplier / 10)

    result = small_audit(config={"population": 2000, "sampling-rate": 0.2}, canaries=0, harness_name="strategy",
                         strategy_hook=weaker_noise)
    assert result.harness == "strategy" and _violated(result)


def test_no_clipping_is_flagged(monkeypatch):
    real = mechanism.GaussianMechanism.constrain_sensitivity

    def unclipped(self, updates, terms, xis):
        return real(dataclasses.replace(self, clipping_norm=math.inf), updates, terms, xis)

    monkeypatch.setattr(mechanism.GaussianMechanism, "constrain_sensitivity", unclipped)
    assert _violated(small_audit())


def test_noise_reused_across_rounds_is_flagged(monkeypatch):
    real, drawn = mechanism.GaussianMechanism.add_noise, {}

    def reused(self, levels, lattice, bits, contributors):
        if lattice.dimension not in drawn:  # the first round's noise, again every round
            drawn[lattice.dimension] = real(self, torch.zeros_like(levels), lattice, bits, contributors)
        noise, std = drawn[lattice.dimension]
        return levels.to(torch.float64) * lattice.granularity + noise, std

    monkeypatch.setattr(mechanism.GaussianMechanism, "add_noise", reused)
    result = small_audit()
    assert _violated(result) and result.threat_models["every-round"].statistic == "centred-sum"


def test_the_same_noise_on_every_coordinate_pair_is_flagged(monkeypatch):
    real = mechanism.GaussianMechanism.add_noise

    def paired(self, levels, lattice, bits, contributors):
        half = dataclasses.replace(lattice, dimension=lattice.dimension // 2)
        noise, std = real(self, torch.zeros(half.dimension, dtype=torch.int64), half, bits, contributors)
        return levels.to(torch.float64) * lattice.granularity + noise.repeat_interleave(2), std

    monkeypatch.setattr(mechanism.GaussianMechanism, "add_noise", paired)
    assert _violated(small_audit())


def test_a_leaked_per_client_norm_is_flagged(monkeypatch):
    """HOG mixing done after clipping with the raw ‖Δ‖: the term's length carries each client's norm."""
    def mixed_after_clipping(self, updates, terms, xis):
        clip_only = mechanism.GaussianMechanism(self.clipping_norm, self.noise_multiplier)
        rows, stats = clip_only.constrain_sensitivity(updates, None, xis)
        raw = torch.linalg.vector_norm(updates.to(torch.float64), dim=1, keepdim=True)
        unit = terms.to(torch.float64) / torch.linalg.vector_norm(terms.to(torch.float64), dim=1, keepdim=True)
        return rows + self.mixing_strength * xis.to(torch.float64)[:, None] * raw * unit, stats

    monkeypatch.setattr(mechanism.HogMechanism, "constrain_sensitivity", mixed_after_clipping)
    assert _violated(small_audit(config={"mechanism": "hog"}))


def test_weaker_server_noise_under_secure_aggregation_is_flagged():
    def weaker_noise(strategy):
        strategy.mechanism = dataclasses.replace(strategy.mechanism,
                                                 noise_multiplier=strategy.mechanism.noise_multiplier / 10)

    result = small_audit(config={"population": 2000, "sampling-rate": 0.2, "secure-aggregation": "secagg+"},
                         canaries=0, strategy_hook=weaker_noise)
    assert result.harness == "secure" and _violated(result)


@pytest.mark.slow  # the discrete Gaussian shares of 250 clients a round: ~5 s
def test_clients_adding_a_hundredth_of_their_noise_share_is_flagged():
    """Distributed noise: the clients' shares, drawn by the plan's own sampler, with σ_l/100."""
    def weaker_shares(strategy):
        plan = strategy.secure_aggregation.noise
        weaker = dataclasses.replace(plan, local_std=plan.local_std / 100)
        strategy.secure_aggregation = dataclasses.replace(strategy.secure_aggregation, noise=weaker)

    result = small_audit(config={"population": 500, "secure-aggregation": "secagg+", "noise": "distributed",
                                 "sampling": "fixed", "sampling-rate": 0.5}, canaries=0, strategy_hook=weaker_shares)
    assert result.harness == "secure" and _violated(result)


# --- the edges ----------------------------------------------------------------------------------------------
def test_bad_options_are_refused_naming_them(tmp_path):
    with pytest.raises(ConfigError, match="runs=0"):
        small_audit(runs=0)
    with pytest.raises(ConfigError, match=r"mechanism='none'.*no DP guarantee"):
        small_audit(config={"mechanism": "none", "target-epsilon": -1.0})
    with pytest.raises(ConfigError, match="threat-model='everything'"):
        small_audit(threat_model="everything")
    with pytest.raises(ConfigError, match="canaries=3001"):
        small_audit(config={"sampling": "fixed", "target-epsilon": -1.0, "noise-multiplier": 1.2}, canaries=3001)
    (tmp_path / "other").write_text("x")
    with pytest.raises(ConfigError, match="results-dir"):
        small_audit(results_dir=tmp_path)


@pytest.mark.slow  # the CLI's imports and the quickstart's calibration: ~8 s
def test_the_cli_prints_one_json_object_and_writes_the_results(tmp_path, capsys):
    from fedhog.cli import main

    code = main(["audit", "--set", "population=500", "--set", "rounds=3", "--set", "mechanism=\"gaussian\"",
                 "--runs", "1", "--canaries", "5000", "--json", "--output", str(tmp_path / "audit")])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    for key in ("epsilon_lower_bound", "epsilon_accounted", "confidence", "threat_model"):
        assert key in document
    assert document["threat_model"] == "every-round" and document["confidence"] == 0.95
    assert set(document["threat_models"]) == {"every-round", "final-model"}
    assert json.loads((tmp_path / "audit" / "audit.json").read_text())["mechanism"] == "gaussian/poisson"
    assert (tmp_path / "audit" / "scores.png").stat().st_size > 0
