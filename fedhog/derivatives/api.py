"""Public entry points: derivatives of a model's mean batch loss in its parameters.

Each function evaluates ``L(θ) = loss(model(inputs; θ, buffers), targets)`` with
``torch.func.functional_call`` in eval mode (running BatchNorm statistics, no
dropout), never keeps an autograd graph alive after returning, and reports
non-finite results through ``HigherOrderResult.finite``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

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


def check_direction(direction: Params, params: Params) -> Params:
    """Validate ``direction`` against ``params`` and cast it to their dtype/device."""
    if set(direction) != set(params):
        missing, extra = set(params) - set(direction), set(direction) - set(params)
        raise ValueError(f"direction keys differ from parameters: missing {missing}, extra {extra}")
    out = {}
    for k, p in params.items():
        if direction[k].shape != p.shape:
            raise ValueError(f"direction[{k!r}] has shape {tuple(direction[k].shape)}, expected {tuple(p.shape)}")
        out[k] = direction[k].detach().to(p)
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
    # the max-norm propagates NaN and is infinite exactly when an entry is
    norms = torch._foreach_norm(tensors, float("inf"))
    return bool(torch.isfinite(torch.stack([n.to(torch.float64) for n in norms])).all())


Compute = Callable[[Params, Params, Tensor, Tensor], tuple[Params | Tensor, Tensor]]


def evaluate(
    model: nn.Module,
    state: tuple[Params, Params],
    inputs: Tensor,
    targets: Tensor,
    compute: Compute,
    per_example: bool,
) -> tuple[Params | Tensor, Tensor]:
    """Run ``compute(params, buffers, inputs, targets)`` in eval mode, or per example with ``vmap``.

    ``state`` is ``model_state(model)``; ``compute`` returns ``(result, loss)``, and
    per example both gain a leading batch dimension.
    """
    params, buffers = state
    with eval_mode(model):
        if not per_example:
            return compute(params, buffers, inputs, targets)

        def one(x: Tensor, y: Tensor) -> tuple[Params | Tensor, Tensor]:
            return compute(params, buffers, x.unsqueeze(0), y.unsqueeze(0))

        return vmap(one)(inputs, targets)


def _detach(out: Params | Tensor) -> Params | Tensor:
    if isinstance(out, dict):
        return {k: t.detach() for k, t in out.items()}
    return out.detach()


def finish(out: Params | Tensor, value: Tensor, method: str, start: float) -> HigherOrderResult:
    """Package detached outputs into a ``HigherOrderResult``."""
    out, value = _detach(out), value.detach()
    vector = out if isinstance(out, dict) else None
    values = None if isinstance(out, dict) else out
    return HigherOrderResult(
        vector=vector,
        finite=all_finite(vector, values, value),
        method=method,
        seconds=time.perf_counter() - start,
        loss=float(value.mean()),
        values=values,
    )
