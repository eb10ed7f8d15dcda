"""``hessian_trace_gradient``: ∇_θ tr ∇²L against autograd's dense Hessian, and Hutchinson's estimator's statistics.

The reference is independent of the engine: the loss written here from ``logsumexp``, the parameters flattened into
one vector, ``torch.func.hessian`` for ∇²L, ``torch.func.grad`` of its trace (or of ``vᵀ∇²L v``), and
``torch.func.jacfwd`` of the Hessian for the third-derivative tensor T, whose entries give the estimator's exact
per-coordinate variance (Rademacher: 4 Σ_{j<k} T_ijk²; Gaussian: 2 Σ_jk T_ijk²).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd

from fedhog.derivatives import Unsupported, hessian_trace_gradient, products, third_order_vector

METHODS = ("taylor", "torch.func", "autograd")


def _mlp(activation: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), activation(), nn.Linear(4, 3)).double()


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv1d(1, 2, 3), nn.GELU(), nn.Flatten(), nn.Linear(2 * 4, 3)).double()


MODELS = {"gelu-mlp": (lambda: _mlp(nn.GELU), (3,)), "tanh-mlp": (lambda: _mlp(nn.Tanh), (3,)),
          "cnn": (_cnn, (1, 6))}


def _setup(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    build, shape = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return build(), torch.randn(5, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)


def _flat_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """θ (flat) ↦ mean cross-entropy, the parameters flattened in ``named_parameters`` order."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def f(flat: torch.Tensor) -> torch.Tensor:
        parts = {n: part.view(s) for n, part, s in zip(names, torch.split(flat, sizes), shapes, strict=True)}
        logits = functional_call(model, parts, (x,))
        return (logits.logsumexp(-1) - logits.gather(-1, y[:, None]).squeeze(-1)).mean()

    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    return f, theta, names, sizes, shapes


def _flat(vector: dict[str, torch.Tensor], names: list[str]) -> torch.Tensor:
    return torch.cat([vector[n].reshape(-1) for n in names])


def _split(flat: torch.Tensor, names, sizes, shapes) -> dict[str, torch.Tensor]:
    return {n: part.view(s) for n, part, s in zip(names, torch.split(flat, sizes), shapes, strict=True)}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_explicit_directions_give_the_mean_gradient_of_the_quadratic_forms(name, method):
    model, x, y = _setup(name)
    f, theta, names, sizes, shapes = _flat_loss(model, x, y)
    g = torch.Generator().manual_seed(2)
    flats = [torch.randn(theta.numel(), generator=g, dtype=torch.float64) for _ in range(3)]
    stacked = torch.stack(flats)
    reference = grad(lambda t: torch.einsum("ki,ij,kj->", stacked, hessian(f)(t), stacked) / len(flats))(theta)
    forms = torch.einsum("ki,ij,kj->k", stacked, hessian(f)(theta), stacked)
    res = hessian_trace_gradient(model, x, y, directions=[_split(v, names, sizes, shapes) for v in flats],
                                 method=method)
    assert res.method == method and res.finite
    torch.testing.assert_close(_flat(res.vector, names), reference, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.values, forms, rtol=1e-9, atol=1e-11)
    assert res.loss == pytest.approx(float(f(theta)), rel=1e-12)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_basis_directions_give_the_exact_gradient_of_the_trace(name):
    """mean_k ∇(e_kᵀ∇²L e_k) over the P basis vectors is ∇ tr ∇²L / P: the expectation, exactly."""
    model, x, y = _setup(name)
    f, theta, names, sizes, shapes = _flat_loss(model, x, y)
    exact = grad(lambda t: torch.trace(hessian(f)(t)))(theta)
    basis = [_split(e, names, sizes, shapes) for e in torch.eye(theta.numel(), dtype=torch.float64)]
    res = hessian_trace_gradient(model, x, y, directions=basis)
    torch.testing.assert_close(theta.numel() * _flat(res.vector, names), exact, rtol=1e-9, atol=1e-10)
    assert float(res.values.sum()) == pytest.approx(float(torch.trace(hessian(f)(theta))), rel=1e-10)


def _third_derivatives(f, theta: torch.Tensor) -> torch.Tensor:
    return jacfwd(hessian(f))(theta)  # T[j, k, i] = ∂³L/∂θ_j∂θ_k∂θ_i, symmetric


@pytest.mark.parametrize("distribution", ["rademacher", "gaussian"])
@pytest.mark.parametrize("name", ["gelu-mlp", "cnn"])
def test_hutchinsons_mean_is_within_its_clt_bound_of_the_exact_gradient(name, distribution):
    model, x, y = _setup(name)
    f, theta, names, *_ = _flat_loss(model, x, y)
    t = _third_derivatives(f, theta)
    squares = (t * t).sum(dim=(0, 1))
    diagonal = (torch.diagonal(t, dim1=0, dim2=1) ** 2).sum(dim=-1)  # Σ_j T_jji²
    variance = 2 * (squares - diagonal) if distribution == "rademacher" else 2 * squares
    exact = grad(lambda p: torch.trace(hessian(f)(p)))(theta)
    samples = 400
    res = hessian_trace_gradient(model, x, y, samples=samples, distribution=distribution,
                                 generator=torch.Generator().manual_seed(3))
    error = _flat(res.vector, names) - exact
    bound = 5 * torch.sqrt(variance / samples) + 1e-12
    assert bool((error.abs() <= bound).all()), float((error.abs() / bound).max())
    assert float(error.abs().max()) > 0  # a random estimate, not the exact value computed otherwise


def test_rademacher_directions_have_the_smaller_variance_as_their_quadratic_forms_show():
    """Var(vᵀHv) is 2 Σ_{j≠k} H_jk² for Rademacher v and 2‖H‖_F² for Gaussian v; the engine's draws have them."""
    model, x, y = _setup("gelu-mlp")
    f, theta, *_ = _flat_loss(model, x, y)
    h = hessian(f)(theta)
    exact = {"rademacher": 2 * float((h * h).sum() - (torch.diagonal(h) ** 2).sum()),
             "gaussian": 2 * float((h * h).sum())}
    measured = {}
    for distribution in exact:
        res = hessian_trace_gradient(model, x, y, samples=3000, distribution=distribution,
                                     generator=torch.Generator().manual_seed(4))
        measured[distribution] = float(res.values.var())
        assert float(res.values.mean()) == pytest.approx(float(torch.trace(h)),
                                                         abs=5 * math.sqrt(exact[distribution] / 3000))
        assert measured[distribution] == pytest.approx(exact[distribution], rel=0.2)
    assert measured["rademacher"] < measured["gaussian"]


def test_one_direction_is_the_third_order_vector():
    model, x, y = _setup("gelu-mlp")
    v = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    res = hessian_trace_gradient(model, x, y, directions=[v])
    single = third_order_vector(model, x, y, v)
    for n in v:
        torch.testing.assert_close(res.vector[n], single.vector[n], rtol=1e-12, atol=1e-14)


def test_batched_directions_through_the_fused_linear_rule(monkeypatch):
    """The Karatsuba rule (recorded for a reverse pass) steps aside when directions are vmapped over one primal:
    its generated vmap rule would leave the primal's gradient unsummed over the directions."""
    monkeypatch.setattr(products, "KARATSUBA_MIN_MACS", 0)
    model, x, y = _setup("gelu-mlp")
    vs = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(3)]
    fast = hessian_trace_gradient(model, x, y, directions=vs, method="taylor")
    slow = hessian_trace_gradient(model, x, y, directions=vs, method="autograd")
    for n in fast.vector:
        torch.testing.assert_close(fast.vector[n], slow.vector[n], rtol=1e-10, atol=1e-12)


def test_the_same_generator_seed_draws_the_same_directions():
    model, x, y = _setup("tanh-mlp")
    a = hessian_trace_gradient(model, x, y, samples=2, generator=torch.Generator().manual_seed(7))
    b = hessian_trace_gradient(model, x, y, samples=2, generator=torch.Generator().manual_seed(7))
    c = hessian_trace_gradient(model, x, y, samples=2, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.values, b.values) and not torch.equal(a.values, c.values)


def test_bad_arguments_name_themselves():
    model, x, y = _setup("tanh-mlp")
    v = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="samples must be a positive int"):
        hessian_trace_gradient(model, x, y, samples=0)
    with pytest.raises(ValueError, match="samples must be a positive int"):
        hessian_trace_gradient(model, x, y, samples=True)
    with pytest.raises(ValueError, match="distribution must be one of"):
        hessian_trace_gradient(model, x, y, distribution="uniform")
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator"):
        hessian_trace_gradient(model, x, y, generator=3)
    with pytest.raises(ValueError, match="give one or the other"):
        hessian_trace_gradient(model, x, y, directions=[v], samples=2)
    with pytest.raises(TypeError, match="directions must be a non-empty list"):
        hessian_trace_gradient(model, x, y, directions=v)
    with pytest.raises(TypeError, match="directions must be a non-empty list"):
        hessian_trace_gradient(model, x, y, directions=[])
    with pytest.raises(ValueError, match=r"directions\[1\]: .*missing \['2.bias'\]"):
        hessian_trace_gradient(model, x, y, directions=[v, {k: t for k, t in v.items() if k != "2.bias"}])
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        hessian_trace_gradient(lambda t: t, x, y)
    with pytest.raises(ValueError, match="method must be one of"):
        hessian_trace_gradient(model, x, y, method="jax")


def test_a_non_finite_batch_is_reported_not_hidden():
    model, x, y = _setup("tanh-mlp")
    x = x.clone()
    x[0, 0] = math.inf
    res = hessian_trace_gradient(model, x, y, samples=2, generator=torch.Generator().manual_seed(0))
    assert not res.finite


def test_a_model_without_taylor_rules_falls_back_and_says_so():
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.sin(self.lin(x))  # sin has no Taylor rule

    _, x, y = _setup("tanh-mlp")
    model = Odd()
    res = hessian_trace_gradient(model, x, y, samples=2, generator=torch.Generator().manual_seed(0))
    assert res.method == "torch.func"
    with pytest.raises(Unsupported):
        hessian_trace_gradient(model, x, y, samples=2, method="taylor")
