"""A user's own model for the fraud example: ``model = "simulations.fraud_model:small_mlp"``.

fedhog calls the factory as ``small_mlp(input_shape=(8,), num_classes=2)``. It
is small on purpose: client-level DP adds noise of the same std to every
coordinate of the average, so with 10 banks a round a model of ~100 parameters
keeps a signal that one of ~5 000 (``model = "mlp"``) loses in the noise.

``small_mlp`` uses GELU (smooth and non-saturating, as fedhog's built-in models
since issue 21); ``small_mlp_tanh`` is the tanh model the example was first
measured with, kept so that those figures stay reproducible.
"""

import math

from torch import nn


def small_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 8) -> nn.Module:
    """One GELU hidden layer of ``hidden`` units (smooth: the third-order term is not zero)."""
    return _one_hidden_layer(input_shape, num_classes, hidden, nn.GELU())


def small_mlp_tanh(input_shape: tuple[int, ...], num_classes: int, hidden: int = 8) -> nn.Module:
    """``small_mlp`` with tanh, which saturates (the fraud example before issue 21)."""
    return _one_hidden_layer(input_shape, num_classes, hidden, nn.Tanh())


def _one_hidden_layer(input_shape: tuple[int, ...], num_classes: int, hidden: int, activation: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), activation,
                         nn.Linear(hidden, num_classes))
