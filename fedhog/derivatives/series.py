"""Truncated univariate Taylor-series arithmetic on coefficient tuples.

A series is a tuple ``(c₀, c₁, …)`` of same-shaped (or broadcastable) tensors with
``f(s) = Σ cₖ sᵏ`` (normalised coefficients, ``cₖ = f⁽ᵏ⁾(0)/k!``); coefficients past
the end of the tuple are zero.  Each function returns ``n`` coefficients.
Nonlinear functions use the recurrences of their first-order ODEs (Griewank &
Walther, *Evaluating Derivatives*, ch. 13), so order ``k`` costs ``O(k²)``
elementwise products, each one fused ``addcmul`` kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from . import products

Series = tuple[Tensor, ...]
Term = tuple[float, Tensor, Tensor]


def combine(terms: Sequence[Term], like: Tensor) -> Tensor:
    """``Σ c·a·b`` over ``(c, a, b)`` as a chain of ``addcmul`` (zeros if empty)."""
    if not terms:
        return torch.zeros_like(like)
    ordered = sorted(terms, key=lambda t: t[0] != 1.0)  # start from a unit term if there is one
    c, a, b = ordered[0]
    out = a * b if c == 1.0 else torch.mul(a, b).mul(c)
    for c, a, b in ordered[1:]:
        out = torch.addcmul(out, a, b, value=c)
    return out


def _ode_term(z: Sequence[Tensor], w: Sequence[Tensor], k: int) -> Tensor:
    """Coefficient ``k`` of ``y`` where ``y' = w z'``: ``(1/k) Σ_{j=1..k} j z_j w_{k−j}``."""
    return combine([(j / k, z[j], w[k - j]) for j in range(1, min(k, len(z) - 1) + 1)], z[0])


def _square_terms(y: Sequence[Tensor], k: int, scale: float) -> list[Term]:
    """Terms of ``scale · (y²)_k`` using symmetry."""
    terms = [(2 * scale, y[i], y[k - i]) for i in range((k + 1) // 2) if k - i < len(y)]
    if k % 2 == 0 and k // 2 < len(y):
        terms.append((scale, y[k // 2], y[k // 2]))
    return terms


def mul(a: Series, b: Series, n: int) -> Series:
    """Cauchy product ``a·b``."""
    return tuple(
        combine([(1.0, a[i], b[k - i]) for i in range(max(0, k - len(b) + 1), min(k, len(a) - 1) + 1)], a[0])
        for k in range(min(n, len(a) + len(b) - 1))
    )


def square(a: Series, n: int) -> Series:
    """``a²``."""
    return tuple(combine(_square_terms(a, k, 1.0), a[0]) for k in range(min(n, 2 * len(a) - 1)))


def exp(z: Series, n: int) -> Series:
    """``exp(z)``: ``y' = y z'``."""
    y = [torch.exp(z[0])]
    for k in range(1, n):
        y.append(_ode_term(z, y, k))
    return tuple(y)


def log(z: Series, n: int) -> Series:
    """``log(z)`` for ``z₀ > 0``: ``z y' = z'``."""
    y = [torch.log(z[0])]
    inv = 1 / z[0]
    for k in range(1, n):
        terms = [(-j / k, y[j], z[k - j]) for j in range(1, k) if k - j < len(z)]
        if k >= len(z):  # noqa: SIM108 -- a nested conditional expression reads worse
            num = combine(terms, z[0])
        else:
            num = combine(terms, z[0]) + z[k] if terms else z[k]
        y.append(num * inv)
    return tuple(y)


def reciprocal(b: Series, n: int) -> Series:
    """``1/b``: ``q_k = −(Σ_{j≥1} b_j q_{k−j}) / b₀``."""
    q = [1 / b[0]]
    for k in range(1, n):
        q.append(combine([(-1.0, b[j], q[k - j]) for j in range(1, min(k, len(b) - 1) + 1)], b[0]) * q[0])
    return tuple(q)


def power(u: Series, n: int, alpha: float) -> Series:
    """``u^alpha`` for ``u₀ > 0``: ``u y' = alpha y u'``, so
    ``y_k = (1/u₀) Σ_{i=1..k} ((alpha + 1) i/k − 1) u_i y_{k−i}``."""
    y = [torch.rsqrt(u[0]) if alpha == -0.5 else u[0] ** alpha]
    inv = 1 / u[0]
    for k in range(1, n):
        terms = [((alpha + 1) * i / k - 1, u[i], y[k - i]) for i in range(1, min(k, len(u) - 1) + 1)]
        y.append(combine([t for t in terms if t[0] != 0.0], u[0]) * inv)
    return tuple(y)


def tanh(z: Series, n: int) -> Series:
    """``tanh(z)``: ``y' = (1 − y²) z'``."""
    y = [torch.tanh(z[0])]
    w = [1 - y[0] * y[0]]
    for k in range(1, n):
        y.append(_ode_term(z, w, k))
        if k < n - 1:
            w.append(combine(_square_terms(y, k, -1.0), z[0]))
    return tuple(y)


def sigmoid(z: Series, n: int) -> Series:
    """``σ(z)``: ``y' = (y − y²) z'``."""
    y = [torch.sigmoid(z[0])]
    w = [y[0] - y[0] * y[0]]
    for k in range(1, n):
        y.append(_ode_term(z, w, k))
        if k < n - 1:
            w.append(y[k] + combine(_square_terms(y, k, -1.0), z[0]))
    return tuple(y)


def silu(z: Series, n: int) -> Series:
    """``z σ(z)`` (SiLU, swish): the product of ``z`` and its sigmoid series."""
    return mul(tuple(z), sigmoid(z, n), n)


def softplus(z: Series, n: int) -> Series:
    """``log(1 + eᶻ)``: ``y' = σ(z) z'``."""
    s = sigmoid(z, n - 1) if n > 1 else ()
    y = [torch.nn.functional.softplus(z[0])]
    for k in range(1, n):
        y.append(_ode_term(z, s, k))
    return tuple(y)


def gelu(z: Series, n: int) -> Series:
    """``z Φ(z)`` (exact GELU) with ``Φ' = φ z'`` and ``φ' = −z φ z'``.

    Order 2 recorded for a reverse pass (the third-order terms' case) goes through :class:`GeluOrderTwo`.
    """
    if n == 3 and len(z) in (2, 3) and torch.is_grad_enabled() and all(c.shape == z[0].shape for c in z):
        y = tuple(GeluOrderTwo.apply(z[0], z[1], z[2] if len(z) == 3 else None))
        if any(products.vmapped_deeper(z[0], c) for c in z[1:]):  # directions vmapped over one primal
            return (z[0] * (0.5 * (1 + torch.erf(z[0] / math.sqrt(2)))), *y[1:])  # y₀ by plain operations
        return y
    phi = [torch.exp(-0.5 * z[0] * z[0]) / math.sqrt(2 * math.pi)]
    big_phi = [0.5 * (1 + torch.erf(z[0] / math.sqrt(2)))]
    u = [z[0] * phi[0]]  # u = z φ
    for k in range(1, n):
        big_phi.append(_ode_term(z, phi, k))
        if k < n - 1:
            phi.append(-_ode_term(z, u, k))
            u.append(combine([(1.0, z[i], phi[k - i]) for i in range(min(k, len(z) - 1) + 1)], z[0]))
    return mul(tuple(z), tuple(big_phi), n)


class GeluOrderTwo(torch.autograd.Function):
    """Order-2 series of GELU ``g(z) = z Φ(z)`` in closed form, with its reverse pass written out.

    ``y₀ = g(z₀)``, ``y₁ = g′ z₁``, ``y₂ = g′ z₂ + ½g″ z₁²`` with ``g′ = Φ + z₀φ``, ``g″ = φ(2 − z₀²)`` and
    ``g‴ = z₀φ(z₀² − 4)`` at ``z₀``; reverse: ``z̄₂ = ȳ₂g′``, ``z̄₁ = ȳ₁g′ + ȳ₂g″z₁``,
    ``z̄₀ = ȳ₀g′ + ȳ₁g″z₁ + ȳ₂(g″z₂ + ½g‴z₁²)``. The same coefficients as the recurrence in :func:`gelu`, in a
    dozen elementwise kernels each way instead of the recurrence's recorded graph (measured: the 1-D CNN's GELU
    layers took most of its third-order terms' time). ``z₂`` may be None (zero: a first layer's input is data).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(z0: Tensor, z1: Tensor, z2: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        square = z0 * z0
        phi = torch.exp(square * -0.5).mul_(1 / math.sqrt(2 * math.pi))
        big_phi = torch.erf(z0 * (1 / math.sqrt(2))).add_(1).mul_(0.5)
        slope = torch.addcmul(big_phi, z0, phi)  # g′
        half_curvature = phi * (1 - 0.5 * square)  # ½g″
        y2 = half_curvature * z1 * z1
        if z2 is not None:
            y2 = torch.addcmul(y2, slope, z2)
        return z0 * big_phi, slope * z1, y2

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        z0, z1, z2 = inputs
        ctx.save_for_backward(z0, z1, z2)

    @staticmethod
    def backward(ctx: Any, g0: Tensor, g1: Tensor, g2: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        z0, z1, z2 = ctx.saved_tensors
        square = z0 * z0
        phi = torch.exp(square * -0.5).mul_(1 / math.sqrt(2 * math.pi))
        slope = torch.addcmul(torch.erf(z0 * (1 / math.sqrt(2))).add_(1).mul_(0.5), z0, phi)  # g′
        curvature = phi * (2 - square)  # g″
        third = z0 * phi * (square - 4)  # g‴
        curvature_z1 = curvature * z1
        inner = third * z1 * z1 * 0.5
        if z2 is not None:
            inner = torch.addcmul(inner, curvature, z2)
        dz0 = torch.addcmul(torch.addcmul(g0 * slope, g1, curvature_z1), g2, inner)
        dz1 = torch.addcmul(g1 * slope, g2, curvature_z1)
        return dz0, dz1, (g2 * slope if z2 is not None else None)


def relu(z: Series, n: int) -> Series:
    """``max(z, 0)``: exact away from ``z₀ = 0`` (higher derivatives vanish a.e.)."""
    mask = (z[0] > 0).to(z[0].dtype)
    return tuple(c * mask for c in z[:n])


def leaky_relu(z: Series, n: int, slope: float) -> Series:
    """Leaky ReLU, exact away from ``z₀ = 0``."""
    factor = (z[0] <= 0).to(z[0].dtype) * (slope - 1) + 1
    return tuple(c * factor for c in z[:n])
