"""Reference formulations of the derivatives with ``torch.func`` and ``torch.autograd``.

Every function takes a scalar function ``f(params)`` of a dict of tensors and a
direction ``v`` keyed like ``params``.  The ``torch.func`` versions compose with
``vmap``; the ``autograd`` ones (nested ``backward``) serve as an independent
formulation and baseline.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.func import grad, grad_and_value, hessian, jvp, vmap

Params = dict[str, Tensor]
ScalarFn = Callable[[Params], Tensor]


def _jvp(func: Callable[..., Any], primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
    """``torch.func.jvp`` without auxiliary output: ``func(*primals)`` and its derivative along ``tangents`` (torch's
    annotation also admits the ``has_aux`` triple)."""
    out = jvp(func, primals, tangents)
    return out[0], out[1]


def func_gradient(f: ScalarFn, params: Params) -> tuple[Params, Tensor]:
    """Return ``(∇f, f)`` by reverse mode."""
    return grad_and_value(f)(params)


def func_hvp(f: ScalarFn, params: Params, v: Params) -> tuple[Params, Tensor]:
    """Return ``(∇²f v, f)`` by forward-over-reverse."""

    def g(p: Params) -> tuple[Params, Tensor]:
        return grad_and_value(f)(p)

    (_, value), (hv, _) = _jvp(g, (params,), (v,))
    return hv, value


def func_third_order(f: ScalarFn, params: Params, v: Params) -> tuple[Params, Tensor]:
    """Return ``(∇(vᵀ∇²f v), f)`` by reverse-over-forward-over-forward."""

    def second(p: Params) -> tuple[Tensor, Tensor]:
        def first(q: Params) -> tuple[Tensor, Tensor]:
            return _jvp(f, (q,), (v,))

        (value, _), (_, d2) = _jvp(first, (p,), (v,))
        return d2, value

    t, value = grad(second, has_aux=True)(params)
    return t, value


def func_directional(f: Callable[[Any], Tensor], params: Any, v: Any, order: int) -> Tensor:
    """Return ``[f, f', …, f⁽ᵏ⁾]`` of ``s ↦ f(θ + s v)`` at ``s = 0`` by nested ``jvp``.

    ``params`` and ``v`` are matching pytrees (a tensor or a dict of tensors);
    ``f`` may return a tensor of any shape, and the result stacks along dim 0.
    """

    def nest(k: int) -> Callable[[Any], tuple[Tensor, ...]]:
        if k == 0:
            return lambda p: (f(p),)
        inner = nest(k - 1)

        def g(p: Any) -> tuple[Tensor, ...]:
            values, tangents = _jvp(inner, (p,), (v,))
            return (*values, tangents[-1])

        return g

    return torch.stack(nest(order)(params))


def func_hessian(f: ScalarFn, params: Params) -> Tensor:
    """Return the dense Hessian ``[P, P]`` over parameters flattened in ``params`` order."""
    names = list(params)
    shapes = [params[n].shape for n in names]
    sizes = [params[n].numel() for n in names]
    flat = torch.cat([params[n].reshape(-1) for n in names])

    def g(x: Tensor) -> Tensor:
        parts = torch.split(x, sizes)
        return f({n: part.view(s) for n, part, s in zip(names, parts, shapes, strict=True)})

    return hessian(g)(flat)


def _leaves(params: Params) -> Params:
    return {k: p.detach().requires_grad_(True) for k, p in params.items()}


def _grad(out: Tensor, params: Params, create_graph: bool, retain_graph: bool | None = None) -> Params:
    if not out.requires_grad:  # out does not depend on params: derivative is zero
        return {k: torch.zeros_like(p) for k, p in params.items()}
    gs = torch.autograd.grad(out, list(params.values()), create_graph=create_graph, retain_graph=retain_graph,
                             allow_unused=True)
    return {k: torch.zeros_like(p) if g is None else g for (k, p), g in zip(params.items(), gs, strict=True)}


def _dot(a: Params, b: Params) -> Tensor:
    return functools.reduce(operator.add, [(a[k] * b[k]).sum() for k in a])


def autograd_gradient(f: ScalarFn, params: Params) -> tuple[Params, Tensor]:
    """Return ``(∇f, f)`` with one ``autograd.grad``."""
    with torch.enable_grad():
        p = _leaves(params)
        value = f(p)
        return _grad(value, p, False), value.detach()


def autograd_hvp(f: ScalarFn, params: Params, v: Params) -> tuple[Params, Tensor]:
    """Return ``(∇²f v, f)`` by double backward."""
    with torch.enable_grad():
        p = _leaves(params)
        value = f(p)
        g = _grad(value, p, True)
        return _grad(_dot(g, v), p, False), value.detach()


def autograd_third_order(f: ScalarFn, params: Params, v: Params) -> tuple[Params, Tensor]:
    """Return ``(∇(vᵀ∇²f v), f)`` by triple backward."""
    with torch.enable_grad():
        p = _leaves(params)
        value = f(p)
        g = _grad(value, p, True)
        hv = _grad(_dot(g, v), p, True)
        return _grad(_dot(hv, v), p, False), value.detach()


def func_trace_gradient(f: ScalarFn, params: Params, vs: Params) -> tuple[Params, Tensor, Tensor]:
    """Return ``(mean_k ∇(v_kᵀ∇²f v_k), [v_kᵀ∇²f v_k]_k, f)`` for directions stacked ``[k, …]`` in ``vs``.

    Reverse over forward over forward (as :func:`func_third_order`), vmapped over the directions.
    """

    def one(v: Params) -> tuple[Params, tuple[Tensor, Tensor]]:
        def second(p: Params) -> tuple[Tensor, tuple[Tensor, Tensor]]:
            def first(q: Params) -> tuple[Tensor, Tensor]:
                return _jvp(f, (q,), (v,))

            (value, _), (_, d2) = _jvp(first, (p,), (v,))
            return d2, (d2.detach(), value.detach())

        return grad(second, has_aux=True)(params)

    t, (forms, values) = vmap(one)(vs)
    return {k: g.mean(0) for k, g in t.items()}, forms, values[0]


def autograd_trace_gradient(f: ScalarFn, params: Params, vs: Params) -> tuple[Params, Tensor, Tensor]:
    """:func:`func_trace_gradient` by triple backward: the value and the gradient's graph once, then per direction
    a Hessian-vector product and the gradient of ``vᵀ∇²f v``."""
    count = next(iter(vs.values())).shape[0]
    with torch.enable_grad():
        p = _leaves(params)
        value = f(p)
        g = _grad(value, p, True)
        total = {k: torch.zeros_like(t) for k, t in params.items()}
        forms = []
        for i in range(count):
            v = {k: d[i] for k, d in vs.items()}
            form = _dot(_grad(_dot(g, v), p, True), v)
            for k, t in _grad(form, p, False, retain_graph=i < count - 1).items():
                total[k] += t.detach()
            forms.append(form.detach())
    return {k: t / count for k, t in total.items()}, torch.stack(forms), value.detach()
