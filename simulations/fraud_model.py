"""A user's own model for the fraud example: ``model = "simulations.fraud_model:small_mlp"``.

fedhog calls the factory as ``small_mlp(input_shape=(8,), num_classes=2)``. It
is small on purpose: client-level DP adds noise of the same std to every
coordinate of the average, so with 10 banks a round a model of ~100 parameters
keeps a signal that one of ~5 000 (``model = "mlp"``) loses in the noise.
"""

import math

from torch import nn


def small_mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 8) -> nn.Module:
    """One tanh hidden layer of ``hidden`` units (smooth: the third-order term is not zero)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh(),
                         nn.Linear(hidden, num_classes))
