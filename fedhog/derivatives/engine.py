"""Derivative quantities of a model's loss, dispatched to the fastest applicable formulation.

``method="auto"`` tries the formulations in the order of each ``computes`` dict
(fastest first as measured by ``simulations/bench_derivatives.py``): Taylor mode
(:mod:`.taylor`) when every operation of the model and the loss has a Taylor
rule, then nested ``autograd``/``torch.func``; the result's ``method`` says
which ran.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from torch import Tensor, nn
from torch.func import grad

from . import functional as fn
from .api import Compute, HigherOrderResult, Params, batch_objective, check_direction, evaluate, finish, model_state
from .losses import LossFn, get_loss
from .taylor import LOSS_SERIES, TaylorProgram, Unsupported, loss_series, program_for

METHODS = ("auto", "taylor", "torch.func", "autograd")
Formulation = Callable[[Callable[[Params], Tensor], Params], tuple[Params | Tensor, Tensor]]


def _program(model: nn.Module, loss: str | LossFn) -> TaylorProgram | None:
    if not isinstance(loss, str) or loss not in LOSS_SERIES:
        return None
    try:
        return program_for(model)
    except Unsupported:
        return None


def _reference(model: nn.Module, loss: str | LossFn, formulation: Formulation) -> Compute:
    loss_fn = get_loss(loss)

    def compute(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Params | Tensor, Tensor]:
        return formulation(batch_objective(model, buffers, loss_fn, x, y), params)

    return compute


def _run(
    model: nn.Module,
    state: tuple[Params, Params],
    inputs: Tensor,
    targets: Tensor,
    method: str,
    per_example: bool,
    computes: dict[str, Compute | None],
) -> HigherOrderResult:
    """Resolve ``method`` among the available ``computes`` and run it; auto falls back on ``Unsupported``."""
    start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if per_example:
        computes = {k: c for k, c in computes.items() if k != "autograd"}
    available = [k for k, c in computes.items() if c is not None]
    if method != "auto":
        if method not in available:
            raise ValueError(f"method {method!r} is not available here; use one of {available}")
        available = [method]
    for i, name in enumerate(available):
        try:
            out, value = evaluate(model, state, inputs, targets, computes[name], per_example)  # type: ignore[arg-type]
        except Unsupported:
            if method != "auto" or i == len(available) - 1:
                raise
            continue
        return finish(out, value, name, start)
    raise AssertionError("unreachable")


def _taylor_grad(
    program: TaylorProgram, loss: str, v: Params, n: int, k: int, scale: float, per_example: bool
) -> Compute:
    """``∇_θ (scale · c_k)`` where ``c`` are the Taylor coefficients of ``L(θ + s v)``.

    One reverse pass through the series propagation: ``torch.func.grad`` under
    ``vmap`` (per example), plain ``autograd.grad`` otherwise (less dispatch overhead).
    """

    def coefficient(p: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        c = loss_series(program, loss, p, buffers, v, x, y, n)
        return scale * c[k], c[0].detach()

    def functional(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Params, Tensor]:
        return grad(coefficient, has_aux=True)(params, buffers, x, y)

    def reverse(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Params, Tensor]:
        with torch.enable_grad():
            leaves = {name: t.requires_grad_(True) for name, t in params.items()}
            target, value = coefficient(leaves, buffers, x, y)
            if not target.requires_grad:  # the coefficient does not depend on θ
                return {name: torch.zeros_like(t) for name, t in params.items()}, value
            grads = torch.autograd.grad(target, list(leaves.values()), allow_unused=True)
        pairs = zip(params.items(), grads, strict=True)
        return {name: torch.zeros_like(t) if g is None else g for (name, t), g in pairs}, value

    return functional if per_example else reverse


def gradient(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Gradient ``∇_θ L``.

    Parameters
    ----------
    model : nn.Module
        Evaluated with its current parameters and buffers in eval mode.
    inputs, targets : Tensor
        One batch; ``L`` is the mean loss over it.
    loss : {"cross_entropy", "mse"} or callable
        Loss ``(outputs, targets) -> scalar``; Taylor mode needs a named loss.
    method : {"auto", "taylor", "torch.func", "autograd"}
        Formulation; ``"auto"`` picks the fastest available.
    per_example : bool
        One result per example (leading batch dimension) via ``vmap``.
    """
    program = _program(model, loss)
    state = model_state(model)
    unused = state[0]  # an order-0 series never reads the direction
    computes: dict[str, Compute | None] = {
        "autograd": _reference(model, loss, fn.autograd_gradient),
        "torch.func": _reference(model, loss, fn.func_gradient),
        "taylor": None if program is None else _taylor_grad(program, loss, unused, 1, 0, 1.0, per_example),  # type: ignore[arg-type]
    }
    return _run(model, state, inputs, targets, method, per_example, computes)


def hessian_vector_product(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    direction: Params,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Hessian-vector product ``∇²_θ L · v``; arguments as in :func:`gradient`.

    ``direction`` is keyed like ``dict(model.named_parameters())`` with the same shapes.
    Taylor mode differentiates the first Taylor coefficient: ``∇_θ (vᵀ ∇L)``.
    """
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    computes: dict[str, Compute | None] = {
        "taylor": None if program is None else _taylor_grad(program, loss, v, 2, 1, 1.0, per_example),  # type: ignore[arg-type]
        "autograd": _reference(model, loss, lambda f, p: fn.autograd_hvp(f, p, v)),
        "torch.func": _reference(model, loss, lambda f, p: fn.func_hvp(f, p, v)),
    }
    return _run(model, state, inputs, targets, method, per_example, computes)


def third_order_vector(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    direction: Params,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Third-order vector ``t = ∇_θ (vᵀ ∇²_θ L v)``; arguments as in :func:`hessian_vector_product`.

    Taylor mode propagates the order-2 series of ``L(θ + s v)`` and differentiates
    ``2 c₂ = vᵀ∇²L v`` with one reverse pass.
    """
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    computes: dict[str, Compute | None] = {
        "taylor": None if program is None else _taylor_grad(program, loss, v, 3, 2, 2.0, per_example),  # type: ignore[arg-type]
        "torch.func": _reference(model, loss, lambda f, p: fn.func_third_order(f, p, v)),
        "autograd": _reference(model, loss, lambda f, p: fn.autograd_third_order(f, p, v)),
    }
    return _run(model, state, inputs, targets, method, per_example, computes)


def directional_derivatives(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    direction: Params,
    order: int,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Derivatives ``dᵏ/dsᵏ L(θ + s v)`` at ``s = 0`` for ``k = 0 … order``.

    The result's ``values[k]`` is the ``k``-th derivative (``values[0] = L``); per
    example, ``values`` has shape ``[B, order + 1]``.  Methods: ``"taylor"``
    (one forward pass of order-``order`` series) or ``"torch.func"`` (nested ``jvp``).
    """
    if order < 0:
        raise ValueError("order must be non-negative")
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    factorials = [float(math.factorial(k)) for k in range(order + 1)]

    def taylor(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            c = loss_series(program, loss, params, buffers, v, x, y, order + 1)  # type: ignore[arg-type]
            d = c * c.new_tensor(factorials)
        return d, d[0]

    def nested(f: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        d = fn.func_directional(f, params, v, order)
        return d, d[0]

    computes: dict[str, Compute | None] = {
        "taylor": None if program is None else taylor,
        "torch.func": _reference(model, loss, nested),
    }
    return _run(model, state, inputs, targets, method, per_example, computes)


def hessian(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    per_example: bool = False,
) -> HigherOrderResult:
    """Dense Hessian ``[P, P]`` over parameters flattened in ``named_parameters`` order.

    Meant for small models: memory grows as ``P²``.
    """

    def dense(f: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        return fn.func_hessian(f, params), f(params)

    computes: dict[str, Compute | None] = {"torch.func": _reference(model, loss, dense)}
    return _run(model, model_state(model), inputs, targets, "torch.func", per_example, computes)
