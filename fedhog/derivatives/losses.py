"""Mean batch losses written from exp/log so that every AD mode composes.

``torch.nn.functional.cross_entropy`` and ``log_softmax`` raise an in-place
error under forward-mode AD nested in reverse mode (torch 2.13), and
``jvp(grad(F.mse_loss))`` fails on zero tensors; these versions avoid both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LossFn = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean softmax cross-entropy over the batch.

    Parameters
    ----------
    logits : Tensor
        Shape ``[B, C]``.
    targets : Tensor
        Integer class labels, shape ``[B]``.
    """
    shift = logits.detach().amax(dim=-1, keepdim=True)  # exact: lse(z) = lse(z - m) + m
    lse = torch.log(torch.exp(logits - shift).sum(dim=-1)) + shift.squeeze(-1)
    picked = logits.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return (lse - picked).mean()


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean squared error over all elements (``F.mse_loss`` convention)."""
    diff = outputs - targets
    return (diff * diff).mean()


LOSSES: dict[str, LossFn] = {"cross_entropy": cross_entropy, "mse": mse}


def get_loss(loss: str | LossFn) -> LossFn:
    """Return the loss callable for a name in ``LOSSES`` or pass a callable through."""
    if callable(loss):
        return loss
    try:
        return LOSSES[loss]
    except KeyError:
        raise ValueError(f"unknown loss {loss!r}; expected one of {sorted(LOSSES)}") from None
