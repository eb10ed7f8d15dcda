"""Normalisation layers to every order, in every method, against finite differences (float64).

PyTorch 2.13's fused ``layer_norm``, ``instance_norm`` and batch-statistics
``batch_norm`` kernels have wrong higher-order derivatives (the canary test
below shows it).  For a model with one scalar parameter ``a`` every quantity of
the engine is a derivative of the one-dimensional ``L(a)`` (gradient ``L′``,
Hessian-vector product and dense Hessian ``L″``, third-order vector ``L‴``,
directional derivatives ``L⁽ᵏ⁾``), which a polynomial fit of loss values
alone gives to ~1e-9 — a reference that shares no code with any AD mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedhog.derivatives import (
    Unsupported,
    UntrustedOperation,
    directional_derivatives,
    gradient,
    hessian,
    hessian_vector_product,
    third_order_step_size,
    third_order_vector,
)
from fedhog.derivatives.losses import mse
from fedhog.derivatives.taylor import program_for


class Scalar(nn.Module):
    """``tanh(norm(a·x + a²·w))`` (the issue's example) with one scalar parameter ``a``."""

    def __init__(self, norm: nn.Module | str, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        g = torch.Generator().manual_seed(0)
        self.register_buffer("w", torch.randn(shape, generator=g, dtype=torch.float64))
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.a * x + self.a * self.a * self.w
        z = F.layer_norm(z, (z.shape[-1],)) if self.norm == "functional_layer_norm" else self.norm(z)
        return torch.tanh(z).flatten(1)


def _affine(m: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + 1)
    return m


CASES = {  # name: (normalisation, per-example input shape, Taylor mode has a rule)
    "layer_norm": (lambda: nn.LayerNorm(6, elementwise_affine=False), (6,), True),
    "layer_norm_affine_2d": (lambda: _affine(nn.LayerNorm((3, 4))), (3, 4), True),
    "functional_layer_norm": (lambda: "functional_layer_norm", (6,), True),
    "group_norm": (lambda: _affine(nn.GroupNorm(2, 4)), (4, 5), True),
    "rms_norm": (lambda: _affine(nn.RMSNorm(6)), (6,), True),
    "instance_norm": (lambda: nn.InstanceNorm1d(4, affine=False), (4, 5), False),
    "batch_norm_batch_statistics": (lambda: nn.BatchNorm1d(4, track_running_stats=False, affine=False), (4, 5), False),
}


def _scalar_case(name: str):
    make, shape, taylor = CASES[name]
    model = Scalar(make(), shape).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    y = torch.randn(3, int(np.prod(shape)), generator=g, dtype=torch.float64)
    # v = e_a: along it, and in the entry of ``a``, every quantity is a derivative of L(a)
    v = {k: (torch.ones_like(p) if k == "a" else torch.zeros_like(p)) for k, p in model.named_parameters()}
    return model, x, y, v, taylor


def _fd_derivatives(model: Scalar, x, y, order: int = 5) -> list[float]:
    """``L⁽ᵏ⁾(a)`` for ``k ≤ order`` from a degree-16 Chebyshev fit of 33 loss values on ``a ± 0.05``."""
    a0 = float(model.a)
    nodes = 0.05 * np.cos(np.pi * (np.arange(33) + 0.5) / 33)
    params = dict(model.named_parameters())
    values = []
    with torch.no_grad():
        for t in nodes:
            p = {**params, "a": torch.tensor(a0 + t, dtype=torch.float64)}
            values.append(float(mse(functional_call(model, p, (x,)), y)))
    fit = np.polynomial.chebyshev.Chebyshev.fit(nodes, values, 16)
    return [float(fit.deriv(k)(0.0)) if k else float(fit(0.0)) for k in range(order + 1)]


def _assert_derivative(got: float, expected: float, rtol: float) -> None:
    assert abs(got - expected) <= rtol * max(1.0, abs(expected)), (got, expected)


@pytest.mark.parametrize("name", list(CASES))
def test_every_quantity_matches_finite_differences(name):
    model, x, y, v, taylor = _scalar_case(name)
    ref = _fd_derivatives(model, x, y)
    assert abs(ref[3]) > 1e-2  # the third derivative is not trivially zero
    if taylor:
        program_for(model)
    methods = ["taylor", "torch.func", "autograd"] if taylor else ["torch.func", "autograd"]
    for method in methods:
        _assert_derivative(float(gradient(model, x, y, loss="mse", method=method).vector["a"]), ref[1], 1e-8)
        hv = hessian_vector_product(model, x, y, v, loss="mse", method=method)
        _assert_derivative(float(hv.vector["a"]), ref[2], 1e-7)
        t = third_order_vector(model, x, y, v, loss="mse", method=method)
        assert t.finite and t.method == method
        _assert_derivative(float(t.vector["a"]), ref[3], 1e-6)
        if method != "autograd":
            d = directional_derivatives(model, x, y, v, order=5, loss="mse", method=method).values
            for k in range(1, 6):
                _assert_derivative(float(d[k]), ref[k], 1e-6 if k <= 3 else 1e-4)
    h = hessian(model, x, y, loss="mse").values
    index = [k for k, _ in model.named_parameters()].index("a")
    _assert_derivative(float(h[index, index]), ref[2], 1e-7)
    # auto picks Taylor mode when it has a rule, else the routed torch.func
    assert third_order_vector(model, x, y, v, loss="mse").method == ("taylor" if taylor else "torch.func")


def test_per_example_layer_norm():
    model, x, y, v, _ = _scalar_case("layer_norm")
    for method in ("taylor", "torch.func"):
        per = third_order_vector(model, x, y, v, loss="mse", method=method, per_example=True)
        for i in range(x.shape[0]):
            ref = _fd_derivatives(model, x[i : i + 1], y[i : i + 1], order=3)
            _assert_derivative(float(per.vector["a"][i]), ref[3], 1e-6)


def test_multi_parameter_layer_norm_model_and_step_size():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 6), nn.GroupNorm(3, 6), nn.Tanh(),
                          nn.Linear(6, 3)).double()  # fmt: skip
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    v = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) for k, p in model.named_parameters()}
    ref = third_order_vector(model, x, y, v, method="autograd").vector  # routed: mean/var/rsqrt
    for method in ("taylor", "torch.func"):
        got = third_order_vector(model, x, y, v, method=method).vector
        for k in v:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12)
    h = hessian(model, x, y).values
    torch.testing.assert_close(h, h.T, rtol=0, atol=1e-12)
    flat_v = torch.cat([v[k].reshape(-1) for k in v])
    hv = hessian_vector_product(model, x, y, v, method="taylor").vector
    torch.testing.assert_close(h @ flat_v, torch.cat([hv[k].reshape(-1) for k in v]), rtol=1e-10, atol=1e-12)
    a = third_order_step_size(model, x, y, method="taylor", max_step=5.0)
    b = third_order_step_size(model, x, y, method="torch.func", max_step=5.0)
    assert a.reason == b.reason and a.step == pytest.approx(b.step, rel=1e-9)


def test_canary_torch_layer_norm_higher_derivatives_are_wrong():
    """The routing exists because torch's own kernel is wrong; skip once a torch version fixes it."""
    model, x, y, _, _ = _scalar_case("layer_norm")
    ref = _fd_derivatives(model, x, y, order=3)[3]
    a = model.a.detach().clone().requires_grad_(True)
    out = mse(functional_call(model, {"a": a}, (x,)), y)  # no TrustedDerivatives: torch's fused kernel
    for _ in range(3):
        (out,) = torch.autograd.grad(out, a, create_graph=True)
    if abs(float(out) - ref) <= 1e-6 * max(1.0, abs(ref)):
        pytest.skip(f"torch {torch.__version__} differentiates layer_norm right to third order")
    assert abs(float(out) - ref) > 1e-3 * max(1.0, abs(ref))


class FusedKernel(nn.Module):
    """Calls the fused kernel directly: no formulation of it is trusted."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.native_layer_norm(self.lin(x), (3,), None, None, 1e-5)[0]


def test_fused_kernel_is_refused_in_every_method():
    model = FusedKernel().double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    with pytest.raises(UntrustedOperation, match="native_layer_norm"):
        third_order_vector(model, x, y, v)
    for method in ("torch.func", "autograd"):
        with pytest.raises(UntrustedOperation, match="native_layer_norm"):
            hessian_vector_product(model, x, y, v, method=method)
    with pytest.raises(Unsupported, match="taylor"):
        third_order_vector(model, x, y, v, method="taylor")
    with pytest.raises(UntrustedOperation):
        hessian(model, x, y)
