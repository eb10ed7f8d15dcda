"""Taylor-mode engine against nested torch.func / triple backward in float64, and its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhog.derivatives import (
    directional_derivatives,
    hessian_vector_product,
    third_order_vector,
)
from fedhog.derivatives.taylor import Unsupported, program_for


class Functional(nn.Module):
    """Uses functional ops, methods, a raw parameter, division and matmul (traced by torch.fx)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 5)
        self.w = nn.Parameter(torch.randn(5, 3) * 0.5)
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x.view(x.size(0), -1)))
        h = F.gelu(h) + torch.sigmoid(h) * h - F.softplus(h) / (2.0 + h * h)
        return (h @ self.w) * self.scale + F.leaky_relu(h[:, :3], 0.1)


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    bn = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Softplus(beta=2.0), nn.Linear(5, 3))
    with torch.no_grad():
        bn[1].running_mean.uniform_(-1, 1)
        bn[1].running_var.uniform_(0.5, 2)
    return {
        "mlp": (nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.GELU(), nn.Linear(5, 3)), (6,)),
        "relu": (nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5), nn.Sigmoid(), nn.Linear(5, 3)), (6,)),
        "cnn1d": (
            nn.Sequential(
                nn.Conv1d(1, 3, 3, padding=1),
                nn.Tanh(),
                nn.AvgPool1d(2),
                nn.Conv1d(3, 2, 3, stride=2),
                nn.Tanh(),
                nn.Flatten(),
                nn.Linear(2, 3),
            ),
            (1, 8),
        ),
        "cnn2d": (
            nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(8, 3)),
            (1, 5, 5),
        ),
        "maxpool": (
            nn.Sequential(
                nn.Conv2d(1, 3, 3, padding="same"), nn.Softplus(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 3)
            ),
            (1, 5, 5),
        ),
        "batchnorm": (bn, (6,)),
        "functional": (Functional(), (6,)),
    }


MODELS = _models()


def _setup(name: str, loss: str, batch: int = 4):
    model, shape = MODELS[name]
    model = model.double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, *shape, generator=g, dtype=torch.float64)
    y = (
        torch.randint(0, 3, (batch,), generator=g)
        if loss == "cross_entropy"
        else torch.randn(batch, 3, generator=g, dtype=torch.float64)
    )
    v = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 for k, p in model.named_parameters()}
    return model, x, y, v


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("name", list(MODELS))
def test_taylor_matches_nested_jvp_to_roundoff(name, loss):
    model, x, y, v = _setup(name, loss)
    program_for(model)  # every model above must be fully supported
    taylor = directional_derivatives(model, x, y, v, order=5, loss=loss, method="taylor")
    nested = directional_derivatives(model, x, y, v, order=5, loss=loss, method="torch.func")
    assert taylor.method == "taylor" and nested.method == "torch.func"
    scale = nested.values.abs().clamp_min(1.0)
    assert ((taylor.values - nested.values).abs() / scale).max() < 1e-12


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
@pytest.mark.parametrize("name", list(MODELS))
def test_taylor_vectors_match_triple_backward(name, loss):
    model, x, y, v = _setup(name, loss)
    for f in (third_order_vector, hessian_vector_product):
        taylor = f(model, x, y, v, loss=loss, method="taylor")
        ref = f(model, x, y, v, loss=loss, method="autograd")
        assert taylor.method == "taylor" and taylor.finite
        assert abs(taylor.loss - ref.loss) < 1e-13
        for k in v:
            torch.testing.assert_close(taylor.vector[k], ref.vector[k], rtol=1e-10, atol=1e-12)


def test_auto_picks_taylor_and_falls_back_for_unknown_modules():
    model, x, y, v = _setup("mlp", "cross_entropy")
    assert third_order_vector(model, x, y, v).method == "taylor"
    assert directional_derivatives(model, x, y, v, order=3).method == "taylor"
    torch.manual_seed(2)
    elu = nn.Sequential(nn.Linear(6, 4), nn.ELU(), nn.Linear(4, 3)).double()
    u = {k: torch.randn_like(p) for k, p in elu.named_parameters()}
    with pytest.raises(Unsupported):
        program_for(elu)
    res = third_order_vector(elu, x, y, u)
    assert res.method == "torch.func" and res.finite
    with pytest.raises(ValueError, match="no Taylor rule for module"):
        third_order_vector(elu, x, y, u, method="taylor")
    # a callable loss has no series rule either
    assert third_order_vector(model, x, y, v, loss=lambda out, t: (out**4).mean()).method == "torch.func"


def test_taylor_per_example_matches_single_examples():
    model, x, y, v = _setup("cnn1d", "cross_entropy", batch=3)
    per = third_order_vector(model, x, y, v, per_example=True, method="taylor")
    dirs = directional_derivatives(model, x, y, v, order=4, per_example=True, method="taylor")
    assert dirs.values.shape == (3, 5)
    for i in range(3):
        one = third_order_vector(model, x[i : i + 1], y[i : i + 1], v, method="autograd")
        for k in v:
            torch.testing.assert_close(per.vector[k][i], one.vector[k], rtol=1e-10, atol=1e-12)
        ref = directional_derivatives(model, x[i : i + 1], y[i : i + 1], v, order=4, method="torch.func")
        torch.testing.assert_close(dirs.values[i], ref.values, rtol=1e-10, atol=1e-12)


def test_taylor_reports_non_finite():
    model, x, y, v = _setup("mlp", "cross_entropy")
    v = {k: t.clone() for k, t in v.items()}
    v["0.weight"][0, 0] = float("nan")
    assert not third_order_vector(model, x, y, v, method="taylor").finite
    assert not directional_derivatives(model, x, y, v, order=3, method="taylor").finite


def test_taylor_float32_matches_float64_reference():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(24, 3))
    x, y = torch.randn(8, 1, 8), torch.randint(0, 3, (8,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    t32 = third_order_vector(model, x, y, v, method="taylor")
    d32 = directional_derivatives(model, x, y, v, order=4, method="taylor")
    assert t32.vector["0.weight"].dtype == torch.float32 and d32.values.dtype == torch.float32
    model64 = model.double()
    v64 = {k: t.double() for k, t in v.items()}
    t64 = third_order_vector(model64, x.double(), y, v64, method="autograd")
    d64 = directional_derivatives(model64, x.double(), y, v64, order=4, method="torch.func")
    for k in v:
        torch.testing.assert_close(t32.vector[k].double(), t64.vector[k], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d32.values.double(), d64.values, rtol=1e-4, atol=1e-5)


def test_forward_hooks_are_not_skipped():
    # torch.fx does not run hooks: Taylor mode must refuse, and auto must fall back to a formulation that runs them
    model, x, y, v = _setup("mlp", "cross_entropy")
    handle = model[1].register_forward_hook(lambda module, inputs, output: 2.0 * output)
    try:
        with pytest.raises(Unsupported, match="forward hooks"):
            third_order_vector(model, x, y, v, method="taylor")
        res = third_order_vector(model, x, y, v)
        ref = third_order_vector(model, x, y, v, method="autograd")
        assert res.method == "torch.func"
        for k in v:
            torch.testing.assert_close(res.vector[k], ref.vector[k], rtol=1e-10, atol=1e-12)
    finally:
        handle.remove()
    assert third_order_vector(model, x, y, v).method == "taylor"  # traced again once the hook is gone


@pytest.mark.parametrize("coefficients", [2, 3])
def test_gelu_order_two_in_closed_form_matches_the_derivatives_of_gelu(coefficients):
    """GeluOrderTwo's coefficients and reverse pass against autograd's derivatives of F.gelu along s (float64).

    y(s) = gelu(z₀ + z₁s + z₂s²): y₁ = y′(0), y₂ = y″(0)/2, by nested autograd through torch's own GELU; the
    reverse pass against autograd through those same derivatives."""
    from fedhog.derivatives import series

    torch.manual_seed(0)
    z = [torch.randn(4, 6, dtype=torch.float64) * (3.0 if k == 0 else 1.0) for k in range(coefficients)]
    weights = [torch.randn(4, 6, dtype=torch.float64) for _ in range(3)]

    def reference(*z: torch.Tensor) -> list[torch.Tensor]:
        s = torch.zeros((), dtype=torch.float64)
        y1 = torch.autograd.functional.jacobian(lambda t: F.gelu(sum(c * t**k for k, c in enumerate(z))), s,
                                                create_graph=True)
        y2 = torch.autograd.functional.jacobian(
            lambda t: torch.autograd.functional.jacobian(
                lambda u: F.gelu(sum(c * u**k for k, c in enumerate(z))), t, create_graph=True), s,
            create_graph=True) / 2
        return [F.gelu(z[0]), y1, y2]

    leaves = [c.clone().requires_grad_() for c in z]
    fast = series.gelu(tuple(leaves), 3)
    assert torch.is_grad_enabled()
    expected_leaves = [c.clone().requires_grad_() for c in z]
    expected = reference(*expected_leaves)
    for got, want in zip(fast, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got_grads = torch.autograd.grad(sum((y * w).sum() for y, w in zip(fast, weights, strict=True)), leaves)
    want_grads = torch.autograd.grad(sum((y * w).sum() for y, w in zip(expected, weights, strict=True)),
                                     expected_leaves)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
