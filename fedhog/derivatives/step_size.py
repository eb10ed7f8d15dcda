"""Third-order step size: minimise the cubic model of the loss along the negative gradient."""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor, nn

from .engine import directional_derivatives, gradient
from .losses import LossFn

STEP_REASONS = (
    "cubic minimiser",
    "cubic minimiser clipped to max_step",
    "max_step lower than the cubic minimiser",
    "no real minimiser: max_step",
    "negative curvature: max_step",
    "not a descent direction: zero step",
    "non-finite derivatives: fallback_step",
    "non-finite gradient: fallback_step",
)
"""Every ``StepSize.reason`` that :func:`cubic_step` and :func:`third_order_step_size` return."""


class StepSize(NamedTuple):
    """A step length and why it was chosen (``reason`` is one of :data:`STEP_REASONS`)."""

    step: float
    reason: str


def _check_step(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number; got {value!r}")
    return float(value)


def cubic_step(d1: float, d2: float, d3: float, *, max_step: float = 1.0, fallback_step: float = 1e-2) -> StepSize:
    """Global minimiser on ``(0, max_step]`` of ``φ(s) = φ₀ + s d1 + s²/2 d2 + s³/6 d3``.

    A cubic has at most one local minimiser; it solves ``d1 + d2 s + d3 s²/2 = 0``
    with ``φ''(s) = √D > 0``, ``D = d2² − 2 d1 d3``, written as
    ``s* = −2 d1 / (d2 + √D)`` (no cancellation, and the Newton step ``−d1/d2``
    when ``d3 = 0``).  With ``d1 < 0``, ``φ`` decreases on ``(0, s*)``; when
    ``s* ≤ max_step`` the minimum on the interval is the lower of ``φ(s*)`` and
    ``φ(max_step)`` (``φ`` rises past ``s*`` to a local maximum and, when
    ``d3 < 0``, may fall below ``φ(s*)`` again before ``max_step``; ties go to ``s*``).

    Returns
    -------
    StepSize
        ``reason`` is one of

        - ``"cubic minimiser"``: ``s*`` (in the interval, not above ``φ(max_step)``);
        - ``"cubic minimiser clipped to max_step"``: ``s* > max_step``, ``φ`` decreases on the interval;
        - ``"max_step lower than the cubic minimiser"``: ``φ(max_step) < φ(s*)``;
        - ``"no real minimiser: max_step"``: ``D < 0``, ``φ`` decreases for all ``s > 0``;
        - ``"negative curvature: max_step"``: the local minimiser lies at ``s < 0`` (or
          ``φ`` is concave), ``φ`` decreases for all ``s > 0``;
        - ``"not a descent direction: zero step"``: ``d1 ≥ 0``;
        - ``"non-finite derivatives: fallback_step"``: ``min(fallback_step, max_step)``.

    Raises
    ------
    ValueError
        If ``max_step`` or ``fallback_step`` is not a positive finite number.
    """
    max_step = _check_step("max_step", max_step)
    fallback_step = _check_step("fallback_step", fallback_step)
    if not all(math.isfinite(d) for d in (d1, d2, d3)):
        return StepSize(min(fallback_step, max_step), "non-finite derivatives: fallback_step")
    if d1 >= 0:
        return StepSize(0.0, "not a descent direction: zero step")
    disc = d2 * d2 - 2 * d1 * d3
    if disc < 0:
        return StepSize(max_step, "no real minimiser: max_step")
    denom = d2 + math.sqrt(disc)
    if denom <= 0:
        return StepSize(max_step, "negative curvature: max_step")
    step = -2 * d1 / denom
    if not math.isfinite(step) or step > max_step:
        return StepSize(max_step, "cubic minimiser clipped to max_step")

    def phi(s: float) -> float:  # φ(s) − φ₀
        return s * (d1 + s * (d2 / 2 + s * d3 / 6))

    if phi(max_step) < phi(step):
        return StepSize(max_step, "max_step lower than the cubic minimiser")
    return StepSize(step, "cubic minimiser")


STEP_METHODS = ("auto", "taylor", "torch.func")


def third_order_step_size(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    method: str = "auto",
    max_step: float = 1.0,
    fallback_step: float = 1e-2,
) -> StepSize:
    """Step along ``d = −∇L`` minimising the cubic model of ``φ(s) = L(θ + s d)`` on ``(0, max_step]``.

    ``∇L`` comes from :func:`gradient` and ``φ′, φ″, φ‴`` from
    :func:`directional_derivatives` (both with ``method``: ``"auto"``,
    ``"taylor"`` or ``"torch.func"``); the step from :func:`cubic_step`.

    Returns
    -------
    StepSize
        ``reason`` is one of :data:`STEP_REASONS`: those of :func:`cubic_step`, or
        ``"non-finite gradient: fallback_step"`` (``min(fallback_step, max_step)``)
        when ``∇L`` has a non-finite entry.

    Raises
    ------
    ValueError
        For a ``method`` outside :data:`STEP_METHODS` or a non-positive ``max_step``
        / ``fallback_step``; the errors of :func:`gradient` for other arguments.
    """
    if not isinstance(method, str) or method not in STEP_METHODS:
        raise ValueError(f"method must be one of {STEP_METHODS}; got {method!r}")
    max_step = _check_step("max_step", max_step)
    fallback_step = _check_step("fallback_step", fallback_step)
    g = gradient(model, inputs, targets, loss=loss, method=method)
    if not g.finite:
        return StepSize(min(fallback_step, max_step), "non-finite gradient: fallback_step")
    direction = {k: -t for k, t in g.vector.items()}
    phi = directional_derivatives(model, inputs, targets, direction, order=3, loss=loss, method=method)
    if not phi.finite:
        return StepSize(min(fallback_step, max_step), "non-finite derivatives: fallback_step")
    _, d1, d2, d3 = (float(x) for x in phi.values)
    return cubic_step(d1, d2, d3, max_step=max_step, fallback_step=fallback_step)
