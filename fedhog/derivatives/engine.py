"""Derivative quantities of a model's loss, dispatched to the fastest applicable formulation."""

from __future__ import annotations

import time
from typing import Callable

from torch import Tensor, nn

from . import functional as fn
from .api import HigherOrderResult, Params, check_direction, finish, model_state, run_reference
from .losses import LossFn

METHODS = ("auto", "taylor", "torch.func", "autograd")


def _resolve(method: str, per_example: bool, available: tuple[str, ...]) -> str:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    if method == "auto":
        return available[0]
    if method not in available:
        raise ValueError(f"method {method!r} is not available here; use one of {available}")
    if method == "autograd" and per_example:
        raise ValueError("method 'autograd' has no per-example version; use 'torch.func'")
    return method


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
        Loss ``(outputs, targets) -> scalar``.
    method : {"auto", "torch.func", "autograd"}
        Formulation.
    per_example : bool
        Return one gradient per example (leading batch dimension) via ``vmap``.
    """
    start = time.perf_counter()
    m = _resolve(method, per_example, ("torch.func", "autograd"))
    formulation = fn.func_gradient if m == "torch.func" else fn.autograd_gradient
    out, value = run_reference(model, inputs, targets, loss, formulation, per_example)
    return finish(out, value, m, start)


def _with_direction(
    f: Callable[..., tuple[Params, Tensor]], direction: Params
) -> Callable[[Callable[[Params], Tensor], Params], tuple[Params, Tensor]]:
    return lambda obj, params: f(obj, params, direction)


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
    """
    start = time.perf_counter()
    m = _resolve(method, per_example, ("torch.func", "autograd"))
    v = check_direction(direction, model_state(model)[0])
    f = fn.func_hvp if m == "torch.func" else fn.autograd_hvp
    out, value = run_reference(model, inputs, targets, loss, _with_direction(f, v), per_example)
    return finish(out, value, m, start)


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
    """Third-order vector ``t = ∇_θ (vᵀ ∇²_θ L v)``; arguments as in :func:`hessian_vector_product`."""
    start = time.perf_counter()
    m = _resolve(method, per_example, ("torch.func", "autograd"))
    v = check_direction(direction, model_state(model)[0])
    f = fn.func_third_order if m == "torch.func" else fn.autograd_third_order
    out, value = run_reference(model, inputs, targets, loss, _with_direction(f, v), per_example)
    return finish(out, value, m, start)


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

    The result's ``values[k]`` is the ``k``-th derivative (``values[0] = L``);
    per example, ``values`` has shape ``[B, order + 1]``.
    """
    if order < 0:
        raise ValueError("order must be non-negative")
    start = time.perf_counter()
    m = _resolve(method, per_example, ("torch.func",))
    v = check_direction(direction, model_state(model)[0])

    def formulation(obj: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        d = fn.func_directional(obj, params, v, order)
        return d, d[0]

    out, value = run_reference(model, inputs, targets, loss, formulation, per_example)
    return finish(out, value, m, start)


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
    start = time.perf_counter()

    def formulation(obj: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        return fn.func_hessian(obj, params), obj(params)

    out, value = run_reference(model, inputs, targets, loss, formulation, per_example)
    return finish(out, value, "torch.func", start)
