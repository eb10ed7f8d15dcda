"""Third-order step size: cubic-model minimiser and its fallbacks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedhog.derivatives import STEP_REASONS, cubic_step, directional_derivatives, gradient, third_order_step_size
from fedhog.derivatives.losses import mse


def _phi(d1: float, d2: float, d3: float, s: float) -> float:
    return d1 * s + d2 * s * s / 2 + d3 * s**3 / 6


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    d1=st.floats(-1e3, -1e-3),
    d2=st.floats(-1e3, 1e3),
    d3=st.floats(-1e3, 1e3).filter(lambda v: v == 0 or abs(v) > 1e-6),
    max_step=st.floats(0.1, 10.0),
)
def test_cubic_step_is_the_global_minimiser_on_the_interval(d1, d2, d3, max_step):
    res = cubic_step(d1, d2, d3, max_step=max_step)
    assert 0 < res.step <= max_step and res.reason in STEP_REASONS
    # reference: the lowest φ among the real critical points in (0, max_step] and the end point
    roots = np.roots([d3 / 2, d2, d1]) if d3 != 0 else np.array([-d1 / d2]) if d2 != 0 else np.array([])
    critical = [r.real for r in np.atleast_1d(roots) if abs(r.imag) < 1e-9 * max(1, abs(r)) and 0 < r.real <= max_step]
    best = min(_phi(d1, d2, d3, s) for s in [*critical, max_step])
    scale = abs(d1) * max_step + abs(d2) * max_step**2 + abs(d3) * max_step**3
    assert _phi(d1, d2, d3, res.step) <= best + 1e-9 * scale
    # and no point of a fine grid is lower
    grid = np.linspace(max_step / 4000, max_step, 4000)
    assert _phi(d1, d2, d3, res.step) <= float(np.min(_phi(d1, d2, d3, grid))) + 1e-9 * scale


def test_cubic_step_prefers_max_step_when_it_is_lower():
    # φ′ = −1, φ″ = 4, φ‴ = −7.9: a local minimiser at 0.4497, a local maximum at 0.5629,
    # then φ falls below its local minimum before s = 1
    res = cubic_step(-1.0, 4.0, -7.9, max_step=1.0)
    assert _phi(-1.0, 4.0, -7.9, 1.0) < _phi(-1.0, 4.0, -7.9, 0.4497)
    assert res == (1.0, "max_step lower than the cubic minimiser")
    local = cubic_step(-1.0, 4.0, -7.9, max_step=0.5)  # the local maximum is past max_step
    assert local.reason == "cubic minimiser" and local.step == pytest.approx((4 - math.sqrt(16 - 15.8)) / 7.9)


def test_every_reason_is_documented():
    for reason in STEP_REASONS[:-1]:  # cubic_step lists its own reasons
        assert f'``"{reason}"``' in (cubic_step.__doc__ or ""), reason
    assert '``"non-finite gradient: fallback_step"``' in (third_order_step_size.__doc__ or "")


def test_cubic_step_fallbacks():
    assert cubic_step(-1.0, 2.0, 0.0).step == pytest.approx(0.5)  # Newton step when φ‴ = 0
    assert cubic_step(-1.0, -2.0, -1.0, max_step=3.0) == (3.0, "negative curvature: max_step")
    assert cubic_step(-1.0, 0.1, -10.0, max_step=3.0) == (3.0, "no real minimiser: max_step")
    assert cubic_step(1.0, 2.0, 0.0) == (0.0, "not a descent direction: zero step")
    assert cubic_step(-1.0, float("nan"), 0.0, fallback_step=0.05) == (0.05, "non-finite derivatives: fallback_step")
    assert cubic_step(-1.0, 1e-3, 0.0, max_step=2.0) == (2.0, "cubic minimiser clipped to max_step")


def test_step_is_exact_line_search_for_a_quadratic_loss():
    # Linear regression with MSE is quadratic in θ: φ‴ = 0 and the minimiser is |g|²/(gᵀHg).
    torch.manual_seed(0)
    model = nn.Linear(4, 2).double()
    x, y = torch.randn(20, 4, dtype=torch.float64), torch.randn(20, 2, dtype=torch.float64)
    res = third_order_step_size(model, x, y, loss="mse", max_step=100.0)
    assert res.reason == "cubic minimiser"

    def phi(s: float) -> float:
        with torch.no_grad():
            g = dict(gradient(model, x, y, loss="mse").vector)
            out = torch.func.functional_call(model, {k: p - s * g[k] for k, p in model.named_parameters()}, (x,))
            return float(mse(out, y))

    # φ is an exact parabola: its vertex from three samples
    a, b, c = phi(0.0), phi(0.5), phi(1.0)
    vertex = 0.5 * (3 * a - 4 * b + c) / (2 * (a - 2 * b + c))
    assert res.step == pytest.approx(vertex, rel=1e-9)


def test_step_uses_engine_derivatives_along_negative_gradient():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    res = third_order_step_size(model, x, y, max_step=50.0)
    d = {k: -t for k, t in gradient(model, x, y, method="autograd").vector.items()}
    _, d1, d2, d3 = directional_derivatives(model, x, y, d, order=3, method="torch.func").values.tolist()
    assert d1 < 0
    ref = cubic_step(d1, d2, d3, max_step=50.0)
    assert res.reason == ref.reason and math.isclose(res.step, ref.step, rel_tol=1e-10)


def test_step_reports_non_finite():
    model = nn.Linear(3, 2).double()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randint(0, 2, (4,))
    res = third_order_step_size(model, x, y, fallback_step=1e-3)
    assert res == (1e-3, "non-finite gradient: fallback_step") and res.reason in STEP_REASONS
