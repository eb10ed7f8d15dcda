"""The server's step length on proxy data against finite differences of the proxy loss along the step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedhog.config import ConfigError, RunConfig
from fedhog.data import ArrayData
from fedhog.derivatives import cubic_step
from fedhog.models import build_model
from fedhog.server_step import ProxyStepLength, ServerStepSettings


def _problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    proxy = ArrayData(rng.normal(size=(64, 1, 40)).astype(np.float32), rng.integers(0, 10, 64))
    torch.manual_seed(seed)
    model = build_model("mlp", (1, 40), 10, activation="tanh").double()  # the cases below were set on tanh
    keys = list(model.state_dict())
    theta = torch.cat([v.reshape(-1) for v in model.state_dict().values()]).clone()
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(proxy.x).double()), torch.from_numpy(proxy.y))
    names = [n for n, _ in model.named_parameters()]
    grads = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    gradient = torch.cat([grads[k].reshape(-1) for k in keys])
    noise = torch.randn(theta.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    step = -gradient + 0.2 * gradient.norm() / noise.norm() * noise  # roughly where a noisy release points
    return model, proxy, keys, theta, step


def _phi_derivatives(model, proxy, keys, theta, step, h=1e-3):
    """φ′, φ″, φ‴ of φ(s) = L(θ + s·d) by central differences in float64."""
    x, y = torch.from_numpy(proxy.x).double(), torch.from_numpy(proxy.y)
    shapes = [v.shape for v in model.state_dict().values()]

    def phi(s):
        flat = theta + s * step
        parts = flat.split([math.prod(sh) for sh in shapes])
        model.load_state_dict({k: p.reshape(sh) for k, p, sh in zip(keys, parts, shapes, strict=True)})
        with torch.no_grad():
            return float(torch.nn.functional.cross_entropy(model(x), y))

    f = {k: phi(k * h) for k in (-2, -1, 0, 1, 2)}
    d1 = (f[1] - f[-1]) / (2 * h)
    d2 = (f[1] - 2 * f[0] + f[-1]) / h**2
    d3 = (f[2] - 2 * f[1] + 2 * f[-1] - f[-2]) / (2 * h**3)
    return d1, d2, d3


@pytest.mark.parametrize("kind", ["newton", "cubic"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_length_is_the_minimiser_of_the_proxy_loss_model_along_the_step(kind, seed):
    model, proxy, keys, theta, step = _problem(seed)
    d1, d2, d3 = _phi_derivatives(model, proxy, keys, theta, step)
    if d1 >= 0:  # make the step a descent direction of the proxy loss
        step, d1, d3 = -step, -d1, -d3
    chosen = ProxyStepLength(ServerStepSettings(kind, max_scale=50.0), model, proxy, keys)(theta, step)
    reference = cubic_step(d1, d2, d3 if kind == "cubic" else 0.0, max_step=50.0)
    assert chosen.reason == reference.reason == "cubic minimiser"  # an interior minimiser, not a bound
    assert chosen.step == pytest.approx(reference.step, rel=1e-3)
    assert 0 < chosen.step <= 50.0


def test_no_descent_along_the_step_takes_no_step_and_max_scale_bounds_it():
    model, proxy, keys, theta, step = _problem(3)
    d1, _, _ = _phi_derivatives(model, proxy, keys, theta, step)
    ascent = step if d1 > 0 else -step
    length = ProxyStepLength(ServerStepSettings("cubic", max_scale=1e-3), model, proxy, keys)
    assert length(theta, ascent).step == 0.0
    assert length(theta, -ascent).step == pytest.approx(1e-3)


def test_server_step_needs_proxy_data_and_a_known_kind():
    with pytest.raises(ConfigError, match="server-step='cubic' needs proxy-fraction > 0"):
        RunConfig.from_mapping({"server-step": "cubic"})
    with pytest.raises(ConfigError, match="server-step"):
        RunConfig.from_mapping({"server-step": "quartic", "proxy-fraction": 0.05})
    with pytest.raises(ConfigError, match="proxy-fraction"):
        RunConfig.from_mapping({"dataset": "synthetic", "proxy-fraction": 0.05})
    config = RunConfig.from_mapping({"server-step": "newton", "proxy-fraction": 0.05})
    assert config.server_step_settings.kind == "newton"
