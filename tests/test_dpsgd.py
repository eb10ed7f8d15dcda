"""Sample-level DP: local DP-SGD with Opacus (``fedhog.dpsgd``)."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import math

import dp_accounting
import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from torch.func import functional_call, grad, vmap

from fedhog.data import ArrayData, load_digits
from fedhog.dpsgd import DpSgdSettings, record_privacy, train_dpsgd
from fedhog.models import build_model

logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's dropped-RDP-order warnings

DELTA = 1e-5


@pytest.fixture(scope="module")
def digits() -> ArrayData:
    x, y = load_digits()
    return ArrayData(x[:100].astype(np.float64), y[:100])


def _model(name: str = "mlp", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, (1, 8, 8), 10).double()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _settings(sigma: float = 1.0, clip: float = 1.0, accountant: str = "rdp") -> DpSgdSettings:
    return DpSgdSettings(noise_multiplier=sigma, max_grad_norm=clip, delta=DELTA, accountant=accountant)


@pytest.mark.parametrize("name", ["mlp", "cnn2d"])
def test_a_noiseless_step_moves_by_minus_lr_times_the_mean_clipped_per_example_gradient(digits, name):
    data = ArrayData(digits.x[:40], digits.y[:40])
    model = _model(name)
    start = _params(model)
    x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)

    def loss_of_one(params, xi, yi):
        logits = functional_call(model, params, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(start, x, y)
    norms = torch.sqrt(sum((g.reshape(len(x), -1) ** 2).sum(1) for g in per_example.values()))
    clip = float(norms.median())  # half of the examples are clipped
    factor = torch.clamp(clip / norms, max=1.0)
    assert (factor < 1).any() and (factor == 1).any()
    lr = 0.5
    expected = {k: start[k] - lr * (factor.view(-1, *[1] * (g.dim() - 1)) * g).mean(0)
                for k, g in per_example.items()}

    # batch_size = N: q = 1, so the one Poisson batch of the epoch holds every record
    local, privacy = train_dpsgd(model, data, 1, len(data), lr, 0.0, 7, _settings(sigma=0.0, clip=clip))

    assert local.steps == 1 and privacy.steps == 1 and privacy.epsilon == math.inf
    unclipped_change = lr * per_example["features.0.weight" if name == "cnn2d" else "1.weight"].mean(0)
    for k, value in model.named_parameters():  # Opacus clips by C/(‖g‖ + 1e-6): equal to ~1e-6 relative
        change, expected_change = value.detach() - start[k], expected[k] - start[k]
        torch.testing.assert_close(change, expected_change, rtol=0, atol=1e-5 * float(expected_change.abs().max()))
    key = "features.0.weight" if name == "cnn2d" else "1.weight"
    assert not torch.allclose(start[key] - model.get_parameter(key).detach(), unclipped_change)


def test_no_example_moves_the_model_by_more_than_its_clipped_share(digits):
    """Make one record's gradient huge: with σ = 0 its effect on the step stays ≤ lr·C/N."""
    data = ArrayData(digits.x[:20], digits.y[:20])
    poisoned = ArrayData(data.x.copy(), data.y.copy())
    poisoned.x[0] *= 1e4
    moved = {}
    for name, d in (("clean", data), ("poisoned", poisoned)):
        model = _model()
        train_dpsgd(model, d, 1, len(d), 1.0, 0.0, 0, _settings(sigma=0.0, clip=0.1))
        moved[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
    # the step is −lr·Σᵢ clip(gᵢ)/N; only record 0 differs, and both of its clipped gradients have norm ≤ C
    assert torch.linalg.norm(moved["clean"] - moved["poisoned"]) <= 2 * 1.0 * 0.1 / len(data) + 1e-12


def test_gaussian_noise_of_std_sigma_c_is_added(digits):
    data = ArrayData(digits.x[:50], digits.y[:50])
    sigma, clip, lr = 2.0, 0.5, 0.1
    noiseless, noisy, again = _model(), _model(), _model()
    train_dpsgd(noiseless, data, 1, len(data), lr, 0.0, 3, _settings(sigma=0.0, clip=clip))
    train_dpsgd(noisy, data, 1, len(data), lr, 0.0, 3, _settings(sigma=sigma, clip=clip))
    train_dpsgd(again, data, 1, len(data), lr, 0.0, 3, _settings(sigma=sigma, clip=clip))
    flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    # one step over all N records: θ_noisy − θ_noiseless = −lr · noise / N, noise ~ N(0, (σC)²) per coordinate
    noise = (flat(noiseless) - flat(noisy)) * len(data) / lr
    assert len(noise) > 4000
    assert float(noise.std()) == pytest.approx(sigma * clip, rel=0.05)
    assert abs(float(noise.mean())) < 4 * sigma * clip / math.sqrt(len(noise))
    assert torch.equal(flat(noisy), flat(again))  # deterministic for a seed


def test_the_seed_drives_noise_and_poisson_sampling(digits):
    runs = []
    for seed in (1, 1, 2):
        model = _model()
        local, _ = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, seed, _settings())
        runs.append((local.mean_loss, torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][0] != runs[2][0] and not torch.equal(runs[0][1], runs[2][1])


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_is_opacus_accountant_of_the_poisson_subsampled_gaussian(digits, accountant):
    sigma, epochs, batch_size = 1.0, 2, 10  # q = 10/100, ⌊1/q⌋ = 10 steps an epoch
    _, privacy = train_dpsgd(_model(), digits, epochs, batch_size, 0.1, 0.0, 0, _settings(sigma, accountant=accountant))
    q, steps = batch_size / len(digits), epochs * 10
    assert privacy.steps == steps
    assert privacy.accountant_state == {"mechanism": accountant, "history": [[sigma, q, steps]]}

    independent = PRVAccountant() if accountant == "prv" else RDPAccountant()
    for _ in range(steps):
        independent.step(noise_multiplier=sigma, sample_rate=q)
    assert privacy.epsilon == pytest.approx(independent.get_epsilon(delta=DELTA), rel=1e-12)

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    if accountant == "rdp":
        rdp = dp_accounting.rdp.RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS)
        assert privacy.epsilon == pytest.approx(rdp.compose(event).get_epsilon(DELTA), rel=2e-3)
    else:  # PRV is an upper bound within eps_error = 0.01 of the tight PLD value
        pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(DELTA)
        assert pld - 0.005 <= privacy.epsilon <= pld + 0.03


def test_epsilon_accumulates_over_rounds_only_when_the_state_is_carried(digits):
    settings = _settings(accountant="rdp")
    model = _model()
    _, first = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, 1, settings)
    carried = json.loads(json.dumps(first.accountant_state))  # as stored in a Flower ConfigRecord
    _, second = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, 2, settings, carried)
    _, fresh = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, 2, settings)

    assert second.steps == 2 * first.steps and second.epsilon > first.epsilon
    twice = RDPAccountant()
    for _ in range(second.steps):
        twice.step(noise_multiplier=1.0, sample_rate=0.1)
    assert second.epsilon == pytest.approx(twice.get_epsilon(delta=DELTA), rel=1e-12)
    assert fresh.steps == first.steps and fresh.epsilon == pytest.approx(first.epsilon, rel=1e-12)
    assert record_privacy(settings, carried).epsilon == first.epsilon
    assert record_privacy(settings, None).epsilon == 0.0


def test_the_trained_model_is_the_plain_module_with_its_own_keys(digits):
    model = _model("cnn2d")
    keys, kind, global_state = list(model.state_dict()), type(model), copy.deepcopy(model.state_dict())
    original_attrs = {n: set(vars(p)) for n, p in model.named_parameters()}
    for round_seed in (0, 1):  # a second call must not find hooks of the first
        train_dpsgd(model, digits, 1, 16, 0.1, 0.9, round_seed, _settings())
    assert type(model) is kind and list(model.state_dict()) == keys
    assert not any(k.startswith("_module.") for k in model.state_dict())
    for module in model.modules():
        assert not (module._forward_hooks or module._backward_hooks or module._forward_pre_hooks)
        assert not hasattr(module, "autograd_grad_sample_hooks")
    for name, p in model.named_parameters():
        assert set(vars(p)) == original_attrs[name] and p.grad is None
    update = {k: v - global_state[k] for k, v in model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in update.values()) and any(v.abs().sum() > 0 for v in update.values())


def test_tiny_batches_take_noise_only_steps_on_empty_poisson_batches(digits):
    data = ArrayData(digits.x[:30], digits.y[:30])
    local, privacy = train_dpsgd(_model(), data, 1, 1, 0.01, 0.0, 5, _settings())  # q = 1/30: many empty batches
    assert local.steps == privacy.steps == 30 and math.isfinite(local.mean_loss)
    assert privacy.accountant_state["history"] == [[1.0, 1 / 30, 30]]


def test_a_client_without_records_trains_nothing_and_spends_nothing(digits):
    settings = _settings()
    _, before = train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, 0, settings)
    model = _model()
    start = _params(model)
    empty = ArrayData(digits.x[:0], digits.y[:0])
    local, after = train_dpsgd(model, empty, 1, 10, 0.1, 0.0, 0, settings, before.accountant_state)
    assert local.steps == 0 and math.isnan(local.mean_loss)
    assert after.epsilon == before.epsilon and after.accountant_state == before.accountant_state
    assert all(torch.equal(p.detach(), start[k]) for k, p in model.named_parameters())
    assert train_dpsgd(model, empty, 1, 10, 0.1, 0.0, 0, settings)[1].epsilon == 0.0


@pytest.mark.parametrize("field, value", [
    ("noise_multiplier", -1.0), ("noise_multiplier", math.inf), ("max_grad_norm", 0.0),
    ("max_grad_norm", math.nan), ("delta", 0.0), ("delta", 1.0), ("accountant", "pld"),
])
def test_bad_settings_are_rejected_by_name(field, value):
    kwargs = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": DELTA, field: value}
    with pytest.raises(ValueError, match=f"dpsgd: {field}="):
        DpSgdSettings(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("epochs", 0), ("batch_size", 0), ("batch_size", 2.5), ("learning_rate", 0.0), ("momentum", -0.1),
    ("accountant_state", {"mechanism": "prv", "history": []}), ("accountant_state", {"history": [[1.0]]}),
])
def test_bad_training_arguments_are_rejected_by_name(digits, field, value):
    kwargs = {"epochs": 1, "batch_size": 10, "learning_rate": 0.1, "momentum": 0.0, field: value}
    with pytest.raises(ValueError, match=f"dpsgd: {field}="):
        train_dpsgd(_model(), digits, seed=0, settings=_settings(), **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("torchcsprng") is not None, reason="torchcsprng is installed")
def test_secure_mode_needs_torchcsprng(digits):
    settings = DpSgdSettings(1.0, 1.0, DELTA, secure_mode=True)
    with pytest.raises(ImportError, match="torchcsprng"):
        train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, 0, settings)
