"""Karatsuba products of series (used on large layers) against the Leibniz sum and the references.

The test models are small, so the size threshold is lowered to zero here; the
benchmark models take these paths at their real sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedhog.derivatives.products as products
from fedhog.derivatives import directional_derivatives, hessian_vector_product, third_order_vector


@pytest.fixture
def always_karatsuba(monkeypatch):
    monkeypatch.setattr(products, "KARATSUBA_MIN_MACS", 0)


class MatmulBothSides(nn.Module):
    """A parameter on the left of a matmul (``W @ h``) and on the right (``h @ U``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 6)
        self.left = nn.Parameter(torch.randn(4, 4) * 0.4)
        self.right = nn.Parameter(torch.randn(6, 3) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, 4, 5]
        h = torch.tanh(self.lin(x))
        return torch.tanh(self.left @ h).mean(1) @ self.right


def _models() -> dict[str, tuple[nn.Module, tuple[int, ...]]]:
    torch.manual_seed(0)
    return {
        "mlp": (nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Sigmoid(), nn.Linear(6, 3)), (5,)),
        "cnn": (nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv1d(3, 3, 3), nn.Tanh(), nn.Flatten(),
                              nn.Linear(12, 3)), (2, 6)),
        "matmul": (MatmulBothSides(), (4, 5)),
    }


def _setup(name: str, dtype=torch.float64):
    model, shape = _models()[name]
    model = model.to(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, *shape, generator=g).to(dtype)
    y = torch.randint(0, 3, (4,), generator=g)
    v = {k: (torch.randn(p.shape, generator=g) * 0.5).to(dtype) for k, p in model.named_parameters()}
    return model, x, y, v


@pytest.mark.parametrize("name", ["mlp", "cnn", "matmul"])
def test_karatsuba_paths_match_the_references(name, always_karatsuba, monkeypatch):
    calls = {"karatsuba": 0, "karatsuba_linear": 0}
    for fn in calls:
        original = getattr(products, fn)

        def counted(*args, _original=original, _fn=fn, **kwargs):
            calls[_fn] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(products, fn, counted)
    model, x, y, v = _setup(name)
    ref_t = third_order_vector(model, x, y, v, method="autograd").vector
    for per_example in (False, True):
        got = third_order_vector(model, x, y, v, method="taylor", per_example=per_example).vector
        if per_example:
            got = {k: t.mean(0) for k, t in got.items()}
        for k in v:
            torch.testing.assert_close(got[k], ref_t[k], rtol=1e-10, atol=1e-12)
    ref_hv = hessian_vector_product(model, x, y, v, method="autograd").vector
    got_hv = hessian_vector_product(model, x, y, v, method="taylor").vector
    for k in v:
        torch.testing.assert_close(got_hv[k], ref_hv[k], rtol=1e-10, atol=1e-12)
    ref_d = directional_derivatives(model, x, y, v, order=5, method="torch.func").values
    got_d = directional_derivatives(model, x, y, v, order=5, method="taylor").values
    assert float(((got_d - ref_d).abs() / ref_d.abs().clamp_min(1.0)).max()) < 1e-11
    assert calls["karatsuba"] > 0 and (calls["karatsuba_linear"] > 0 or name == "matmul")


def test_karatsuba_product_equals_leibniz_sum_for_every_order():
    g = torch.Generator().manual_seed(2)
    w, v = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 4, generator=g, dtype=torch.float64)
    for m in range(1, 7):
        xs = [torch.randn(3, 4, generator=g, dtype=torch.float64) * 0.3**k for k in range(m)]
        for n in range(1, 8):
            leibniz = [
                sum((F.linear(xs[i], (w, v)[k - i]) for i in range(max(0, k - 1), min(k, m - 1) + 1)),
                    torch.zeros(3, 5, dtype=torch.float64))
                for k in range(min(n, m + 1))
            ]  # fmt: skip
            got = products.karatsuba(F.linear, xs, w, v, n)
            assert len(got) == len(leibniz)
            for a, b in zip(got, leibniz, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_karatsuba_linear_gradient_matches_autograd_of_the_leibniz_sum():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    w = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(5, 4, generator=g, dtype=torch.float64) * 1e-3  # unbalanced scales: λ compensates
    cot = [torch.randn(6, 5, generator=g, dtype=torch.float64) for _ in range(3)]
    got = products.karatsuba_linear(xs, w, v)
    ref = [F.linear(xs[0], w), F.linear(xs[1], w) + F.linear(xs[0], v), F.linear(xs[2], w) + F.linear(xs[1], v)]
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    inputs = [*xs, w]
    grads = torch.autograd.grad(sum((c * y).sum() for c, y in zip(cot, got, strict=True)), inputs)
    expected = torch.autograd.grad(sum((c * y).sum() for c, y in zip(cot, ref, strict=True)), inputs)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_float32_karatsuba_keeps_precision(always_karatsuba):
    # a bench-like direction: unit norm over all parameters, so ‖V‖ ≪ ‖W‖
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 10))
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    norm = torch.sqrt(sum((t * t).sum() for t in v.values()))
    v = {k: t / norm for k, t in v.items()}
    t32 = third_order_vector(model, x, y, v, method="taylor").vector
    d32 = directional_derivatives(model, x, y, v, order=4, method="taylor").values
    model64 = model.double()
    v64 = {k: t.double() for k, t in v.items()}
    t64 = third_order_vector(model64, x.double(), y, v64, method="autograd").vector
    d64 = directional_derivatives(model64, x.double(), y, v64, order=4, method="torch.func").values
    scale = max(float(t.abs().max()) for t in t64.values())
    for k in v:
        torch.testing.assert_close(t32[k].double(), t64[k], rtol=1e-3, atol=1e-4 * scale)
    assert float(((d32.double() - d64).abs() / d64.abs().clamp_min(1e-3)).max()) < 1e-3


def test_karatsuba_balances_unequal_scales_in_float32():
    # V ≪ W and x₁ ≪ x₀ (a unit-norm direction on a large model): without λ the middle term
    # W x₁ + V x₀ would be the small difference of large products and lose ~4 digits in float32
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 128, generator=g, dtype=torch.float64)
    v = torch.randn(64, 128, generator=g, dtype=torch.float64) * 1e-4
    xs = [torch.randn(32, 128, generator=g, dtype=torch.float64) * 1e-4**k for k in range(3)]
    exact = [F.linear(xs[0], w), F.linear(xs[1], w) + F.linear(xs[0], v), F.linear(xs[2], w) + F.linear(xs[1], v)]
    got = products.karatsuba(F.linear, [t.float() for t in xs], w.float(), v.float(), 3)
    for a, b in zip(got, exact, strict=True):
        assert float((a.double() - b).norm() / b.norm()) < 2e-6
