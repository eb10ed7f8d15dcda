"""Normalisation layers written so that their derivatives are right to any order.

PyTorch 2.13's fused normalisation kernels have wrong higher-order derivatives:
for ``layer_norm``, ``instance_norm`` and ``batch_norm`` with batch statistics
(``training=True``) the second derivative by nested ``jvp`` and the third by
triple backward differ from finite differences by factors (e.g. −92 against
−25), while first derivatives, ``group_norm``, ``rms_norm`` and eval-mode
``batch_norm`` agree to round-off (an audit of 90 operations through every
nesting of ``grad``/``jvp`` up to order 5; ``tests/test_derivatives_trusted.py``
keeps the normalisations under test).

:class:`TrustedDerivatives` is a ``TorchFunctionMode`` that, while active,
routes those calls to compositions of ``mean``, ``mul`` and ``rsqrt``
(elementary operations whose derivatives of every order are right) and
refuses the low-level fused kernels, which have no reformulation, with
:class:`~fedhog.derivatives.errors.UntrustedOperation`.  The engine runs its
``torch.func`` and ``autograd`` formulations inside it; Taylor mode has its own
series rules for the same layers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .errors import UntrustedOperation


def normalize(x: Tensor, dims: Sequence[int], eps: float) -> Tensor:
    """``(x − mean) · rsqrt(var + eps)`` over ``dims`` (biased variance, two passes)."""
    dims = tuple(dims)
    d = x - x.mean(dims, keepdim=True)
    return d * torch.rsqrt((d * d).mean(dims, keepdim=True) + eps)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, shape: Sequence[int]) -> Tensor:
    if weight is not None:
        y = y * weight.reshape(shape)
    if bias is not None:
        y = y + bias.reshape(shape)
    return y


def layer_norm(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """:func:`torch.nn.functional.layer_norm` from elementary operations."""
    k = len(tuple(normalized_shape)) if not isinstance(normalized_shape, int) else 1
    shape = tuple(input.shape[input.dim() - k :])
    return _affine(normalize(input, range(-k, 0), eps), weight, bias, shape)


def channel_shape(x: Tensor) -> tuple[int, ...]:
    """Broadcast shape of a per-channel vector against ``[N, C, *]``."""
    return (-1,) + (1,) * (x.dim() - 2)


def batch_norm(
    input: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """:func:`torch.nn.functional.batch_norm`; batch statistics from elementary operations.

    With ``training=True`` the running statistics are not updated (the engine
    evaluates, it does not train).
    """
    shape = channel_shape(input)
    if training or running_mean is None or running_var is None:
        y = normalize(input, [0, *range(2, input.dim())], eps)
    else:
        y = (input - running_mean.reshape(shape)) * torch.rsqrt(running_var.reshape(shape) + eps)
    return _affine(y, weight, bias, shape)


def instance_norm(
    input: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """:func:`torch.nn.functional.instance_norm` from elementary operations."""
    if not use_input_stats and running_mean is not None and running_var is not None:
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    return _affine(normalize(input, range(2, input.dim()), eps), weight, bias, channel_shape(input))


def _bind(f: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(f).bind(*args, **kwargs)
    return dict(bound.arguments)


Router = Callable[[tuple, dict], Tensor]


def _by_signature(f: Callable[..., Tensor], positional: int, dropped: str) -> Router:
    """Call ``f`` with the first ``positional`` arguments bound to its signature, less the cuDNN flag ``dropped``."""
    def route(args: tuple, kwargs: dict) -> Tensor:
        return f(**_bind(f, args[:positional], {k: v for k, v in kwargs.items() if k != dropped}))
    return route


def _by_names(f: Callable[..., Tensor], names: tuple[str, ...]) -> Router:
    """Call ``f`` with a ``torch.*`` op's positional arguments named ``names`` (its trailing cuDNN flag dropped)."""
    def route(args: tuple, kwargs: dict) -> Tensor:
        a = dict(zip(names, args[:len(names)], strict=False))
        a.update({k: v for k, v in kwargs.items() if k in names})
        return f(**a)
    return route


_ROUTED_LAYER_NORM = _by_signature(layer_norm, 5, "cudnn_enable")  # F.layer_norm / torch.layer_norm(..., cudnn_enable)
_NORM_ARGS = ("input", "weight", "bias", "running_mean", "running_var")

ROUTED: dict[Any, Router] = {
    F.layer_norm: _ROUTED_LAYER_NORM,
    torch.layer_norm: _ROUTED_LAYER_NORM,
    F.batch_norm: _by_signature(batch_norm, 8, "cudnn_enabled"),
    torch.batch_norm: _by_names(batch_norm, (*_NORM_ARGS, "training", "momentum", "eps")),
    F.instance_norm: _by_signature(instance_norm, 8, "cudnn_enabled"),
    torch.instance_norm: _by_names(instance_norm, (*_NORM_ARGS, "use_input_stats", "momentum", "eps")),
}
"""Calls replaced by a formulation from elementary operations."""

REFUSED: dict[Any, str] = {
    torch.native_layer_norm: "torch.native_layer_norm",
    torch.native_batch_norm: "torch.native_batch_norm",
    torch._native_batch_norm_legit: "torch._native_batch_norm_legit",
    torch._batch_norm_impl_index: "torch._batch_norm_impl_index",
}
"""Fused kernels with wrong higher-order derivatives and no reformulation here."""


class TrustedDerivatives(TorchFunctionMode):
    """Route normalisations to :func:`layer_norm`, :func:`batch_norm`, :func:`instance_norm`; refuse fused kernels.

    Use as a context manager around the function being differentiated (it acts
    on the forward computation; ``torch.func`` transforms and ``autograd`` then
    differentiate the elementary operations).
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            routed = ROUTED.get(func)
            refused = REFUSED.get(func)
        except TypeError:  # unhashable callables
            routed = refused = None
        if routed is not None:
            return routed(args, kwargs)
        if refused is not None:
            raise UntrustedOperation(
                f"{refused} has wrong higher-order derivatives in torch {torch.__version__} and no "
                "reformulation in fedhog.derivatives; call torch.nn.functional.layer_norm / batch_norm "
                "(routed to a formulation that is right) or an nn module instead"
            )
        return func(*args, **kwargs)

    def __repr__(self) -> str:
        return f"TrustedDerivatives(routed={len(ROUTED)}, refused={sorted(REFUSED.values())})"
