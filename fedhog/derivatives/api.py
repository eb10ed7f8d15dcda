"""Public entry points: derivatives of a model's mean batch loss in its parameters.

Each function evaluates ``L(θ) = loss(model(inputs; θ, buffers), targets)`` with
``torch.func.functional_call`` in eval mode (running BatchNorm statistics, no
dropout), never keeps an autograd graph alive after returning, and reports
non-finite results through ``HigherOrderResult.finite``.
"""

from __future__ import annotations

import contextlib
import numbers
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from .losses import LossFn

Params = dict[str, Tensor]


@dataclass(frozen=True)
class HigherOrderResult:
    """Outcome of one derivative computation.

    Attributes
    ----------
    vector : dict[str, Tensor] or None
        Parameter-shaped result (detached); with ``per_example=True`` each entry
        has a leading batch dimension.  ``None`` for scalar quantities.
    finite : bool
        ``False`` if any returned number (or the loss) is non-finite; the
        numbers must then not be used.
    method : str
        Formulation that ran: ``"taylor"``, ``"torch.func"`` or ``"autograd"``.
    seconds : float
        Wall-clock time of the computation.
    loss : float
        ``L(θ)`` on the batch (mean over examples when per-example).
    values : Tensor or None
        Non-parameter-shaped result: directional derivatives ``[L, L′, …, L⁽ᵏ⁾]``
        or a dense Hessian.
    """

    vector: Params | None
    finite: bool
    method: str
    seconds: float
    loss: float
    values: Tensor | None = None


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Put ``model`` in eval mode and restore every submodule's flag afterwards."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def model_state(model: nn.Module) -> tuple[Params, Params]:
    """Return detached ``(params, buffers)`` of ``model``."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    buffers = {k: b.detach() for k, b in model.named_buffers()}
    return params, buffers


def batch_objective(
    model: nn.Module, buffers: Params, loss: LossFn, inputs: Tensor, targets: Tensor
) -> Callable[[Params], Tensor]:
    """Return ``θ ↦ loss(model(inputs; θ, buffers), targets)``."""

    def f(params: Params) -> Tensor:
        return loss(functional_call(model, (params, buffers), (inputs,)), targets)

    return f


def describe(value: Any) -> str:
    """A short description of an argument for error messages (never the elements of a tensor)."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} Tensor of shape {tuple(value.shape)}"
    if value is None or isinstance(value, (bool, numbers.Number, str)):
        return repr(value)[:80]
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    kind = type(value).__name__
    return f"{kind} {name!r}" if name and callable(value) else f"a {kind}"


def _names(keys: Any, limit: int = 5) -> str:
    keys = sorted(map(str, keys))
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{f', … ({len(keys)} in all)' if len(keys) > limit else ''}]"


def check_model(model: Any) -> nn.Module:
    """Require an ``nn.Module`` (its parameters are what is differentiated)."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module whose parameters are differentiated; got {describe(model)} "
            "(wrap a function of parameters in an nn.Module that registers them as nn.Parameter)"
        )
    return model


def check_tensor(name: str, value: Any) -> Tensor:
    """Require a tensor argument."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {describe(value)}")
    return value


def check_flag(name: str, value: Any) -> bool:
    """Require a bool argument."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {describe(value)}")
    return value


def check_order(order: Any) -> int:
    """Require a non-negative integer order (bools and floats are refused, integral floats too)."""
    if isinstance(order, bool) or not isinstance(order, numbers.Integral):
        raise TypeError(f"order must be a non-negative int (the highest derivative computed); got {describe(order)}")
    if order < 0:
        raise ValueError(f"order must be a non-negative int (the highest derivative computed); got {order}")
    return int(order)


def check_direction(direction: Any, params: Params) -> Params:
    """Validate ``direction`` against ``params`` and cast it to their dtype/device.

    ``direction`` must be a mapping keyed like ``dict(model.named_parameters())``
    with tensors of the parameters' shapes.
    """
    if not isinstance(direction, Mapping):
        hint = ""
        if isinstance(direction, Tensor):
            total = sum(p.numel() for p in params.values())
            hint = (
                f" ({total} parameters in all: split a flat vector with "
                "dict(zip(names, torch.split(flat, sizes))) and reshape each part)"
            )
        raise TypeError(
            "direction must be a dict keyed by parameter name, as dict(model.named_parameters()), with a "
            f"tensor of each parameter's shape; got {describe(direction)}{hint}"
        )
    if set(direction) != set(params):
        missing, extra = set(params) - set(direction), set(direction) - set(params)
        raise ValueError(
            "direction must be keyed by parameter name, as dict(model.named_parameters()); "
            f"missing {_names(missing)}, unexpected {_names(extra)}"
        )
    out = {}
    for k, p in params.items():
        d = direction[k]
        if not isinstance(d, Tensor):
            raise TypeError(f"direction[{k!r}] must be a torch.Tensor of shape {tuple(p.shape)}; got {describe(d)}")
        if d.shape != p.shape:
            raise ValueError(f"direction[{k!r}] has shape {tuple(d.shape)}; expected {tuple(p.shape)}")
        out[k] = d.detach().to(p)
    return out


def all_finite(*items: Params | Tensor | None) -> bool:
    """Return whether every tensor in ``items`` is finite (one synchronisation)."""
    tensors: list[Tensor] = []
    for item in items:
        if isinstance(item, dict):
            tensors.extend(item.values())
        elif item is not None:
            tensors.append(item)
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return True
    # A finite 2-norm implies finite entries (NaN and ±inf propagate); only a norm that
    # overflows from finite entries (|x| > 1e19 in float32) needs the exact check.  The
    # 2-norm is vectorised: 1.4 ms for 4.7M parameters on one CPU thread, the max-norm 18 ms.
    norms = torch._foreach_norm(tensors, 2)
    if bool(torch.isfinite(torch.stack([n.to(torch.float64) for n in norms])).all()):
        return True
    return all(bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()) for t in tensors)


Output = Params | Tensor | tuple[Params, Tensor]
"""A formulation's result: a parameter-shaped vector, other values, or both (``(vector, values)``)."""
Compute = Callable[[Params, Params, Tensor, Tensor], tuple[Output, Tensor]]


def evaluate(
    model: nn.Module,
    state: tuple[Params, Params],
    inputs: Tensor,
    targets: Tensor,
    compute: Compute,
    per_example: bool,
) -> tuple[Output, Tensor]:
    """Run ``compute(params, buffers, inputs, targets)`` in eval mode, or per example with ``vmap``.

    ``state`` is ``model_state(model)``; ``compute`` returns ``(result, loss)``, and
    per example both gain a leading batch dimension.
    """
    params, buffers = state
    with eval_mode(model):
        if not per_example:
            return compute(params, buffers, inputs, targets)

        def one(x: Tensor, y: Tensor) -> tuple[Output, Tensor]:
            return compute(params, buffers, x.unsqueeze(0), y.unsqueeze(0))

        return vmap(one)(inputs, targets)


def finish(out: Output, value: Tensor, method: str, start: float) -> HigherOrderResult:
    """Package detached outputs into a ``HigherOrderResult`` (a ``(vector, values)`` pair fills both)."""
    vector: Params | None = None
    values: Tensor | None = None
    if isinstance(out, tuple):
        vector, values = out
    elif isinstance(out, dict):
        vector = out
    else:
        values = out
    vector = None if vector is None else {k: t.detach() for k, t in vector.items()}
    values, value = None if values is None else values.detach(), value.detach()
    return HigherOrderResult(
        vector=vector,
        finite=all_finite(vector, values, value),
        method=method,
        seconds=time.perf_counter() - start,
        loss=float(value.mean()),
        values=values,
    )
