"""Flower's accounted DP wrapper as a baseline (aggregator = "flower-dp")."""

from __future__ import annotations

import pytest
import torch
from dp_accounting import dp_event, rdp
from flwr.serverapp import RdpAccountant
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent
from helpers import read_run

from fedhog.client_app import app as client_app
from fedhog.config import ConfigError, RunConfig
from fedhog.engines.inprocess import run_in_process
from fedhog.flower_baseline import build_flower_dp_strategy
from fedhog.privacy.calibration import (
    calibrate_unamplified_noise_multiplier,
    unamplified_privacy_config,
)
from fedhog.server_app import app as server_app

BASELINE = {"aggregator": "flower-dp", "mechanism": "gaussian", "sampling": "fixed", "accountant": "rdp"}
SMALL = {"dataset": "digits", "model": "logreg", "population": 8, "sampling-rate": 0.5, "rounds": 3,
         "local-epochs": 2, "learning-rate": 0.1, "clipping-norm": 0.3, "server-learning-rate": 2.0,
         "partitioner": "iid", "privacy-seed": 3}


pytestmark = pytest.mark.usefixtures("shared_cache")


def _run(directory, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    config = RunConfig().with_overrides({**SMALL, **overrides, "results-dir": str(directory)})
    run_in_process(server_app, client_app, config.population, config.to_mapping())
    return read_run(directory)


@pytest.mark.parametrize("key, value", [("mechanism", "hog"), ("sampling", "poisson"), ("accountant", "pld"),
                                        ("adaptive-clipping", True), ("max-update-norm", 5.0)])
def test_flower_dp_refuses_what_flowers_wrapper_does_not_run(key, value):
    with pytest.raises(ConfigError, match=f"aggregator='flower-dp' needs {key}="):
        RunConfig().with_overrides({**BASELINE, key: value})


def test_unamplified_calibration_meets_the_budget_in_flowers_own_accountant():
    epsilon, delta, rounds, population, cohort = 3.0, 1e-5, 20, 1000, 50
    sigma = calibrate_unamplified_noise_multiplier(epsilon, delta, rounds, population, cohort, tolerance=1e-3)

    def spent(noise_multiplier: float) -> float:
        accountant = RdpAccountant(unamplified_privacy_config(population, delta))
        accountant.compose(GaussianPrivacyEvent(noise_multiplier, cohort, population), rounds)
        return accountant.get_epsilon(delta)

    assert spent(sigma) <= epsilon < spent(sigma * (1 - 1e-3))
    # no amplification: the cohort size does not matter, only σ and T (a plain Gaussian composed T times)
    direct = rdp.RdpAccountant().compose(dp_event.GaussianDpEvent(sigma), rounds).get_epsilon(delta)
    assert spent(sigma) == pytest.approx(direct, rel=1e-9)


def test_strategy_is_flowers_wrapper_in_accounted_mode():
    config = RunConfig().with_overrides({**SMALL, **BASELINE, "noise-multiplier": 1.5})
    strategy = build_flower_dp_strategy(config)
    assert strategy.num_sampled_clients == 4
    assert strategy.clipping_norm == pytest.approx(2.0 * 0.3)  # η·C: clients reply θ + η·Δ
    assert strategy.accountant.config.sampling_method.value == "no-amplification"


def test_baseline_reports_the_epsilon_of_its_releases(tmp_path):
    metrics, _ = _run(tmp_path, **BASELINE, **{"target-epsilon": 4.0})
    sigma = metrics["privacy"]["noise_multiplier"]
    assert metrics["status"] == "finished" and metrics["privacy"]["accountant"] == "flower-rdp-no-amplification"
    for record in metrics["rounds"]:
        assert record["clients_accepted"] == 4
        reference = rdp.RdpAccountant().compose(dp_event.GaussianDpEvent(sigma), record["round"])
        assert record["epsilon"] == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)
    assert metrics["rounds"][-1]["epsilon"] <= 4.0


@pytest.mark.slow
def test_baseline_takes_fedhogs_dp_fedavg_step(tmp_path):
    """With every client every round (the same cohort) and σ → 0, Flower's wrapper over θ + η·Δ replies
    releases exactly fedhog's θ + η·mean(clip_C(Δ)): the comparison differs in σ and sampling only."""
    shared = {"sampling-rate": 1.0, "noise-multiplier": 1e-9, "sampling": "fixed"}
    flower, flower_model = _run(tmp_path / "flower", **{**BASELINE, **shared})
    # fedhog without noise (its sampler refuses σ = 1e-9: normals stop at 13.4 std, a shift of 1e9 std is no DP)
    fedhog, fedhog_model = _run(tmp_path / "fedhog", **{**shared, "noise-multiplier": 0.0}, mechanism="gaussian")
    assert fedhog["rounds"][0]["fraction_clipped"] > 0  # clipping is active, so the η·C scaling matters
    for key, value in fedhog_model.items():
        torch.testing.assert_close(flower_model[key].to(value.dtype), value, rtol=1e-5, atol=1e-6)
    assert [r["accuracy"] for r in flower["rounds"]] == pytest.approx([r["accuracy"] for r in fedhog["rounds"]],
                                                                     abs=1e-3)


def test_the_baselines_aggregator_fixes_only_config_keys_and_its_runs_cannot_be_resumed(tmp_path, capsys):
    """What the registry says of flower-dp is what the config, the ClientApp and --resume do with it."""
    from pathlib import Path

    from fedhog import cli
    from fedhog.aggregators import AGGREGATOR_REGISTRY, aggregator_of
    from fedhog.results import ResultsWriter

    flower = AGGREGATOR_REGISTRY["flower-dp"]
    assert set(flower.requires) <= set(RunConfig().to_mapping())  # every key it fixes is a config key
    config = RunConfig().with_overrides({**SMALL, "aggregator": "flower-dp", **flower.requires,
                                         "results-dir": str(tmp_path / "run")})
    assert aggregator_of(config) is flower and not flower.takes_terms
    assert not flower.resumable and AGGREGATOR_REGISTRY["fedhog"].resumable
    ResultsWriter(Path(config.results_dir), config).update(status="interrupted", rounds=[{"round": 1}])
    assert cli.main(["run", "--resume", config.results_dir]) == 2
    assert "aggregator='flower-dp' writes no checkpoints, so its runs cannot be resumed" in capsys.readouterr().err


def test_a_client_whose_model_did_not_move_does_not_crash_flowers_round(tmp_path):
    """A zero update (here: a learning rate that rounds every step to 0 in float32) made Flower's clipping divide
    by its norm (ZeroDivisionError: a diverged digits cell of the issue-21 sweep died so). It is released as a zero
    contribution: the model moves by the noise alone, and every round is accounted."""
    metrics, _ = _run(tmp_path, **BASELINE, **{"target-epsilon": 4.0, "learning-rate": 1e-46})
    assert metrics["status"] == "finished"
    assert [r["clients_accepted"] for r in metrics["rounds"]] == [4, 4, 4]
    assert metrics["rounds"][-1]["epsilon"] <= 4.0
