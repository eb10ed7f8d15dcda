"""Small smooth classifiers for derivative-heavy federated training.

All models use ``tanh`` (smooth, so higher-order derivatives are non-trivial),
no BatchNorm or dropout (pure functions of parameters and inputs, usable with
``torch.func``), and take inputs shaped as :mod:`fedhog.data` provides them:
``[B, *input_shape]``. They return logits ``[B, num_classes]``.
"""

import math

import torch
from torch import nn

MODELS = ("logreg", "mlp", "cnn1d", "cnn2d")
MLP_HIDDEN = 64
CNN1D_CHANNELS = 25  # the MNIST-1D paper's CNN (three stride-2 convolutions)
CNN2D_CHANNELS = (16, 32)


def _conv_len(length: int, kernel: int, stride: int, padding: int) -> int:
    return (length + 2 * padding - kernel) // stride + 1


class CNN1d(nn.Module):
    """Three ``Conv1d(k=5, s=2, p=1)`` + tanh layers and a linear head.

    Accepts ``[B, C, L]`` or, for one channel, ``[B, L]``.
    """

    def __init__(self, channels: int, length: int, num_classes: int) -> None:
        super().__init__()
        out_len = length
        for _ in range(3):
            out_len = _conv_len(out_len, 5, 2, 1)
        if out_len < 1:
            raise ValueError(f"model: input length {length} is not allowed for cnn1d; expected >= 15")
        layers: list[nn.Module] = []
        for c_in in (channels, CNN1D_CHANNELS, CNN1D_CHANNELS):
            layers += [nn.Conv1d(c_in, CNN1D_CHANNELS, 5, stride=2, padding=1), nn.Tanh()]
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Linear(CNN1D_CHANNELS * out_len, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits for ``x`` of shape ``[B, C, L]`` or ``[B, L]``."""
        if x.dim() == 2:
            x = x.unsqueeze(1)
        return self.head(self.features(x))


class CNN2d(nn.Module):
    """``Conv2d(3x3)`` + tanh, ``Conv2d(3x3, stride 2)`` + tanh and a linear head.

    Sized for 8x8 digits; accepts ``[B, C, H, W]`` or, for one channel, ``[B, H, W]``.
    """

    def __init__(self, channels: int, height: int, width: int, num_classes: int) -> None:
        super().__init__()
        c1, c2 = CNN2D_CHANNELS
        self.features = nn.Sequential(
            nn.Conv2d(channels, c1, 3, padding=1),
            nn.Tanh(),
            nn.Conv2d(c1, c2, 3, stride=2, padding=1),
            nn.Tanh(),
            nn.Flatten(),
        )
        self.head = nn.Linear(c2 * _conv_len(height, 3, 2, 1) * _conv_len(width, 3, 2, 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits for ``x`` of shape ``[B, C, H, W]`` or ``[B, H, W]``."""
        if x.dim() == 3:
            x = x.unsqueeze(1)
        return self.head(self.features(x))


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a freshly initialised model (initialisation uses torch's global RNG).

    Parameters
    ----------
    name : str
        One of ``MODELS``: ``logreg`` (linear), ``mlp`` (two tanh hidden layers of
        ``MLP_HIDDEN``), ``cnn1d`` (``input_shape`` ``(L,)`` or ``(C, L)``) or
        ``cnn2d`` (``input_shape`` ``(H, W)`` or ``(C, H, W)``). ``logreg`` and
        ``mlp`` flatten any ``input_shape``.
    input_shape : tuple of int
        Shape of one example, e.g. ``fedhog.data.dataset_info(spec)[0]``.
    num_classes : int
        Number of output logits.

    Returns
    -------
    torch.nn.Module
        Maps ``[B, *input_shape]`` to logits ``[B, num_classes]``.

    Raises
    ------
    ValueError
        For an unknown ``name``, an ``input_shape`` the model cannot take, or
        ``num_classes < 1``.
    """
    if name not in MODELS:
        raise ValueError(f"model: model={name!r} is not allowed; expected one of {MODELS}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"model: input_shape={input_shape!r} is not allowed; expected positive sizes")
    if num_classes < 1:
        raise ValueError(f"model: num_classes={num_classes!r} is not allowed; expected >= 1")
    if name == "logreg":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(shape), MLP_HIDDEN),
            nn.Tanh(),
            nn.Linear(MLP_HIDDEN, MLP_HIDDEN),
            nn.Tanh(),
            nn.Linear(MLP_HIDDEN, num_classes),
        )
    if name == "cnn1d":
        if len(shape) not in (1, 2):
            raise ValueError(f"model: input_shape={input_shape!r} is not allowed for cnn1d; expected (L,) or (C, L)")
        return CNN1d(shape[0] if len(shape) == 2 else 1, shape[-1], num_classes)
    if len(shape) not in (2, 3):
        raise ValueError(f"model: input_shape={input_shape!r} is not allowed for cnn2d; expected (H, W) or (C, H, W)")
    return CNN2d(shape[0] if len(shape) == 3 else 1, shape[-2], shape[-1], num_classes)
