"""Derivative engine against finite differences, closed forms and non-finite inputs (float64)."""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import call_at
from torch import nn
from torch.func import functional_call

from fedhog.derivatives import (
    directional_derivatives,
    gradient,
    hessian,
    hessian_vector_product,
    third_order_vector,
)
from fedhog.derivatives.losses import cross_entropy, mse

METHODS = ["taylor", "torch.func", "autograd"]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Conv1d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6, 3)).double()


def _batch(model: nn.Module, loss: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = (
        torch.randn(5, 4, generator=g, dtype=torch.float64)
        if isinstance(model[0], nn.Linear)
        else (torch.randn(5, 1, 8, generator=g, dtype=torch.float64))
    )
    y = (
        torch.randint(0, 3, (5,), generator=g)
        if loss == "cross_entropy"
        else torch.randn(5, 3, generator=g, dtype=torch.float64)
    )
    return x, y


def _random_like(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(p.shape, generator=g, dtype=p.dtype) for k, p in model.named_parameters()}


def _loss_at(model, x, y, loss, params) -> torch.Tensor:
    out = functional_call(model, params, (x,))
    return {"cross_entropy": cross_entropy, "mse": mse}[loss](out, y)


def _shifted(model: nn.Module, u: dict, eps: float) -> dict:
    return {k: p.detach() + eps * u[k] for k, p in model.named_parameters()}


def _fd(fn, model: nn.Module, u: dict, eps: float):
    """Central difference of ``fn(params)`` along ``u``; works for dicts and tensors."""
    plus, minus = fn(_shifted(model, u, eps)), fn(_shifted(model, u, -eps))
    if isinstance(plus, dict):
        return {k: (plus[k] - minus[k]) / (2 * eps) for k in plus}
    return (plus - minus) / (2 * eps)


def _assert_close(a: dict, b: dict, rtol: float, atol: float) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol)


CASES = [(_mlp, "cross_entropy"), (_mlp, "mse"), (_cnn, "cross_entropy"), (_cnn, "mse")]


@pytest.mark.parametrize("make,loss", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_gradient_and_hvp_match_finite_differences(make, loss, method):
    model = make()
    x, y = _batch(model, loss)
    v, u = _random_like(model, 3), _random_like(model, 4)
    g = gradient(model, x, y, loss=loss, method=method)
    fd_dir = _fd(lambda p: _loss_at(model, x, y, loss, p), model, u, 1e-5)
    assert torch.allclose(sum((g.vector[k] * u[k]).sum() for k in u), fd_dir, rtol=1e-7, atol=1e-9)

    hv = hessian_vector_product(model, x, y, v, loss=loss, method=method)
    fd = _fd(lambda p: call_at(model, p, gradient, x, y, loss=loss).vector, model, v, 1e-5)
    _assert_close(hv.vector, fd, rtol=1e-6, atol=1e-8)
    assert hv.finite and hv.method == method


@pytest.mark.parametrize("make,loss", CASES)
@pytest.mark.parametrize("method", METHODS)
def test_third_order_vector_matches_finite_differences(make, loss, method):
    model = make()
    x, y = _batch(model, loss)
    v, u = _random_like(model, 3), _random_like(model, 4)
    t = third_order_vector(model, x, y, v, loss=loss, method=method)
    assert t.finite and t.method == method
    with torch.no_grad():
        assert abs(t.loss - float(_loss_at(model, x, y, loss, dict(model.named_parameters())))) < 1e-12
    # t = T[v, v, ·] is the derivative of H(θ) v along v (symmetry of the third-derivative tensor)
    fd = _fd(lambda p: call_at(model, p, hessian_vector_product, x, y, v, loss=loss).vector, model, v, 1e-5)
    _assert_close(t.vector, fd, rtol=1e-6, atol=1e-8)

    # uᵀ t is the derivative of vᵀ H(θ) v along an unrelated u
    def vhv(p):
        hv = call_at(model, p, hessian_vector_product, x, y, v, loss=loss).vector
        return sum((hv[k] * v[k]).sum() for k in v)

    ut = sum((t.vector[k] * u[k]).sum() for k in u)
    torch.testing.assert_close(ut, _fd(vhv, model, u, 1e-5), rtol=1e-6, atol=1e-8)
    for k, p in model.named_parameters():
        assert t.vector[k].shape == p.shape and t.vector[k].dtype == p.dtype
        assert t.vector[k].grad_fn is None and not t.vector[k].requires_grad


def _logistic() -> tuple[nn.Linear, torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(5)
    model = nn.Linear(4, 3).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    v = {"weight": torch.randn(3, 4, dtype=torch.float64), "bias": torch.randn(3, dtype=torch.float64)}
    return model, x, y, v


def _softmax_moments(model, x, v):
    """Softmax p and the logit perturbation δ = V x + b_v per example (logistic regression)."""
    with torch.no_grad():
        p = torch.softmax(model(x), dim=-1)
    delta = x @ v["weight"].T + v["bias"]
    return p, delta


@pytest.mark.parametrize("method", METHODS)
def test_third_order_vector_closed_form_logistic_regression(method):
    # L = mean lse(Wx+b) - z_y; vᵀHv = mean Var_p(δ) with δ = Vx + b_v independent of θ, and
    # ∂Var_p(δ)/∂z_a = p_a[(δ_a − μ)² − Var], μ = E_p δ, chained through z = Wx + b.
    model, x, y, v = _logistic()
    p, delta = _softmax_moments(model, x, v)
    mu = (p * delta).sum(-1, keepdim=True)
    var = (p * (delta - mu) ** 2).sum(-1, keepdim=True)
    dz = p * ((delta - mu) ** 2 - var) / x.shape[0]
    t = third_order_vector(model, x, y, v, method=method)
    torch.testing.assert_close(t.vector["weight"], dz.T @ x, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(t.vector["bias"], dz.sum(0), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("method", ["taylor", "torch.func"])
def test_directional_derivatives_closed_form_cumulants(method):
    # dᵏ/dsᵏ lse(z + sδ) is the k-th cumulant of δ under softmax(z); −z_y only enters k = 1.
    model, x, y, v = _logistic()
    p, delta = _softmax_moments(model, x, v)
    mu = (p * delta).sum(-1, keepdim=True)
    m = [(p * (delta - mu) ** j).sum(-1) for j in range(6)]
    picked = delta.gather(-1, y[:, None]).squeeze(-1)
    expected = torch.stack(
        [
            torch.tensor(float(cross_entropy(model(x), y)), dtype=torch.float64),
            (mu.squeeze(-1) - picked).mean(),
            m[2].mean(),
            m[3].mean(),
            (m[4] - 3 * m[2] ** 2).mean(),
            (m[5] - 10 * m[3] * m[2]).mean(),
        ]
    )
    d = directional_derivatives(model, x, y, v, order=5, method=method)
    torch.testing.assert_close(d.values, expected.detach(), rtol=1e-11, atol=1e-13)


def test_hessian_closed_form_linear_mse():
    # L = mean((Wx + b − y)²) over B×C entries: H = 2/(B C) · I_C ⊗ [x;1][x;1]ᵀ summed over examples.
    torch.manual_seed(6)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    h = hessian(model, x, y, loss="mse").values
    xa = torch.cat([x, torch.ones(5, 1, dtype=torch.float64)], 1)
    gram = 2 * xa.T @ xa / (5 * 2)
    blocks = torch.zeros(8, 8, dtype=torch.float64)  # order: weight (2×3 row-major), bias (2)
    idx = [[0, 1, 2, 6], [3, 4, 5, 7]]
    for rows in idx:
        blocks[torch.tensor(rows)[:, None], torch.tensor(rows)[None, :]] = gram
    torch.testing.assert_close(h, blocks, rtol=1e-12, atol=1e-14)


def test_hessian_closed_form_tiny_mlp():
    # f(x) = a·tanh(w x + b), L = mean (f − y)²; derivatives by hand with h' = 1 − h², h'' = −2 h h'.
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(1, 1), nn.Tanh(), nn.Linear(1, 1, bias=False)).double()
    x, y = torch.randn(7, 1, dtype=torch.float64), torch.randn(7, 1, dtype=torch.float64)
    w, b, a = model[0].weight.item(), model[0].bias.item(), model[2].weight.item()
    x1, y1 = x.squeeze(1), y.squeeze(1)
    h = torch.tanh(w * x1 + b)
    h1 = 1 - h * h
    h2 = -2 * h * h1
    r = a * h - y1
    curv = a * a * h1 * h1 + r * a * h2
    cross = h1 * (a * h + r)
    m = lambda t: 2 * t.mean()  # noqa: E731
    expected = torch.tensor(
        [  # order: w, b, a
            [m(x1 * x1 * curv), m(x1 * curv), m(x1 * cross)],
            [m(x1 * curv), m(curv), m(cross)],
            [m(x1 * cross), m(cross), m(h * h)],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(hessian(model, x, y, loss="mse").values, expected, rtol=1e-12, atol=1e-14)
    v = {
        "0.weight": torch.tensor([[0.3]], dtype=torch.float64),
        "0.bias": torch.tensor([-0.7], dtype=torch.float64),
        "2.weight": torch.tensor([[0.5]], dtype=torch.float64),
    }
    flat_v = torch.tensor([0.3, -0.7, 0.5], dtype=torch.float64)
    for method in METHODS:
        hv = hessian_vector_product(model, x, y, v, loss="mse", method=method).vector
        got = torch.stack([hv["0.weight"].reshape(()), hv["0.bias"].reshape(()), hv["2.weight"].reshape(())])
        torch.testing.assert_close(got, expected @ flat_v, rtol=1e-12, atol=1e-14)


def test_non_finite_is_reported():
    model, x, y, v = _logistic()
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    for f in (third_order_vector, hessian_vector_product):
        for method in METHODS:
            assert not f(model, x, y, v, method=method).finite
    assert not gradient(model, x, y).finite
    assert not directional_derivatives(model, x, y, v, order=3).finite
    model, x, y, v = _logistic()
    assert third_order_vector(model, x, y, v).finite
    x[0, 0] = float("nan")
    assert not third_order_vector(model, x, y, v).finite


def test_eval_mode_buffers_and_no_side_effects():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Dropout(0.5), nn.Linear(5, 3)).double()
    model.train()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    v = _random_like(model, 8)
    a = third_order_vector(model, x, y, v)
    b = third_order_vector(model, x, y, v, method="autograd")
    _assert_close(a.vector, b.vector, rtol=1e-10, atol=1e-12)  # deterministic: dropout off
    assert model.training and all(m.training for m in model.modules())
    for k, buf in model.named_buffers():
        assert torch.equal(buf, buffers[k]) or k.endswith("num_batches_tracked")
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    assert abs(a.loss - float(cross_entropy(model(x), y))) < 1e-12


def test_per_example_matches_single_batches():
    model = _mlp()
    x, y = _batch(model, "cross_entropy")
    v = _random_like(model, 3)
    per = third_order_vector(model, x, y, v, per_example=True)
    for i in range(x.shape[0]):
        one = third_order_vector(model, x[i : i + 1], y[i : i + 1], v)
        _assert_close({k: per.vector[k][i] for k in v}, one.vector, rtol=1e-10, atol=1e-12)
    mean = third_order_vector(model, x, y, v)
    _assert_close({k: per.vector[k].mean(0) for k in v}, mean.vector, rtol=1e-10, atol=1e-12)


def _live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("method", METHODS)
def test_no_tensors_survive_across_calls(method):
    model = _mlp()
    x, y = _batch(model, "cross_entropy")
    v = _random_like(model, 3)
    third_order_vector(model, x, y, v, method=method)
    before = _live_tensors()
    for _ in range(5):
        third_order_vector(model, x, y, v, method=method)
    assert _live_tensors() <= before
