"""Diagnostics of the released model: the noise's random walk, weight growth, saturation, the warnings."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import read_metrics
from torch import nn

from fedhog.alarms import alarms, noise_notes, warnings_for
from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.diagnostics import noise_walk_length, saturated_fractions, weight_diagnostics
from fedhog.engines.vectorized import run_vectorized
from fedhog.progress import round_status
from fedhog.server_app import app as server_app
from fedhog.server_optimizer import ServerOptimizer, ServerOptimizerSettings


@pytest.mark.parametrize("kind, momentum", [("sgd", 0.0), ("momentum", 0.9), ("momentum", 0.5)])
def test_the_walk_length_is_what_the_server_optimizer_does_to_pure_noise(kind, momentum):
    """Feed fedhog's own server optimizer releases of pure noise; the weights' mean squared displacement is ρ²."""
    generator = torch.Generator().manual_seed(0)
    numel, rounds, std, rate = 4000, 30, 0.05, 2.0
    optimizer = ServerOptimizer(ServerOptimizerSettings(kind, rate, momentum if kind == "momentum" else 0.9))
    weights = torch.zeros(numel, dtype=torch.float64)
    for server_round in range(1, rounds + 1):
        weights = optimizer.step(weights, std * torch.randn(numel, generator=generator, dtype=torch.float64),
                                 server_round)
    expected = noise_walk_length(std, numel, rounds, rate, momentum)
    # ‖W‖² is a sum of numel independent squares: relative std √(2/numel) ≈ 2 %
    assert float(weights.norm()) == pytest.approx(expected, rel=0.05)


def test_weight_diagnostics_per_weight_tensor():
    initial = {"0.weight": torch.ones(3, 4), "0.bias": torch.ones(3), "2.weight": torch.ones(2, 3)}
    current = {"0.weight": 3 * torch.ones(3, 4), "0.bias": torch.zeros(3), "2.weight": torch.ones(2, 3)}
    out = weight_diagnostics(initial, current, rounds=4, noise_std=0.1, learning_rate=1.0, momentum=0.0)
    assert set(out) == {f"{kind}/{name}" for kind in ("norm", "growth", "walk") for name in ("0.weight", "2.weight")}
    assert out["norm/0.weight"] == pytest.approx(3 * math.sqrt(12))
    assert out["growth/0.weight"] == pytest.approx(3.0) and out["growth/2.weight"] == pytest.approx(1.0)
    # moved 2 per entry: ‖ΔW‖ = 2√12; ρ = 0.1·√(12·4)
    assert out["walk/0.weight"] == pytest.approx(0.1 * math.sqrt(48) / (2 * math.sqrt(12)))
    assert math.isinf(out["walk/2.weight"])  # did not move at all: only noise could have moved it


@pytest.mark.parametrize("noise_std, momentum", [(0.0, 0.0), (math.nan, 0.9), (0.1, None)])
def test_no_walk_without_noise_or_with_an_adaptive_optimizer(noise_std, momentum):
    state = {"w.weight": torch.ones(2, 2)}
    out = weight_diagnostics(state, {"w.weight": 2 * torch.ones(2, 2)}, 3, noise_std, 1.0, momentum)
    assert set(out) == {"norm/w.weight", "growth/w.weight"}


def test_saturation_counts_the_inputs_past_the_threshold():
    linear = nn.Linear(1, 1)
    with torch.no_grad():
        linear.weight.fill_(1.0)
        linear.bias.zero_()
    inputs = torch.tensor([[-3.0], [-1.0], [0.0], [1.5], [2.5], [5.0], [1.9], [-2.1]])
    assert saturated_fractions(nn.Sequential(linear, nn.Tanh()), inputs) == {"saturated/1": 4 / 8}
    assert saturated_fractions(nn.Sequential(linear, nn.Sigmoid()), inputs) == {"saturated/1": 1 / 8}
    assert saturated_fractions(nn.Sequential(linear, nn.SiLU()), inputs) == {}


def test_warnings_name_the_layer_only_when_it_is_in_trouble():
    calm = {"growth/a.weight": 1.5, "walk/a.weight": 0.9, "saturated/b": 0.1}
    assert warnings_for(calm) == []
    trouble = {"growth/a.weight": 3.0, "walk/a.weight": 0.95, "saturated/b": 0.4,
               "growth/c.weight": 4.0, "walk/c.weight": 0.3}
    found = warnings_for(trouble)
    assert len(found) == 2
    assert found[0].startswith("b saturated: 40%") and found == alarms(trouble) + noise_notes(trouble)
    assert found[1].startswith("noise dominates a.weight") and "×3.0" in found[1]


def test_the_progress_line_warns_of_saturation_not_of_the_noise_every_layer_carries_under_dp():
    """Measured at ε = 3 (cnn1d, convergence federation): healthy GELU runs end with a noise walk of 1.01–1.07
    and weights grown 7.8–9.1×, the crippled tanh run with 1.58, 6.6× and half its units saturated."""
    healthy = {"growth/features.2.weight": 9.1, "walk/features.2.weight": 1.07,
               "growth/features.4.weight": 7.8, "walk/features.4.weight": 1.01}
    assert alarms(healthy) == [] and len(noise_notes(healthy)) == 2  # recorded in metrics.json, not shown
    line = round_status({"accuracy": 0.52, "epsilon": 3.0, "layers": healthy, "warnings": warnings_for(healthy)})
    assert line == "accuracy 0.520  ε 3.000"
    tanh = {"growth/features.2.weight": 6.6, "walk/features.2.weight": 1.58, "saturated/features.1": 0.2,
            "saturated/features.3": 0.49, "saturated/features.5": 0.31}
    line = round_status({"accuracy": 0.22, "epsilon": 3.0, "layers": tanh, "warnings": warnings_for(tanh)})
    assert "⚠ features.3 saturated: 49% of its units" in line and "(+1 more)" in line and "noise" not in line
    assert round_status({"accuracy": 0.5, "epsilon": 1.0}) == "accuracy 0.500  ε 1.000"  # a round without layers


SMALL = {"dataset": "digits", "model": "mlp", "population": 10, "sampling-rate": 0.5, "rounds": 4,
         "local-epochs": 1, "batch-size": 8, "learning-rate": 0.1, "clipping-norm": 1.0, "privacy-seed": 7}


@pytest.mark.slow
def test_metrics_json_carries_the_diagnostics_every_round(tmp_path, fresh_cache):
    """tanh under heavy noise: growth, the walk and saturation per round, and the warning it deserves."""
    noisy = RunConfig().with_overrides({**SMALL, "activation": "tanh", "mechanism": "gaussian",
                                        "noise-multiplier": 20.0, "server-learning-rate": 3.0,
                                        "results-dir": str(tmp_path / "noisy")})
    run_vectorized(server_app, client_app, noisy)
    rounds = read_metrics(tmp_path / "noisy")["rounds"]
    assert len(rounds) == 4
    for record in rounds:
        layers = record["layers"]
        assert {"growth/1.weight", "growth/3.weight", "growth/5.weight", "walk/1.weight"} <= set(layers)
        assert {"saturated/2", "saturated/4"} <= set(layers)
    last = rounds[-1]
    assert last["layers"]["walk/3.weight"] > 0.7 and last["layers"]["growth/3.weight"] > 2
    assert any(w.startswith("noise dominates 3.weight") for w in last["warnings"])  # in metrics.json
    assert "noise dominates" not in round_status(last)  # not on the progress line

    quiet = RunConfig().with_overrides({**SMALL, "mechanism": "none", "results-dir": str(tmp_path / "quiet")})
    run_vectorized(server_app, client_app, quiet)
    record = read_metrics(tmp_path / "quiet")["rounds"][-1]
    assert not any(key.startswith(("walk/", "saturated/")) for key in record["layers"])  # no noise; gelu
    assert record["warnings"] == []
