"""Derivative quantities of a model's loss, dispatched to the fastest applicable formulation.

``method="auto"`` tries the formulations in the order of each ``computes`` dict
(fastest first as measured by ``simulations/bench_derivatives.py``): Taylor mode
(:mod:`.taylor`) when every operation of the model and the loss has a Taylor
rule, then nested ``autograd``/``torch.func``; the result's ``method`` says
which ran.  The ``torch.func``/``autograd`` formulations run inside
:class:`~fedhog.derivatives.trusted.TrustedDerivatives`, so normalisation
layers take a formulation whose higher derivatives are right.

Data arguments (``model, inputs, targets[, direction]``) are positional; every
option (``order``, ``loss``, ``method``, ``per_example``) is keyword-only.
"""

from __future__ import annotations

import functools
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad, vmap

from . import functional as fn
from .api import (
    Compute,
    HigherOrderResult,
    Output,
    Params,
    batch_objective,
    check_direction,
    check_flag,
    check_model,
    check_order,
    check_tensor,
    describe,
    evaluate,
    finish,
    model_state,
)
from .errors import Unsupported
from .losses import LOSSES, LossFn, get_loss
from .taylor import LOSS_SERIES, loss_series, program_for
from .trusted import TrustedDerivatives

METHODS = ("auto", "taylor", "torch.func", "autograd")
DISTRIBUTIONS = ("rademacher", "gaussian")
"""Hutchinson's directions: both have E[v vᵀ] = I; Rademacher's estimate has the smaller variance (it drops
Gaussian's 2 Σ_j T_ijj² per coordinate, ``tests/test_hessian_trace_gradient.py``)."""
DEFAULT_SAMPLES = 4
Formulation = Callable[[Callable[[Params], Tensor], Params], tuple[Output, Tensor]]
#: (params, buffers, direction v, inputs, targets, n) -> the Taylor coefficients [n] of s ↦ L(θ + s v)
LossSeries = Callable[[Params, Params, Params, Tensor, Tensor, int], Tensor]

_GAPS = ("derivative for", "forward ad", "not implemented", "inplace operation", "does not support")
"""Phrases of PyTorch errors that mean an operation lacks a derivative of the needed kind or order."""


def _program(model: nn.Module, loss: str | LossFn) -> LossSeries | Unsupported:
    """The Taylor series of the model's named loss (:func:`~fedhog.derivatives.taylor.loss_series` with the model's
    program), or why Taylor mode cannot run (a fresh exception, not raised)."""
    if not isinstance(loss, str) or loss not in LOSS_SERIES:
        return Unsupported(f"Taylor mode needs a named loss {sorted(LOSS_SERIES)}; got {describe(loss)}")
    try:
        program = program_for(model)
    except Unsupported as exc:
        return exc

    def series(params: Params, buffers: Params, direction: Params, inputs: Tensor, targets: Tensor, n: int) -> Tensor:
        return loss_series(program, loss, params, buffers, direction, inputs, targets, n)

    return series


def _reference(model: nn.Module, loss: str | LossFn, formulation: Formulation) -> Compute:
    """Run a ``torch.func``/``autograd`` formulation with normalisations routed to trusted forms."""
    loss_fn = get_loss(loss)

    def compute(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Output, Tensor]:
        with TrustedDerivatives():
            return formulation(batch_objective(model, buffers, loss_fn, x, y), params)

    return compute


def _check_common(model: Any, inputs: Any, targets: Any, loss: Any, method: Any, per_example: Any) -> None:
    check_model(model)
    check_tensor("inputs", inputs)
    check_tensor("targets", targets)
    if not (callable(loss) or (isinstance(loss, str) and loss in LOSSES)):
        raise ValueError(
            f"loss must be one of {sorted(LOSSES)} or a callable (outputs, targets) -> scalar; got {describe(loss)}"
        )
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {describe(method)}")
    check_flag("per_example", per_example)


def _is_gap(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, NotImplementedError)) and any(g in text for g in _GAPS)


def _run(
    model: nn.Module,
    state: tuple[Params, Params],
    inputs: Tensor,
    targets: Tensor,
    method: str,
    per_example: bool,
    computes: dict[str, Compute | Unsupported],
    quantity: str,
) -> HigherOrderResult:
    """Resolve ``method`` among ``computes`` (fastest first) and run it.

    ``"auto"`` moves on to the next formulation when one raises
    :class:`Unsupported` or PyTorch lacks a derivative it needs; an explicit
    ``method`` raises :class:`Unsupported` instead.  When nothing is left, the
    last reason is raised with its type (e.g. :class:`UntrustedOperation`).
    """
    start = time.perf_counter()
    if per_example:
        computes = {k: c for k, c in computes.items() if k != "autograd"}
    if method == "auto":
        candidates = list(computes)
    elif method in computes:
        candidates = [method]
    else:
        where = " per example" if per_example else ""
        raise ValueError(
            f"method={method!r} is not available for the {quantity}{where}; expected one of {('auto', *computes)}"
        )
    failures: list[tuple[str, Unsupported]] = []
    for name in candidates:
        compute = computes[name]
        try:
            if isinstance(compute, Unsupported):
                raise compute
            out, value = evaluate(model, state, inputs, targets, compute, per_example)
        except Unsupported as exc:
            failures.append((name, exc))
            continue
        except (RuntimeError, NotImplementedError) as exc:
            if not _is_gap(exc):
                raise
            failures.append((name, Unsupported(f"PyTorch lacks a derivative: {str(exc).splitlines()[0]}")))
            continue
        return finish(out, value, name, start)
    reasons = "; ".join(f"method={name!r}: {exc}" for name, exc in failures)
    last = failures[-1][1]
    raise type(last)(f"cannot compute the {quantity} of this model ({reasons})") from last


def _taylor_grad(
    program: LossSeries | Unsupported, v: Params, n: int, k: int, scale: float, per_example: bool
) -> Compute | Unsupported:
    """``∇_θ (scale · c_k)`` where ``c`` are the Taylor coefficients of ``L(θ + s v)``.

    One reverse pass through the series propagation: ``torch.func.grad`` under
    ``vmap`` (per example), plain ``autograd.grad`` otherwise (less dispatch overhead).
    """
    if isinstance(program, Unsupported):
        return program

    def coefficient(p: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        c = program(p, buffers, v, x, y, n)
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


_ARGS_DOC = """
    Parameters
    ----------
    model : nn.Module
        Evaluated with its current parameters and buffers in eval mode.  A
        parameter shared by several layers (tied weights) is one parameter,
        named once, as in ``model.named_parameters()``.
    inputs, targets : Tensor
        One batch; ``L`` is the mean loss over it.
    direction : dict[str, Tensor]
        ``v`` (every quantity but the gradient and the Hessian), keyed like
        ``dict(model.named_parameters())``, each entry of the parameter's shape
        (not a flat vector).
    loss : {"cross_entropy", "mse"} or callable, keyword-only
        Loss ``(outputs, targets) -> scalar``; Taylor mode needs a named loss.
    method : {"auto", "taylor", "torch.func", "autograd"}, keyword-only
        Formulation; ``"auto"`` tries the fastest first and falls back.
    per_example : bool, keyword-only
        One result per example (leading batch dimension) via ``vmap``.

    Raises
    ------
    TypeError, ValueError
        For an argument of the wrong type or value; the message names it.
    Unsupported
        When ``method`` cannot differentiate the model (``"auto"``: no method can).
    UntrustedOperation
        When the model calls a kernel whose higher derivatives PyTorch gets wrong.
"""


def _doc(f: Callable[..., Any]) -> Callable[..., Any]:
    f.__doc__ = (f.__doc__ or "") + _ARGS_DOC
    return f


@_doc
def gradient(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Gradient ``∇_θ L`` in ``res.vector``, keyed like ``dict(model.named_parameters())``."""
    _check_common(model, inputs, targets, loss, method, per_example)
    program = _program(model, loss)
    state = model_state(model)
    unused = state[0]  # an order-0 series never reads the direction
    computes: dict[str, Compute | Unsupported] = {
        "autograd": _reference(model, loss, fn.autograd_gradient),
        "torch.func": _reference(model, loss, fn.func_gradient),
        "taylor": _taylor_grad(program, unused, 1, 0, 1.0, per_example),
    }
    return _run(model, state, inputs, targets, method, per_example, computes, "gradient")


@_doc
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
    """Hessian-vector product ``∇²_θ L · v`` in ``res.vector``, keyed like ``direction``.

    Taylor mode differentiates the first Taylor coefficient: ``∇_θ (vᵀ ∇L)``.
    """
    _check_common(model, inputs, targets, loss, method, per_example)
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    computes: dict[str, Compute | Unsupported] = {
        "taylor": _taylor_grad(program, v, 2, 1, 1.0, per_example),
        "autograd": _reference(model, loss, lambda f, p: fn.autograd_hvp(f, p, v)),
        "torch.func": _reference(model, loss, lambda f, p: fn.func_hvp(f, p, v)),
    }
    return _run(model, state, inputs, targets, method, per_example, computes, "Hessian-vector product")


@_doc
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
    """Third-order vector ``t = ∇_θ (vᵀ ∇²_θ L v)`` in ``res.vector``, keyed like ``direction``.

    Taylor mode propagates the order-2 series of ``L(θ + s v)`` and differentiates
    ``2 c₂ = vᵀ∇²L v`` with one reverse pass; the fallbacks are reverse-over-forward-
    over-forward ``torch.func`` and triple backward.
    """
    _check_common(model, inputs, targets, loss, method, per_example)
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    computes: dict[str, Compute | Unsupported] = {
        "taylor": _taylor_grad(program, v, 3, 2, 2.0, per_example),
        "torch.func": _reference(model, loss, lambda f, p: fn.func_third_order(f, p, v)),
        "autograd": _reference(model, loss, lambda f, p: fn.autograd_third_order(f, p, v)),
    }
    return _run(model, state, inputs, targets, method, per_example, computes, "third-order vector")


@_doc
def directional_derivatives(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    direction: Params,
    *,
    order: int,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Derivatives ``dᵏ/dsᵏ L(θ + s v)`` at ``s = 0`` for ``k = 0 … order`` (``order`` keyword-only).

    The result's ``values[k]`` is the ``k``-th derivative (``values[0] = L``); per
    example, ``values`` has shape ``[B, order + 1]``.  Methods: ``"taylor"``
    (one forward pass of order-``order`` series) or ``"torch.func"`` (nested ``jvp``).
    """
    _check_common(model, inputs, targets, loss, method, per_example)
    order = check_order(order)
    state = model_state(model)
    v = check_direction(direction, state[0])
    program = _program(model, loss)
    factorials = [float(math.factorial(k)) for k in range(order + 1)]

    def taylor(series: LossSeries, params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            c = series(params, buffers, v, x, y, order + 1)
            d = c * c.new_tensor(factorials)
        return d, d[0]

    def nested(f: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        d = fn.func_directional(f, params, v, order)
        return d, d[0]

    computes: dict[str, Compute | Unsupported] = {
        "taylor": program if isinstance(program, Unsupported) else functools.partial(taylor, program),
        "torch.func": _reference(model, loss, nested),
    }
    return _run(model, state, inputs, targets, method, per_example, computes, "directional derivatives")


def hessian(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    per_example: bool = False,
) -> HigherOrderResult:
    """Dense Hessian ``[P, P]`` in ``res.values``, over parameters flattened in ``named_parameters`` order.

    Meant for small models: memory grows as ``P²``.  ``method`` is ``"auto"`` or
    ``"torch.func"`` (forward-over-reverse); other arguments as in :func:`gradient`.
    """
    _check_common(model, inputs, targets, loss, method, per_example)

    def dense(f: Callable[[Params], Tensor], params: Params) -> tuple[Tensor, Tensor]:
        return fn.func_hessian(f, params), f(params)

    computes: dict[str, Compute | Unsupported] = {"torch.func": _reference(model, loss, dense)}
    return _run(model, model_state(model), inputs, targets, method, per_example, computes, "Hessian")


def _taylor_trace_gradient(program: LossSeries | Unsupported, vs: Params) -> Compute | Unsupported:
    """``mean_k ∇_θ(2 c₂,k)`` with ``c`` the Taylor coefficients of ``L(θ + s v_k)``, and the ``2 c₂,k``.

    The order-2 series is vmapped over the stacked directions only, so what does not depend on them (the
    primal ``c₀`` of every layer, and the products of the data with ``θ``) is computed once; one reverse pass
    of the mean gives the average of the k third-order vectors. One direction runs unvmapped, as
    :func:`third_order_vector` does.
    """
    if isinstance(program, Unsupported):
        return program

    def compute(params: Params, buffers: Params, x: Tensor, y: Tensor) -> tuple[tuple[Params, Tensor], Tensor]:
        with torch.enable_grad():
            leaves = {name: t.detach().requires_grad_(True) for name, t in params.items()}

            def quadratic(v: Params) -> tuple[Tensor, Tensor]:
                c = program(leaves, buffers, v, x, y, 3)
                return 2 * c[2], c[0]

            if next(iter(vs.values())).shape[0] == 1:  # one direction: no vmap (its fused rules apply)
                form, value = quadratic({n: d[0] for n, d in vs.items()})
                forms, values = form[None], value[None]
            else:
                forms, values = vmap(quadratic)(vs)
            target = forms.mean()
            if not target.requires_grad:  # vᵀ∇²L v does not depend on θ (a quadratic loss of a linear model)
                return ({n: torch.zeros_like(t) for n, t in params.items()}, forms.detach()), values[0].detach()
            grads = torch.autograd.grad(target, list(leaves.values()), allow_unused=True)
        pairs = zip(params.items(), grads, strict=True)
        return ({n: torch.zeros_like(t) if g is None else g for (n, t), g in pairs}, forms.detach()), values[0].detach()

    return compute


def _check_directions(directions: Any, params: Params) -> Params:
    """A non-empty sequence of directions (each as :func:`check_direction` wants) stacked ``{name: [k, …]}``."""
    if isinstance(directions, (Mapping, Tensor)) or not isinstance(directions, Sequence) or not directions:
        raise TypeError(
            "directions must be a non-empty list of dicts keyed like dict(model.named_parameters()) (one dict a "
            f"direction); got {describe(directions)}"
        )
    checked = []
    for i, d in enumerate(directions):
        try:
            checked.append(check_direction(d, params))
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"directions[{i}]: {exc}") from None
    return {k: torch.stack([d[k] for d in checked]) for k in params}


def _check_samples(samples: Any) -> int:
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral) or samples < 1:
        raise ValueError(f"samples must be a positive int (Hutchinson's random directions); got {describe(samples)}")
    return int(samples)


def random_directions(params: Params, samples: int, distribution: str,
                      generator: torch.Generator | None = None) -> Params:
    """``samples`` directions ``{name: [samples, …]}`` with i.i.d. entries, Rademacher (±1) or standard normal,
    drawn from ``generator`` (torch's default generator when None) in float64 and cast to each parameter."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}; got {describe(distribution)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None; got {describe(generator)}")
    numel = sum(p.numel() for p in params.values())
    device = generator.device if generator is not None else torch.device("cpu")
    if distribution == "rademacher":
        flat = torch.randint(0, 2, (samples, numel), generator=generator, device=device).to(torch.float64) * 2 - 1
    else:
        flat = torch.randn(samples, numel, generator=generator, device=device, dtype=torch.float64)
    pieces = flat.split([p.numel() for p in params.values()], dim=1)
    return {k: piece.reshape(samples, *p.shape).to(p) for (k, p), piece in zip(params.items(), pieces, strict=True)}


def hessian_trace_gradient(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    directions: Sequence[Params] | None = None,
    samples: int | None = None,
    generator: torch.Generator | None = None,
    distribution: str = "rademacher",
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
) -> HigherOrderResult:
    """Gradient of the Hessian's trace, ``∇_θ tr ∇²_θ L``, by Hutchinson's estimator, in ``res.vector``.

    ``tr ∇²L = E_v[vᵀ∇²L v]`` for any ``v`` with ``E[v vᵀ] = I``, so ``∇ tr ∇²L = E_v[∇(vᵀ∇²L v)]``: the mean of
    third-order vectors (:func:`third_order_vector`). With explicit ``directions`` the result is exactly
    ``mean_k ∇_θ(v_kᵀ∇²L v_k)``; otherwise ``samples`` (default :data:`DEFAULT_SAMPLES`) directions are drawn
    from ``generator`` with ``distribution`` ``"rademacher"`` (±1 entries, the smaller variance) or
    ``"gaussian"``. The k directions run in one batched pass: Taylor mode vmaps the order-2 series over them,
    so the primal and what they share are computed once, and one reverse pass differentiates their mean.
    ``res.values[k]`` is ``v_kᵀ∇²L v_k`` (their mean estimates ``tr ∇²L``). Methods: ``"taylor"``,
    ``"torch.func"`` (vmapped reverse-over-forward-over-forward), ``"autograd"`` (triple backward, the value
    and the gradient's graph once).

    Parameters
    ----------
    model, inputs, targets, loss, method
        As in :func:`third_order_vector` (no ``per_example``).
    directions : list of dict[str, Tensor], keyword-only
        Explicit ``v_k``, each keyed like ``dict(model.named_parameters())``; excludes ``samples`` and
        ``generator``.
    samples : int, keyword-only
        Number of random directions.
    generator : torch.Generator, keyword-only
        Where the random directions come from (torch's default generator when None).
    distribution : {"rademacher", "gaussian"}, keyword-only
        Their entries' distribution.

    Raises
    ------
    TypeError, ValueError
        For an argument of the wrong type or value; the message names it.
    Unsupported, UntrustedOperation
        As :func:`third_order_vector`.
    """
    _check_common(model, inputs, targets, loss, method, False)
    state = model_state(model)
    if directions is not None:
        if samples is not None or generator is not None:
            raise ValueError("directions are explicit: samples and generator draw random ones; give one or the other")
        vs = _check_directions(directions, state[0])
    else:
        vs = random_directions(state[0], _check_samples(DEFAULT_SAMPLES if samples is None else samples),
                               distribution, generator)
    program = _program(model, loss)

    def reference(formulation: Callable[[Callable[[Params], Tensor], Params, Params], tuple[Params, Tensor, Tensor]]
                  ) -> Compute:
        def run(f: Callable[[Params], Tensor], p: Params) -> tuple[tuple[Params, Tensor], Tensor]:
            t, forms, value = formulation(f, p, vs)
            return (t, forms), value

        return _reference(model, loss, run)

    computes: dict[str, Compute | Unsupported] = {
        "taylor": _taylor_trace_gradient(program, vs),
        "torch.func": reference(fn.func_trace_gradient),
        "autograd": reference(fn.autograd_trace_gradient),
    }
    return _run(model, state, inputs, targets, method, False, computes, "Hessian trace gradient")
