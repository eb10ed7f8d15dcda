"""Distributed noise (noise = "distributed"): the sampler, the accountant, the lattice and whole secure rounds.

The sampler is tested against the exact pmf of N_ℤ(0, σ²); the accountant
against closed forms and dp_accounting's Gaussian RDP; the rounds against
what the server holds (masked vectors, then a sum that is not the exact one).
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from helpers import read_metrics
from scipy import stats
from test_secure_aggregation import CLIP, DIMENSION, DroppingGrid, _contributions, _secure_app

from fedhog import protocol
from fedhog.client_app import app as fedhog_client_app
from fedhog.config import ConfigError, RunConfig
from fedhog.privacy.distributed_gaussian import (
    ORDERS,
    DdgAccounting,
    ddg_rdp,
    l1_sensitivity,
    log_tau,
)
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SecureBits, SeededBits, discrete_gaussian, sampler_log_ratio_bound
from fedhog.privacy.sampler_slack import sampler_label, sampler_slack
from fedhog.secure_aggregation.distributed_noise import DistributedNoise, plan_distributed_noise
from fedhog.secure_aggregation.quantization import WRAP_STDS, ModularLattice
from fedhog.secure_aggregation.server import SecAggSettings, SecureAggregationFailed, secure_sum
from fedhog.server_app import app as server_app
from fedhog.strategy import SecureAggregator

ALPHA = 1e-6
DRAWS = 200_000


# --- the sampler ----------------------------------------------------------------------------------------------
def _pmf(sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """The exact pmf of N_ℤ(0, σ²) on a window of ±(12σ + 10): the mass beyond is below 1e-30."""
    support = np.arange(-int(12 * sigma) - 10, int(12 * sigma) + 11)
    weights = np.exp(-support.astype(np.float64) ** 2 / (2 * sigma**2))
    return support, weights / weights.sum()


def _chi_square_pvalue(draws: np.ndarray, sigma: float) -> float:
    """Chi-square of the draws against N_ℤ(0, σ²), the tails pooled so that every cell expects ≥ 20."""
    support, pmf = _pmf(sigma)
    expected = pmf * draws.size
    inner = support[expected >= 20]
    low, high = int(inner.min()), int(inner.max())
    observed = np.concatenate([[np.sum(draws < low)], np.bincount(draws[(draws >= low) & (draws <= high)] - low,
                                                                 minlength=high - low + 1), [np.sum(draws > high)]])
    cells = np.concatenate([[pmf[support < low].sum()], pmf[(support >= low) & (support <= high)],
                            [pmf[support > high].sum()]]) * draws.size
    return float(stats.chisquare(observed, cells).pvalue)


@pytest.mark.parametrize("sigma", [0.7, 3.0, 40.0])
def test_discrete_gaussian_follows_the_exact_pmf_and_variance(sigma):
    draws = discrete_gaussian(SeededBits(11), DRAWS, sigma)
    assert draws.dtype == np.int64 and draws.shape == (DRAWS,)
    assert _chi_square_pvalue(draws, sigma) > ALPHA
    support, pmf = _pmf(sigma)
    variance = float(np.sum(pmf * support**2.0))  # below σ² for small σ (0.489 at σ = 0.7), ≈ σ² beyond
    fourth = float(np.sum(pmf * support**4.0))
    tolerance = stats.norm.isf(ALPHA / 2) * math.sqrt((fourth - variance**2) / DRAWS)
    assert abs(float(np.mean(draws.astype(np.float64) ** 2)) - variance) < tolerance
    assert abs(float(draws.mean())) < stats.norm.isf(ALPHA / 2) * math.sqrt(variance / DRAWS)


def test_the_chi_square_test_can_fail():
    """Draws at σ = 3 are refused as draws of σ = 3.3: the test above has power."""
    assert _chi_square_pvalue(discrete_gaussian(SeededBits(11), DRAWS, 3.0), 3.3) < ALPHA


def test_the_sampler_uses_only_the_stream_it_is_given():
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    numpy_state, python_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    first, second = discrete_gaussian(SecureBits(), 1000, 5.0), discrete_gaussian(SecureBits(), 1000, 5.0)
    assert not np.array_equal(first, second)  # two OS-keyed streams
    assert np.array_equal(discrete_gaussian(SeededBits(4), 1000, 5.0), discrete_gaussian(SeededBits(4), 1000, 5.0))
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1]) and after[2:] == numpy_state[2:]
    assert random.getstate() == python_state and torch.equal(torch.get_rng_state(), torch_state)
    with pytest.raises(ValueError, match="sigma"):
        discrete_gaussian(SeededBits(1), 3, 0.0)


# --- the accountant -------------------------------------------------------------------------------------------
def test_tau_underflows_to_zero_and_then_the_rdp_is_the_gaussians():
    assert math.exp(log_tau(50.0, 100)) == 0.0 and log_tau(0.3, 1) == -math.inf  # log τ stays finite, τ is 0
    assert 0 < math.exp(log_tau(0.3, 10)) < 10 * 9
    l2, shares, sigma, dimension = 300.0, 20, 500.0, 4000
    s2 = l2 / (math.sqrt(shares) * sigma)
    alpha = np.asarray(ORDERS, dtype=np.float64)
    np.testing.assert_allclose(ddg_rdp(sigma, shares, l2, dimension), alpha * s2**2 / 2, rtol=1e-14)
    # with τ > 0 (a small σ_l) the discrete noise costs more than the continuous one
    assert np.all(ddg_rdp(0.5, 3, 2.0, 10) > alpha * (2.0 / (math.sqrt(3) * 0.5)) ** 2 / 2)
    assert l1_sensitivity(l2, dimension) == l2 * math.sqrt(dimension) and l1_sensitivity(3.0, 100) == 9.0


def test_without_sampling_the_epsilon_is_dp_accountings_gaussian_composed_t_times():
    accounting = DdgAccounting(l2=800.0, dimension=1000, shares=16)
    sigma, rounds, delta = 400.0, 25, 1e-6
    s2 = accounting.l2 / (math.sqrt(accounting.shares) * sigma)
    reference = RdpAccountant(orders=list(ORDERS)).compose(dp_event.GaussianDpEvent(1 / s2), rounds)
    assert accounting.epsilon(sigma, rounds, delta) == pytest.approx(reference.get_epsilon(delta), abs=1e-9)
    assert accounting.epsilon(sigma, 0, delta) == 0.0


def test_calibration_meets_the_target_within_one_percent_and_sigma_falls_as_epsilon_grows():
    accounting = DdgAccounting(l2=2000.0, dimension=5000, shares=30)
    sigmas = []
    for target in (1.0, 4.0, 16.0):
        sigma = accounting.calibrate(target, 50, 1e-5)
        assert 0.99 * target <= accounting.epsilon(sigma, 50, 1e-5) <= target
        sigmas.append(sigma)
    assert sigmas[0] > sigmas[1] > sigmas[2]


def test_the_ddg_epsilon_adds_the_clients_sampler_slack_as_the_central_path_does():
    """Each client's share is N_ℤ only up to exp(±η) a value: ε gains 2κ, κ = T·(K·d)·η, and δ the tail mass, as the
    central accountant's slack (sampler_slack) without its rounding terms (17/σ² + 3e^{−2π²σ²} a value, which
    compare N_ℤ with the continuous Gaussian that the central accountant analyses)."""
    plan = plan_distributed_noise(1.0, 650, 32, 10, 0.66, 5, 1e-5, 0.0, 0.5)
    accountant = plan.accountant()
    draws = plan.lattice.cohort * plan.dimension  # every share of a cohort of K = 10: d values each
    for _ in range(3):
        accountant.compose_round()
    pure = plan.accounting.epsilon(plan.local_std, 3, plan.delta)
    slack = accountant.sampler_slack(3)
    assert slack.epsilon == 2 * 3 * draws * sampler_log_ratio_bound() > 0
    assert accountant.epsilon() == pure + slack.epsilon > pure
    sigma = plan.local_std  # the central path on the same draws, less what compares N_ℤ with N(0, σ²)
    central = sampler_slack(plan.accountant_noise_multiplier, sigma, draws, 3, pure, plan.delta)
    rounding = 2 * 3 * draws * (17 / sigma**2 + 3 * math.exp(-2 * math.pi**2 * sigma**2))
    assert slack.epsilon == pytest.approx(central.epsilon - rounding, rel=1e-9)
    assert slack.delta <= central.delta and slack.delta >= math.expm1(slack.epsilon / 2) * plan.delta
    between = plan.accounting.epsilon(sigma, 4, plan.delta) + accountant.sampler_slack(4).epsilon / 2
    assert accountant.would_exceed(between)  # the slack counts in the budget stop too


def test_metrics_name_the_sampler_exact_up_to_a_factor():
    assert sampler_label() == (f"discrete Gaussian on the lattice, exact up to a factor exp(±η) per value, "
                               f"η = {sampler_log_ratio_bound():.2g}")
    assert "exact sampler" not in sampler_label()


# --- the lattice and the plan ---------------------------------------------------------------------------------
@pytest.mark.parametrize("largest", [20, 1000])
def test_the_plan_holds_the_cohort_and_its_noise_in_range(largest):
    plan = plan_distributed_noise(1.0, 5000, 32, largest, 0.66, 50, 1e-5, 4.0, 0.0)
    lattice = plan.lattice
    assert lattice.cohort == largest
    levels = 1.0 / lattice.granularity
    total_std = math.sqrt(largest) * plan.local_std
    assert largest * (levels + 1) + WRAP_STDS * total_std < lattice.modulus // 2
    # a sum of n σ_l²-subgaussian shares exceeds 10 of its stds with probability ≤ 2·exp(−50) < 1e-20
    assert 2 * math.exp(-WRAP_STDS**2 / 2) < 1e-20
    # and g is the finest such power of two: at g/2 the range would not hold (or the noiseless bound binds)
    finer = plan_distributed_noise.__wrapped__  # uncached, same arithmetic
    noiseless = ModularLattice.for_cohort(1.0, largest, 32)
    if lattice.granularity > noiseless.granularity:
        half = DistributedNoise(ModularLattice(32, lattice.granularity / 2, largest), 1.0, 1.0, plan.shares, 5000,
                                plan.delta)
        std_at_half = half.accounting.calibrate(4.0, 50, plan.delta)
        assert largest * (2 * levels + 1) + WRAP_STDS * math.sqrt(largest) * std_at_half >= lattice.modulus // 2
    assert finer(1.0, 5000, 32, largest, 0.66, 50, 1e-5, 4.0, 0.0) == plan
    assert 0.99 * 4.0 <= plan.accountant().accounting.epsilon(plan.local_std, 50, plan.delta) <= 4.0
    # extreme clipped contributions (C/g + 1 steps) plus the noise of the largest cohort decode to their exact sum
    bits = SeededBits(2)
    extreme = np.full(3000, int(levels) + 1)
    noise = [discrete_gaussian(bits, 3000, plan.local_std) for _ in range(largest)]
    residues = sum(lattice.encode(extreme + n) for n in noise) & np.uint64(lattice.modulus - 1)
    assert lattice.decode_sum(residues).numpy().tolist() == (largest * extreme + sum(noise)).tolist()


def test_a_modulus_too_small_for_the_noise_is_refused_naming_the_bits_needed():
    config = RunConfig().with_overrides({"secure-aggregation": "secagg+", "noise": "distributed", "sampling": "fixed",
                                         "secagg-modulus-bits": 16, "noise-multiplier": 30.0})
    with pytest.raises(ConfigError, match=r"secagg-modulus-bits=16 .* expected ≥ \d+ bits"):
        config.secure_plan(7434)
    central = config.with_overrides({"noise": "central", "sampling": "poisson"})
    assert central.secure_plan(7434) == (ModularLattice.for_cohort(1.0, 1000, 16), None)  # the population's g


@pytest.mark.parametrize("overrides, match", [
    ({"noise": "distributed"}, "noise=\"distributed\" is not allowed with secure-aggregation=\"off\""),
    ({"noise": "local", "secure-aggregation": "secagg+"}, "noise='local' is not allowed; expected one of central"),
    ({"noise": "distributed", "secure-aggregation": "secagg+", "noise-multiplier": 0.0}, "noise=\"distributed\" needs"),
    ({"noise": "distributed", "secure-aggregation": "secagg+", "sampling": "poisson"},
     "noise=\"distributed\" is not allowed with sampling=\"poisson\"; expected sampling=\"fixed\""),
])
def test_config_errors_name_the_noise_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig().with_overrides(overrides)


def test_the_server_never_unmasks_fewer_than_m_noise_shares():
    n = 7  # t = ⌈0.66·7⌉ = 5 shares suffice to unmask; m = 6 noise shares are what the accountant counts
    levels = _contributions(n)
    lattice = ModularLattice.for_cohort(CLIP, n, 32)
    noise = DistributedNoise(lattice, CLIP, 1.0, 6, DIMENSION, 1e-3)
    content = RecordDict({"config": ConfigRecord({protocol.SERVER_ROUND: 1})})
    for dropped, fails in ((1, False), (2, True)):
        grid = DroppingGrid(_secure_app(levels), n, {}, drop_at=Stage.COLLECT_MASKED_VECTORS, drop_count=dropped)
        run = lambda grid=grid: secure_sum(grid, sorted(grid.contexts), content, DIMENSION,  # noqa: E731
                                           SecAggSettings(0, 0.66, lattice, CLIP, noise), 10, "1")
        if fails:
            with pytest.raises(SecureAggregationFailed, match="the noise of m = 6 clients"):
                run()
            assert not [r for r in grid.replies if r.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(
                Key.NODE_ID_LIST)]  # the unmask stage never ran
        else:
            assert run().contributors == 6


# --- whole rounds on the in-process engine ----------------------------------------------------------------------
def _run(tmp_path, name: str, grid_kwargs: dict | None = None, **overrides) -> tuple[dict, dict, DroppingGrid]:
    settings = {"dataset": "digits", "model": "logreg", "population": 10, "sampling": "fixed", "sampling-rate": 1.0,
                "rounds": 1, "local-epochs": 1, "learning-rate": 0.1, "clipping-norm": 0.5, "mechanism": "hog",
                "noise-multiplier": 0.5, "privacy-seed": 7, "partitioner": "iid", "secure-aggregation": "secagg+",
                "noise": "distributed", "delta": 1e-3, "results-dir": str(tmp_path / name), **overrides}
    config = RunConfig().with_overrides(settings)
    grid = DroppingGrid(fedhog_client_app, config.population, config.to_mapping(), **(grid_kwargs or {}))
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config.to_mapping()))
    metrics = read_metrics(tmp_path / name)
    return metrics, torch.load(tmp_path / name / "final_model.pt"), grid


def test_the_server_unmasks_only_a_noised_sum_and_adds_no_noise(tmp_path, monkeypatch):
    quantised, unmasked = [], []
    stochastic_round = ModularLattice.stochastic_round
    monkeypatch.setattr(ModularLattice, "stochastic_round",
                        lambda self, c, bits: quantised.append(stochastic_round(self, c, bits)) or quantised[-1])
    finish = SecureAggregator.finish_secure_round
    monkeypatch.setattr(SecureAggregator, "finish_secure_round",
                        lambda self, r, result: unmasked.append(result) or finish(self, r, result))

    def no_server_noise(*args, **kwargs):
        raise AssertionError("the server added noise")

    monkeypatch.setattr(GaussianMechanism, "add_noise", no_server_noise)  # the central noise of gaussian and hog
    metrics, model, grid = _run(tmp_path, "noised")
    _, initial, _ = _run(tmp_path, "initial", **{"max-epsilon": 1e-9})  # stops before round 1
    record, privacy = metrics["rounds"][0], metrics["privacy"]
    assert record["clients_accepted"] == 10 and record["failure"] == ""
    # what reached the server: masked vectors of residues, never an update or a term
    collected = [r for r in grid.replies if protocol.MASKED in r.content.array_records]
    assert len(collected) == 10
    for reply in grid.replies:
        assert set(reply.content.array_records) <= {protocol.MASKED}
        assert protocol.UPDATE not in reply.content and protocol.TERM not in reply.content
    # the unmasked sum is the honest sum of quantised contributions plus noise of std √10·σ_l (lattice steps)
    (result,) = unmasked
    sigma = privacy["local_noise_std_steps"]
    noise = (result.levels - torch.from_numpy(sum(quantised[:10]))).numpy().astype(np.float64)
    dimension = noise.size
    assert np.count_nonzero(noise) > 0.99 * dimension  # not the exact sum
    statistic = float(np.sum(noise**2)) / (10 * sigma**2)
    assert stats.chi2.ppf(ALPHA, dimension) < statistic < stats.chi2.isf(ALPHA, dimension)
    assert abs(float(noise.mean())) < stats.norm.isf(ALPHA) * math.sqrt(10 / dimension) * sigma
    # the release is g·S/K exactly: θ' − θ = g·(unmasked sum)/10, up to float32 rounding
    g = privacy["granularity"]
    release = result.levels.to(torch.float64) * g / 10
    flat_step = torch.cat([(model[k].double() - initial[k].double()).reshape(-1) for k in model])
    ulps = torch.cat([2.0**-23 * (model[k].double().abs() + initial[k].double().abs()).reshape(-1) for k in model])
    assert bool(((flat_step - release).abs() <= ulps + 2.0**-30).all())
    assert record["noise_std"] == pytest.approx(math.sqrt(10) * sigma * g / 10, rel=1e-12)


@pytest.mark.slow
def test_metrics_record_the_plan_and_the_epsilon_of_the_ddg_accountant(tmp_path):
    metrics, _, _ = _run(tmp_path, "recorded", rounds=2)
    privacy = metrics["privacy"]
    config = RunConfig().with_overrides({"dataset": "digits", "model": "logreg", "population": 10, "sampling": "fixed",
                                         "sampling-rate": 1.0, "rounds": 2, "clipping-norm": 0.5,
                                         "noise-multiplier": 0.5, "secure-aggregation": "secagg+",
                                         "noise": "distributed", "delta": 1e-3})
    lattice, plan = config.secure_plan(650)  # logreg on 8×8 digits: 64·10 + 10 parameters
    assert privacy["noise"] == "distributed" and privacy["accountant"] == "ddg-rdp"
    assert privacy["noise_shares"] == 7 == math.ceil(0.66 * 10)
    assert privacy["local_noise_std_steps"] == plan.local_std and privacy["granularity"] == lattice.granularity
    assert privacy["total_noise_multiplier"] == pytest.approx(0.5) == privacy["noise_multiplier"]
    assert privacy["accountant_noise_multiplier"] == pytest.approx(0.25)  # replace-one: sensitivity 2Δ₂
    assert privacy["neighbouring_relation"] == "replace-one"
    accountant = plan.accountant()
    for record in metrics["rounds"]:
        accountant.compose_round()
        assert record["epsilon"] == pytest.approx(accountant.epsilon(), rel=1e-12)
    assert not any("seed" in key or "key" in key for key in privacy if key != "randomness")


@pytest.mark.slow
def test_dropouts_down_to_m_release_and_below_m_fail_without_spending_epsilon(tmp_path):
    # K = 10, m = ⌈0.66·10⌉ = 7 (and SecAgg's t = 7): three dropouts after key sharing release, four do not
    metrics, _, _ = _run(tmp_path, "three", {"drop_at": Stage.COLLECT_MASKED_VECTORS, "drop_count": 3})
    assert metrics["rounds"][0]["clients_accepted"] == 7 and metrics["rounds"][0]["epsilon"] > 0
    metrics, model, _ = _run(tmp_path, "four", {"drop_at": Stage.COLLECT_MASKED_VECTORS, "drop_count": 4})
    record = metrics["rounds"][0]
    assert record["failure"].startswith("secure aggregation failed: collect-masked-vectors")
    assert record["epsilon"] == 0.0 and metrics["summary"]["epsilon"] == 0.0 and record["clients_accepted"] == 0
    _, initial, _ = _run(tmp_path, "none", **{"max-epsilon": 1e-9})
    assert all(torch.equal(model[k], initial[k]) for k in initial)


def test_under_poisson_sampling_central_noise_takes_g_from_the_population_not_the_sampled_cohort(tmp_path):
    overrides = {"population": 12, "sampling": "poisson", "sampling-rate": 0.5, "rounds": 1, "noise": "central"}
    central, _, _ = _run(tmp_path, "poisson-central", **overrides)
    assert central["privacy"]["secagg_granularity"] == ModularLattice.for_cohort(0.5, 12, 32).granularity
    assert central["rounds"][0]["clients_sampled"] != 12  # the sampled cohort is not what sized the lattice


def test_fixed_size_cohorts_are_accounted_replace_one_without_amplification():
    fixed = plan_distributed_noise(1.0, 100, 32, 50, 0.66, 1, 1e-3, 0.0, 1.0)
    assert fixed.accounting.l2 == 2 * fixed.l2_sensitivity and fixed.shares == 33
    assert fixed.accountant_noise_multiplier == pytest.approx(fixed.noise_multiplier / 2) == pytest.approx(0.5)


# --- the mechanism object -------------------------------------------------------------------------------------
def _distributed_config() -> RunConfig:
    return RunConfig().with_overrides({"population": 10, "sampling": "fixed", "sampling-rate": 1.0, "rounds": 2,
                                       "clipping-norm": 0.5, "noise-multiplier": 0.5, "secure-aggregation": "secagg+",
                                       "noise": "distributed", "delta": 1e-3, "mechanism": "hog"})


def test_the_distributed_mechanism_adds_each_clients_share_and_the_server_nothing():
    config = _distributed_config()
    mechanism = config.mechanism_for(650)
    lattice, plan = config.secure_plan(650)
    assert mechanism.plan is plan and mechanism.has_guarantee and mechanism.wants_term  # the inner hog's
    levels = np.arange(650, dtype=np.int64)
    share = mechanism.noise_share(levels, SeededBits(5, (1, 1))) - levels
    np.testing.assert_array_equal(share, plan.sample(SeededBits(5, (1, 1))))  # the plan's draw from that stream
    assert np.count_nonzero(share) > 0.9 * share.size
    total = torch.from_numpy(levels)
    released, std = mechanism.add_noise(total, lattice.noise_lattice(650), SeededBits(6), 7)
    assert torch.equal(released, total.to(torch.float64) * lattice.granularity)  # exactly g·S: no server noise
    assert std == math.sqrt(7) * plan.local_std * lattice.granularity
    with pytest.raises(ValueError, match="secure aggregation only"):
        mechanism.aggregate([], 10, [], SeededBits(1), 650)


def test_the_distributed_mechanism_reports_the_inner_c_and_sigma_and_keeps_them():
    """Its name, term, C and σ are the inner mechanism's; C cannot change: the clients' plan is calibrated to it."""
    config = _distributed_config()
    mechanism = config.mechanism_for(650)
    inner = config.privacy_mechanism
    assert mechanism.inner == inner and (mechanism.name, mechanism.wants_term) == ("hog", True)
    assert (mechanism.clipping_norm, mechanism.noise_multiplier) == (0.5, 0.5) == (inner.clipping_norm,
                                                                                  inner.noise_multiplier)
    with pytest.raises(ValueError, match="noise plan is calibrated"):
        mechanism.with_clipping(0.25, 0.5)


def test_the_ddg_accountants_noise_multiplier_is_the_plans_as_accounted():
    """What metrics.json records as accountant_noise_multiplier: the m shares' std over 2Δ₂, as the plan says."""
    config = _distributed_config()
    plan = config.secure_plan(650)[1]
    accountant = config.mechanism_for(650).accountant(config.sampling, config.sampling_rate, config.population,
                                                      config.delta, config.accountant)
    assert accountant.method == "ddg-rdp" and accountant.sampler_slack(config.rounds).epsilon > 0  # the clients' draws
    assert accountant.noise_multiplier == plan.accountant_noise_multiplier  # the same float
    assert accountant.noise_multiplier == pytest.approx(plan.noise_multiplier / 2, rel=1e-15)
