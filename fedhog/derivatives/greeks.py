"""Black-Scholes call Greeks from the derivative engine (nested ``jvp``), batched with ``vmap``."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.func import vmap

from .functional import func_directional


def black_scholes_call(spot: Tensor, strike: Tensor, maturity: Tensor, rate: Tensor, vol: Tensor) -> Tensor:
    """Black-Scholes price of a European call, ``S N(d₁) − K e^{−rT} N(d₂)``."""
    sd = vol * torch.sqrt(maturity)
    d1 = (torch.log(spot / strike) + (rate + 0.5 * vol * vol) * maturity) / sd
    d2 = d1 - sd
    cdf = lambda z: 0.5 * torch.erfc(-z / math.sqrt(2))  # noqa: E731  (erfc: accurate in the lower tail)
    return spot * cdf(d1) - strike * torch.exp(-rate * maturity) * cdf(d2)


def _one_option(spot: Tensor, strike: Tensor, maturity: Tensor, rate: Tensor, vol: Tensor) -> Tensor:
    in_spot = func_directional(
        lambda s: black_scholes_call(s, strike, maturity, rate, vol), spot, torch.ones_like(spot), 3
    )
    in_vol = func_directional(
        lambda v: black_scholes_call(spot, strike, maturity, rate, v), vol, torch.ones_like(vol), 1
    )
    return torch.cat([in_spot, in_vol[1:]])


def call_greeks(spot: Tensor, strike: Tensor, maturity: Tensor, rate: Tensor, vol: Tensor) -> dict[str, Tensor]:
    """Price, delta, gamma, speed (``∂³C/∂S³``) and vega of calls, one per element.

    Arguments are broadcast to a common 1-D shape; derivatives come from nested
    forward-mode AD of :func:`black_scholes_call`, vectorised over options with ``vmap``.
    Accuracy degrades as ``σ√T → 0``: differentiating the price formula then
    cancels large terms of opposite sign.
    """
    args = torch.broadcast_tensors(*(torch.as_tensor(a) for a in (spot, strike, maturity, rate, vol)))
    out = vmap(_one_option)(*(a.reshape(-1) for a in args))
    names = ("price", "delta", "gamma", "speed", "vega")
    return {name: out[:, i].reshape(args[0].shape) for i, name in enumerate(names)}
