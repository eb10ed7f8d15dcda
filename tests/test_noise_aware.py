"""Noise-aware mixing: τ and λ against what the server optimizer and torch.optim.SGD really do, the mechanism's
contribution, its expectation, its privacy (gaussian's σ and ε), the config's edge, and the clients' terms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhog.config import ConfigError, RunConfig
from fedhog.derivatives import hessian_trace_gradient
from fedhog.derivatives.engine import random_directions
from fedhog.privacy.mechanism import GaussianMechanism, HogMechanism, build_mechanism
from fedhog.privacy.noise_aware import NoiseAwareMixing, local_step_scale, release_noise_std
from fedhog.server_optimizer import ServerOptimizer, ServerOptimizerSettings

MIXING = NoiseAwareMixing(strength=1.0, server_learning_rate=0.7, server_momentum=0.9, expected_cohort=20)


@pytest.mark.parametrize("kind, momentum", [("sgd", 0.0), ("momentum", 0.5), ("momentum", 0.9)])
def test_tau_is_the_weight_displacement_one_rounds_noise_leaves(kind, momentum):
    """One round's release noise n/K through the server optimizer, then releases of zero until the momentum has
    carried it out: the weights moved by a per-coordinate std of τ = η σ C / (K (1 − β))."""
    sigma, clip, cohort, rate, dimension = 1.3, 0.8, 20, 0.7, 40_000
    optimizer = ServerOptimizer(ServerOptimizerSettings(kind, rate, momentum))
    generator = torch.Generator().manual_seed(0)
    start = torch.zeros(dimension, dtype=torch.float64)
    model = optimizer.step(start, sigma * clip * torch.randn(dimension, generator=generator,
                                                             dtype=torch.float64) / cohort, 1)
    for server_round in range(2, 400):
        model = optimizer.step(model, torch.zeros(dimension, dtype=torch.float64), server_round)
    measured = float((model - start).std())
    expected = release_noise_std(sigma, clip, cohort, rate, momentum)
    assert measured == pytest.approx(expected, rel=4 / math.sqrt(2 * dimension))  # std of a sample std: 1/√(2d)


@pytest.mark.parametrize("momentum, steps", [(0.0, 7), (0.5, 7), (0.9, 3), (0.9, 40)])
def test_lambda_is_how_far_sgd_moves_along_a_constant_gradient(momentum, steps):
    """torch.optim.SGD (heavy ball) on L(θ) = ⟨g, θ⟩ for S steps moves θ by −λ g."""
    g = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    theta = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    sgd = torch.optim.SGD([theta], lr=0.05, momentum=momentum)
    for _ in range(steps):
        sgd.zero_grad()
        (g * theta).sum().backward()
        sgd.step()
    torch.testing.assert_close(theta.detach(), -local_step_scale(0.05, steps, momentum) * g, rtol=1e-12, atol=0)


def _rows(seed: int = 0, rows: int = 6, dimension: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grow = torch.arange(1, rows + 1, dtype=torch.float64)[:, None] / 2  # ‖Δ‖ ≈ 0.35, 0.7, 1.05, …: some clipped
    updates = torch.randn(rows, dimension, generator=g, dtype=torch.float64) * 0.1 * grow
    terms = torch.randn(rows, dimension, generator=g, dtype=torch.float64) * 0.3
    return updates, terms


def test_the_contribution_is_the_update_minus_half_kappa_tau_squared_times_the_term():
    mechanism = HogMechanism(clipping_norm=1.0, noise_multiplier=1.3, noise_aware=MIXING)
    updates, terms = _rows()
    coefficient = 0.5 * 1.0 * release_noise_std(1.3, 1.0, 20, 0.7, 0.9) ** 2
    assert coefficient == mechanism.noise_aware.coefficient(1.3, 1.0)
    out, stats = mechanism.constrain_sensitivity(updates, terms, torch.zeros(len(updates)))
    u = updates - coefficient * terms
    norms = torch.linalg.vector_norm(u, dim=1)
    expected = u * torch.clamp(1.0 / norms, max=1.0)[:, None]
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-12)
    assert any(stats.clipped) and not all(stats.clipped)  # both branches ran
    np.testing.assert_allclose(stats.norms_before_clip, norms.numpy(), rtol=1e-12)
    np.testing.assert_allclose(stats.mixing_ratios, (coefficient * torch.linalg.vector_norm(terms, dim=1)
                                                     / torch.linalg.vector_norm(updates, dim=1)).numpy(), rtol=1e-12)


def test_it_is_deterministic_unlike_random_sign_whose_mean_is_the_update():
    """Random-sign: ξ ~ N(0, 1) from the server, E[u] = Δ. Noise-aware: no ξ is drawn and u − Δ = −½κτ² t."""
    updates, terms = _rows(rows=1)
    random_sign = HogMechanism(clipping_norm=1e6, noise_multiplier=1.3, mixing_strength=0.5)
    xis = torch.randn(20_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mixed, _ = random_sign.constrain_sensitivity(updates.expand(len(xis), -1), terms.expand(len(xis), -1), xis)
    spread = 0.5 * float(torch.linalg.vector_norm(updates)) / math.sqrt(len(xis))  # γ‖Δ‖ · std of the mean ξ
    assert float((mixed.mean(0) - updates[0]).abs().max()) < 5 * spread
    aware = HogMechanism(clipping_norm=10.0, noise_multiplier=0.05, noise_aware=MIXING)
    assert np.array_equal(aware.xis(_NoBits(), 8, [3, 5]), np.zeros(2))
    out, stats = aware.constrain_sensitivity(updates, terms, torch.zeros(1))
    assert not any(stats.clipped) and stats.mixing_ratios[0] > 0.01  # mixed, inside the ball
    torch.testing.assert_close(out - updates, -MIXING.coefficient(0.05, 10.0) * terms, rtol=1e-9, atol=1e-12)


class _NoBits:
    def __getattr__(self, name):
        raise AssertionError("noise-aware mixing draws nothing from the mixing stream")


def test_extreme_and_zero_terms_stay_inside_the_ball():
    mechanism = HogMechanism(clipping_norm=1.0, noise_multiplier=1.0, noise_aware=MIXING)
    updates = torch.tensor([[1e-300, 0.0], [1e300, -1e300], [0.3, 0.4], [0.0, 0.0], [0.3, 0.4]], dtype=torch.float64)
    terms = torch.tensor([[1e300, 1e300], [1e300, 1e300], [0.0, 0.0], [1e308, -1e308], [5e-324, 0.0]],
                         dtype=torch.float64)
    out, _ = mechanism.constrain_sensitivity(updates, terms, torch.zeros(5))
    assert bool(torch.isfinite(out).all())
    assert bool((torch.linalg.vector_norm(out, dim=1) <= 1.0).all())
    assert torch.equal(out[2], updates[2])  # a zero term: the update, unchanged
    torch.testing.assert_close(out[0], -torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2))
    torch.testing.assert_close(out[3], torch.tensor([-1.0, 1.0], dtype=torch.float64) / math.sqrt(2))


def test_kappa_zero_is_gaussian_bit_for_bit():
    updates, terms = _rows()
    aware = HogMechanism(1.0, 1.3, noise_aware=NoiseAwareMixing(0.0, 0.7, 0.9, 20))
    a, _ = aware.constrain_sensitivity(updates, terms, torch.zeros(len(updates)))
    b, _ = GaussianMechanism(1.0, 1.3).constrain_sensitivity(updates, None, torch.zeros(len(updates)))
    assert torch.equal(a, b)


def _config(**overrides) -> RunConfig:
    return RunConfig().with_overrides({"population": 100, "sampling-rate": 0.2, "rounds": 40, **overrides})


def test_the_config_builds_the_mechanism_with_the_servers_step():
    config = _config(**{"hog-mixing": "noise-aware", "noise-aware-strength": 0.5, "server-optimizer": "momentum",
                        "server-momentum": 0.8, "server-learning-rate": 2.0, "clipping-norm": 0.5})
    mechanism = config.privacy_mechanism
    assert isinstance(mechanism, HogMechanism) and mechanism.noise_aware is not None
    tau = 2.0 * config.noise_multiplier * 0.5 / (20 * (1 - 0.8))
    assert mechanism.noise_aware.coefficient(mechanism.noise_multiplier, mechanism.clipping_norm) == pytest.approx(
        0.5 * 0.5 * tau**2, rel=1e-12)
    plain = _config(**{"hog-mixing": "noise-aware", "server-momentum": 0.8}).privacy_mechanism  # sgd: no momentum
    assert plain.noise_aware.server_momentum == 0.0
    assert _config().privacy_mechanism.noise_aware is None  # random-sign stays the default
    assert "τ=" in mechanism.describe() and "noise-aware" in mechanism.describe()
    # adaptive clipping's round: τ follows the new C and σ
    adapted = mechanism.with_clipping(2.0, 0.5)
    assert adapted.noise_aware.noise_std(0.5, 2.0) == pytest.approx(tau * 0.5 * 2.0 / (config.noise_multiplier * 0.5))


def test_same_sigma_same_epsilon_as_gaussian():
    base = {"target-epsilon": 3.0, "noise-multiplier": 1.0}
    gaussian = _config(mechanism="gaussian", **base).calibrated()
    aware = _config(mechanism="hog", **{"hog-mixing": "noise-aware"}, **base).calibrated()
    assert aware.noise_multiplier == gaussian.noise_multiplier
    epsilons = []
    for config in (gaussian, aware):
        accountant = config.privacy_mechanism.accountant(config.sampling, config.sampling_rate, config.population,
                                                         config.delta, config.accountant)
        for _ in range(config.rounds):
            accountant.compose_round()
        epsilons.append(accountant.epsilon())
    assert epsilons[0] == epsilons[1] <= 3.0 + 1e-9


@pytest.mark.parametrize("overrides, key", [
    ({"hog-mixing": "signed"}, "hog-mixing"),
    ({"hog-mixing": "noise-aware", "server-optimizer": "adam"}, "server-optimizer"),
    ({"hog-mixing": "noise-aware", "server-step": "newton", "proxy-fraction": 0.1}, "server-step"),
    ({"hog-mixing": "noise-aware", "hog-direction": "update"}, "hog-direction"),
    ({"hog-mixing": "noise-aware", "momentum": 1.0}, "momentum"),
    ({"noise-aware-strength": -1.0}, "noise-aware-strength"),
    ({"noise-aware-strength": math.inf}, "noise-aware-strength"),
    ({"noise-aware-samples": 0}, "noise-aware-samples"),
])
def test_the_config_refuses_what_tau_or_lambda_are_not_derived_for(overrides, key):
    with pytest.raises(ConfigError, match=key):
        _config(**overrides)


def test_build_mechanism_passes_noise_aware_to_hog_only():
    assert build_mechanism("hog", 1.0, 1.0, 0.5, MIXING).noise_aware is MIXING
    assert isinstance(build_mechanism("gaussian", 1.0, 1.0, 0.5, MIXING), GaussianMechanism)


# --- the clients' terms --------------------------------------------------------------------------------


def test_the_clients_estimate_is_hutchinson_over_its_seeded_rademacher_directions():
    from fedhog.client_app import noise_aware_estimate
    from fedhog.data import ArrayData
    from fedhog.training import hog_rows

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    g = np.random.default_rng(0)
    data = ArrayData(g.normal(size=(40, 4)).astype(np.float32), g.integers(0, 3, 40))
    config = _config(**{"hog-mixing": "noise-aware", "noise-aware-samples": 3, "hog-batch-size": 16})
    estimate, finite = noise_aware_estimate(model, data, config, seed=11)
    params = {k: p.detach() for k, p in model.named_parameters()}
    stacked = random_directions(params, 3, "rademacher", torch.Generator().manual_seed(11))
    assert all(bool((d.abs() == 1).all()) for d in stacked.values())
    rows = hog_rows(len(data), 16, 11)
    expected = hessian_trace_gradient(model, torch.as_tensor(data.x[rows]), torch.as_tensor(data.y[rows]),
                                      directions=[{k: d[j] for k, d in stacked.items()} for j in range(3)],
                                      method="autograd")
    assert finite
    for k in params:
        torch.testing.assert_close(estimate[k], expected.vector[k], rtol=1e-4, atol=1e-6)
    control, _ = noise_aware_estimate(model, data, _config(**{"hog-mixing": "noise-aware", "noise-aware-samples": 3,
                                                              "hog-batch-size": 16, "hog-term": "random"}), seed=11)
    norm = lambda v: float(torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in v.values()])))  # noqa: E731
    assert norm(control) == pytest.approx(norm(estimate), rel=1e-6)
    cosine = sum(float((control[k].double() * estimate[k].double()).sum()) for k in params) / norm(control) ** 2
    assert abs(cosine) < 0.9  # another direction
