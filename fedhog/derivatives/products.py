"""Truncated products of series through a bilinear operation, with as few matrix products as we know.

Layers (linear, convolution, matmul) are bilinear in their input ``X(s)`` and
their weight ``W + sV`` (a parameter moves along the direction).  The Leibniz
sum ``y_k = W x_k + V x_{k−1}`` costs ``2m − 1`` products for ``m`` input
coefficients; :func:`series_product` uses Karatsuba pairs (three products per two
coefficients) when one product is large enough for the saving to show, and for
the order-2 linear layer behind the third-order vector a single autograd node,
:class:`KaratsubaLinear`, whose reverse pass needs neither the mixed weight nor
the mixed input alive and shares one product between ``x̄₀`` and ``x̄₂``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

Op = Callable[[Tensor, Tensor], Tensor]

KARATSUBA_MIN_MACS = 1 << 22
"""Estimated multiply-adds of one product above which Karatsuba pairs are used (below, their
extra elementwise work and Python overhead cost more than the product they save)."""


def macs(x: Tensor, w: Tensor) -> int:
    """Rough multiply-adds of one product of ``x`` with the weight ``w`` (input size × output features)."""
    return x.numel() * (w.shape[0] if w.dim() > 1 else 1)


def balance(w: Tensor, v: Tensor) -> Tensor:
    """``λ = ‖W‖/‖V‖`` (1 when ``V = 0``), detached: the products are exact for any ``λ ≠ 0``."""
    v_norm = torch.linalg.vector_norm(v.detach())
    return torch.where(v_norm > 0, torch.linalg.vector_norm(w.detach()) / v_norm, torch.ones_like(v_norm))


def karatsuba(op: Op, xs: Sequence[Tensor], w: Tensor, v: Tensor, n: int) -> list[Tensor]:
    """``(W + sV)·X(s)`` truncated to ``n`` coefficients with three products per pair of coefficients.

    For a pair ``(x_k, x_{k+1})`` the Leibniz sum needs ``W x_k``,
    ``W x_{k+1} + V x_k`` and ``V x_{k+1}`` (four products); with
    ``R = (W + λV)(x_k + λ x_{k+1})`` the middle term is ``(R − W x_k − λ² V x_{k+1}) / λ``
    (three).  ``λ`` (:func:`balance`) makes the summands of ``R`` of one size, so the
    subtraction loses no more than a few bits.  A pair whose top product would be
    truncated is done by the Leibniz sum (same count).  Order 2 (``n = 3``): 4
    products instead of 5; order 5 (``n = 6``): 9 instead of 11.  (Stacking the
    products that share a weight into one call was measured and did not pay:
    slower for convolutions, within noise for linear layers.)
    """
    lam = balance(w, v)
    n_out = min(n, len(xs) + 1)
    terms: list[list[Tensor]] = [[] for _ in range(n_out)]
    mixed: Tensor | None = None
    k, m = 0, min(len(xs), n_out)
    while k < m:
        if k + 2 < n_out and k + 1 < m:
            if mixed is None:
                mixed = w + lam * v
            p, q = op(xs[k], w), op(xs[k + 1], v)
            r = op(xs[k] + lam * xs[k + 1], mixed)
            terms[k].append(p)
            terms[k + 1].append((r - p - (lam * lam) * q) / lam)
            terms[k + 2].append(q)
            k += 2
        else:
            terms[k].append(op(xs[k], w))
            if k + 1 < n_out:
                terms[k + 1].append(op(xs[k], v))
            k += 1
    return [sum(t[1:], t[0]) for t in terms]


def series_product(op: Op, xs: Sequence[Tensor], ws: Sequence[Tensor], n: int) -> list[Tensor]:
    """``(x·w)_k = Σ_{i+j=k} op(x_i, w_j)`` for ``k < n``, ``op`` linear in each argument.

    Without a reverse pass to record (directional derivatives), when one side is
    a parameter (two coefficients ``W + sV``), the other carries at least two
    coefficients, at least three outputs are kept and one product costs more
    than :data:`KARATSUBA_MIN_MACS`: :func:`karatsuba`.  Otherwise one call per
    coefficient pair: recorded for a reverse pass, the Karatsuba form keeps the
    mixed input alive (+12% peak memory on the 1-D CNN) for no measurable time
    (linear layers have :class:`KaratsubaLinear` instead).
    """
    n_out = min(n, len(xs) + len(ws) - 1)
    if n_out >= 3 and not torch.is_grad_enabled():
        if len(ws) == 2 and len(xs) >= 2 and macs(xs[0], ws[0]) >= KARATSUBA_MIN_MACS:
            return karatsuba(op, xs, ws[0], ws[1], n)
        if len(xs) == 2 and len(ws) >= 2 and macs(ws[0], xs[0]) >= KARATSUBA_MIN_MACS:
            return karatsuba(lambda a, b: op(b, a), ws, xs[0], xs[1], n)
    terms: list[list[Tensor]] = [[] for _ in range(n_out)]
    for j, wj in enumerate(ws[:n_out]):
        for i in range(min(len(xs), n_out - j)):
            terms[i + j].append(op(xs[i], wj))
    return [sum(t[1:], t[0]) for t in terms]


def _batched(t: Tensor) -> bool:
    """Whether ``t`` lives inside a ``torch.func`` transform (``vmap`` has no rule for in-place ``addmm_``)."""
    wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    return True if wrapped is None else bool(wrapped(t))


def vmapped_deeper(a: Tensor, b: Tensor) -> bool:
    """Whether ``b`` is batched by more ``vmap`` levels than ``a``: a primal shared by a batch of directions.

    A custom ``autograd.Function`` with ``generate_vmap_rule`` gets the gradient of such an unbatched output
    wrong when the gradient arriving at it is batched (torch 2.13: it is not summed over the batch), so the
    fused rules below step aside for plain operations, whose rules are right.
    """
    level = torch._C._functorch.maybe_get_level
    return bool(level(a) < level(b))


class KaratsubaLinear(torch.autograd.Function):
    """Order-2 series of ``F.linear(X(s), W + sV)`` (no bias): ``(y₀, y₁, y₂)`` from ``(x₀, x₁, x₂)``.

    Forward: ``[x₀; x₂] Wᵀ`` (one product for ``y₀`` and the ``W x₂`` part of ``y₂``),
    ``Q = x₁ Vᵀ`` and ``R = (x₀ + λx₁)(W + λV)ᵀ``; ``y₁ = (R − W x₀ − λ²Q)/λ``.
    Reverse (``V`` and ``λ`` are constants): with ``ḡ_P = ȳ₀ − ȳ₁/λ``,
    ``ḡ_Q = ȳ₂ − λȳ₁``, ``ḡ_R = ȳ₁/λ``,

        x̄₀ = ḡ_P W + ḡ_R M,   x̄₁ = ḡ_Q V + λ ḡ_R M,   x̄₂ = ȳ₂ W,
        W̄ = ḡ_Pᵀ x₀ + ḡ_Rᵀ (x₀ + λx₁) + ȳ₂ᵀ x₂         (accumulated in place),

    where ``M = W + λV`` and ``x₀ + λx₁`` are recomputed rather than kept: only
    ``x₀, x₁, x₂`` (which the layer below keeps anyway) and the parameters are saved.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x0: Tensor, x1: Tensor, x2: Tensor, w: Tensor, v: Tensor, lam: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows = x0.shape[0]
        both = torch.cat([x0, x2]) @ w.T
        p, wx2 = both[:rows], both[rows:]
        q = x1 @ v.T
        r = (x0 + lam * x1) @ (w + lam * v).T
        y1 = (r - p - (lam * lam) * q) / lam
        return p, y1, wx2 + q

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        x0, x1, x2, w, v, lam = inputs
        ctx.save_for_backward(x0, x1, x2, w, v, lam)

    @staticmethod
    def backward(ctx: Any, g0: Tensor, g1: Tensor, g2: Tensor) -> tuple[Tensor | None, ...]:
        x0, x1, x2, w, v, lam = ctx.saved_tensors
        g_r = g1 / lam
        g_p = g0 - g_r
        g_q = g2 - lam * g1
        rows = x0.shape[0]
        mixed = w + lam * v
        gx = torch.cat([g_p, g2]) @ w
        shared = g_r @ mixed  # in x̄₀ and x̄₁ both: one product
        gx0 = gx[:rows] + shared
        gx1 = g_q @ v + lam * shared
        gx2 = gx[rows:]
        gw = None
        if ctx.needs_input_grad[3]:  # accumulated: no stacked copy of the inputs, no weight-sized temporary
            rows_of = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
            gw = rows_of(g_p).T @ rows_of(x0)
            terms = ((g_r, x0 + lam * x1), (g2, x2))
            if _batched(gw):  # per example, under vmap
                for g, x in terms:
                    gw = torch.addmm(gw, rows_of(g).T, rows_of(x))
            else:
                for g, x in terms:
                    gw.addmm_(rows_of(g).T, rows_of(x))
        return gx0, gx1, gx2, gw, None, None


def karatsuba_linear_applies(xs: Sequence[Tensor], ws: Sequence[Tensor], n: int) -> bool:
    """Whether :class:`KaratsubaLinear` computes ``F.linear`` of these series (order 2, recorded for a reverse pass)."""
    return (
        n == 3
        and len(xs) == 3
        and len(ws) == 2
        and xs[0].dim() >= 2
        and torch.is_grad_enabled()
        and macs(xs[0], ws[0]) >= KARATSUBA_MIN_MACS
        and not (vmapped_deeper(xs[0], xs[1]) or vmapped_deeper(ws[0], ws[1]))
    )


def karatsuba_linear(xs: Sequence[Tensor], w: Tensor, v: Tensor) -> list[Tensor]:
    """``F.linear(X(s), W + sV)`` to order 2 through :class:`KaratsubaLinear`."""
    return list(KaratsubaLinear.apply(xs[0], xs[1], xs[2], w, v, balance(w, v)))
