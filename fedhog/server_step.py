"""A server-side step length from higher-order derivatives on the server's proxy data.

Each round the server optimizer proposes a step ``d`` (θ ← θ + d) from the
private release. With ``server-step`` set, the server scales it by ``s``, the
minimiser on ``(0, server-step-max]`` of a polynomial model of the loss
``φ(s) = L_proxy(θ + s·d)`` along that direction:

- ``cubic``: ``φ(0) + s·φ′ + s²/2·φ″ + s³/6·φ‴`` — the third-order learning rate
  of HOG's seed, applied where it costs no privacy;
- ``newton``: the quadratic model (``φ‴`` left out): a curvature-aware step
  ``−φ′/φ″`` along ``d``.

The derivatives come from :func:`fedhog.derivatives.directional_derivatives`
on the proxy set, examples the server holds apart from every client's data and
from the test set (``proxy-fraction``). ``d`` is a function of the DP release
and ``L_proxy`` of the server's own data, so the step is post-processing: it
costs no privacy. When the proxy loss does not descend along ``d`` the step
is zero (the reason is recorded); non-finite derivatives fall back to ``s = 1``,
the server optimizer's own step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .choices import SERVER_STEPS

if TYPE_CHECKING:
    import torch
    from torch import nn

    from .data import ArrayData
    from .derivatives.step_size import StepSize


@dataclass(frozen=True)
class ServerStepSettings:
    """``kind`` in :data:`SERVER_STEPS`; ``max_scale``: the largest multiple of the proposed step taken."""

    kind: str = "none"
    max_scale: float = 4.0

    def __post_init__(self) -> None:
        if self.kind not in SERVER_STEPS:
            raise ValueError(f"kind={self.kind!r} is not allowed; expected one of {', '.join(SERVER_STEPS)}")
        if not (math.isfinite(self.max_scale) and self.max_scale > 0):
            raise ValueError(f"max_scale={self.max_scale!r} is not allowed; expected a finite number > 0")


class ProxyStepLength:
    """Scale the server optimizer's step by the minimiser of the proxy loss's model along it.

    Parameters
    ----------
    settings : ServerStepSettings
        ``newton`` or ``cubic``, and the largest scale.
    model : nn.Module
        A model of the run's architecture (its parameters are overwritten).
    proxy : ArrayData
        The server's proxy examples (non-empty).
    keys : sequence of str
        The order in which the flat vectors hold the model's ``state_dict`` entries.
    """

    def __init__(self, settings: ServerStepSettings, model: nn.Module, proxy: ArrayData, keys: Sequence[str]) -> None:
        if settings.kind == "none":
            raise ValueError("ProxyStepLength needs server-step 'newton' or 'cubic'")
        if len(proxy) == 0:
            raise ValueError("ProxyStepLength needs a non-empty proxy set (proxy-fraction > 0)")
        import torch

        self.settings = settings
        self.model = model.eval()
        self.dtype = next(model.parameters()).dtype
        self.inputs = torch.from_numpy(proxy.x).to(self.dtype)
        self.targets = torch.from_numpy(proxy.y)
        state = model.state_dict()
        self.keys = list(keys)
        self.shapes = [tuple(state[k].shape) for k in self.keys]
        self.sizes = [math.prod(shape) for shape in self.shapes]
        self.parameters = {name for name, _ in model.named_parameters()}

    def __repr__(self) -> str:
        return (f"ProxyStepLength({self.settings.kind!r}, max_scale={self.settings.max_scale}, "
                f"proxy={len(self.targets)})")

    def _entries(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: part.reshape(shape).to(self.dtype)
                for k, part, shape in zip(self.keys, flat.split(self.sizes), self.shapes, strict=True)}

    def __call__(self, theta: torch.Tensor, step: torch.Tensor) -> StepSize:
        """The scale ``s`` for θ + s·step (flat vectors in ``keys`` order), with why it was chosen."""
        from .derivatives import StepSize, cubic_step, directional_derivatives

        self.model.load_state_dict(self._entries(theta))
        direction = {k: v for k, v in self._entries(step).items() if k in self.parameters}
        order = 3 if self.settings.kind == "cubic" else 2
        result = directional_derivatives(self.model, self.inputs, self.targets, direction, order=order)
        derivatives = [float(v) for v in result.values][1:]
        d1, d2 = derivatives[0], derivatives[1]
        d3 = derivatives[2] if order == 3 else 0.0
        if not result.finite:
            return StepSize(1.0, "non-finite derivatives: the optimizer's step")
        return cubic_step(d1, d2, d3, max_step=self.settings.max_scale, fallback_step=1.0)
