"""Third-order step size: minimise the cubic model of the loss along the negative gradient."""

from __future__ import annotations

import math
from typing import NamedTuple

from torch import Tensor, nn

from .engine import directional_derivatives, gradient
from .losses import LossFn


class StepSize(NamedTuple):
    """A step length and why it was chosen."""

    step: float
    reason: str


def cubic_step(d1: float, d2: float, d3: float, *, max_step: float = 1.0, fallback_step: float = 1e-2) -> StepSize:
    """Minimiser in ``(0, max_step]`` of ``φ(s) = φ₀ + s d1 + s²/2 d2 + s³/6 d3``.

    The local minimiser solves ``d1 + d2 s + d3 s²/2 = 0`` with ``φ''(s) = √D > 0``,
    ``D = d2² − 2 d1 d3``, written as ``s* = −2 d1 / (d2 + √D)`` (no cancellation,
    and the Newton step ``−d1/d2`` when ``d3 = 0``).

    Returns
    -------
    StepSize
        ``reason`` is one of ``"cubic minimiser"``, ``"cubic minimiser clipped to max_step"``,
        ``"no real minimiser: max_step"`` (``D < 0``: the model decreases for all ``s > 0``),
        ``"negative curvature: max_step"``, ``"not a descent direction: zero step"``,
        ``"non-finite derivatives: fallback_step"``.
    """
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
    return StepSize(step, "cubic minimiser")


def third_order_step_size(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    loss: str | LossFn = "cross_entropy",
    max_step: float = 1.0,
    fallback_step: float = 1e-2,
) -> StepSize:
    """Step along ``d = −∇L`` from the cubic model of ``φ(s) = L(θ + s d)``.

    ``φ′, φ″, φ‴`` come from :func:`directional_derivatives`; see :func:`cubic_step`.
    """
    g = gradient(model, inputs, targets, loss=loss)
    if not g.finite:
        return StepSize(min(fallback_step, max_step), "non-finite gradient: fallback_step")
    direction = {k: -t for k, t in g.vector.items()}  # type: ignore[union-attr]
    phi = directional_derivatives(model, inputs, targets, direction, 3, loss=loss)
    if not phi.finite:
        return StepSize(min(fallback_step, max_step), "non-finite derivatives: fallback_step")
    _, d1, d2, d3 = (float(x) for x in phi.values)  # type: ignore[union-attr]
    return cubic_step(d1, d2, d3, max_step=max_step, fallback_step=fallback_step)
