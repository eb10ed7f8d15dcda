"""Small classifiers for derivative-heavy federated training under DP.

Every hidden layer is followed by the ``activation`` the run selects
(:data:`ACTIVATIONS`). The default, :data:`DEFAULT_ACTIVATION`, is smooth (its
third derivative is non-zero, so the third-order term carries something) and
does not saturate: under DP the server's noise makes the weights grow as a
random walk, and a saturating ``tanh`` then loses its gradient (README, "What
DP costs"). ``tanh`` (fedhog's models before that finding, reproduced
bit-for-bit) and ``relu`` (piecewise linear: its higher derivatives vanish)
stay selectable. Inputs are shaped as :mod:`fedhog.data` provides them,
``[B, *input_shape]``, and the output is logits ``[B, num_classes]``.

The ``normalization`` the run selects (:data:`NORMALIZATIONS`) acts on every
hidden layer too; every choice keeps the model a pure, smooth function of its
parameters and one example (usable with ``torch.func``, ``vmap`` over clients,
DP-SGD's per-example gradients and the third-order term):

- ``none`` (the default): the layers as they were.
- ``group``: ``GroupNorm`` between each hidden layer and its activation (Wu &
  He, 2018), groups of about √width channels. Its statistics are those of one
  example: unlike BatchNorm it mixes neither the examples of a batch (DP-SGD
  bounds each example's gradient) nor the clients of a federation.
- ``ws``: weight-standardised hidden layers (Qiao et al., 2019): each output
  unit uses its weights centred and scaled to norm 1, so the layer is
  invariant to the scale of its weights and the noise's random walk
  (:mod:`fedhog.diagnostics`), which inflates the weights' norm, cannot inflate
  the pre-activations with it. Same parameters as ``none``.
- ``group-ws``: both, the recipe of De et al. (2022) for DP-SGD image models.

A model can also be the user's own: ``model = "package.module:factory"``
names a callable that :func:`build_model` calls as
``factory(input_shape=(...), num_classes=k)`` and that returns an
``nn.Module`` mapping ``[B, *input_shape]`` float32 inputs to ``[B, k]`` logits
(cross-entropy; a binary problem has ``k = 2``).
"""

import importlib
import math
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

from .choices import DEFAULT_ACTIVATION, DEFAULT_NORMALIZATION, MODELS, NORMALIZATIONS, is_factory

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "tanh": nn.Tanh,  # smooth, saturates: fedhog's models until the activation became a choice
    "relu": nn.ReLU,  # does not saturate, not smooth (third derivative zero almost everywhere)
    "silu": nn.SiLU,  # x·sigmoid(x): smooth, unbounded above
    "gelu": nn.GELU,  # x·Φ(x) (exact, not the tanh approximation): smooth, unbounded above
    "softplus": nn.Softplus,  # log(1 + eˣ): smooth, unbounded above, positive
}
STANDARDIZATION_EPS = 1e-6  # added to a weight row's squared norm before its inverse square root
MLP_HIDDEN = 64
CNN1D_CHANNELS = 25  # the MNIST-1D paper's CNN (three stride-2 convolutions)
CNN2D_CHANNELS = (16, 32)


def _conv_len(length: int, kernel: int, stride: int, padding: int) -> int:
    return (length + 2 * padding - kernel) // stride + 1


def standardize(weight: torch.Tensor, eps: float = STANDARDIZATION_EPS) -> torch.Tensor:
    """Each output unit's weights (a row of ``weight``: all dimensions after the first) centred, then scaled to norm 1.

    ``eps`` is added to each centred row's squared norm. Written from ``mean``, ``mul`` and ``rsqrt`` (no fused
    normalisation kernel), whose derivatives of every order are right: the third-order term differentiates through it.
    """
    rows = weight.flatten(1)
    centred = rows - rows.mean(1, keepdim=True)
    return (centred * torch.rsqrt((centred * centred).sum(1, keepdim=True) + eps)).reshape(weight.shape)


class StandardizedLinear(nn.Linear):
    """``nn.Linear`` whose forward uses :func:`standardize` of its weight (same parameters, same initialisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ standardize(W)ᵀ + b``."""
        return nn.functional.linear(x, standardize(self.weight), self.bias)


class StandardizedConv1d(nn.Conv1d):
    """``nn.Conv1d`` whose forward uses :func:`standardize` of its kernel (same parameters, same initialisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of ``x`` with the standardised kernel."""
        return self._conv_forward(x, standardize(self.weight), self.bias)


class StandardizedConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose forward uses :func:`standardize` of its kernel (same parameters, same initialisation)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The convolution of ``x`` with the standardised kernel."""
        return self._conv_forward(x, standardize(self.weight), self.bias)


def group_count(width: int) -> int:
    """GroupNorm's number of groups for ``width`` channels: the divisor of ``width`` nearest √width (25 → 5)."""
    return min((d for d in range(1, width + 1) if width % d == 0), key=lambda d: (abs(d - math.sqrt(width)), d))


def _hidden(layer: nn.Module, width: int, activation: str, normalization: str) -> list[nn.Module]:
    """A hidden layer of ``width`` output channels, then GroupNorm (``group``, ``group-ws``), then the activation."""
    norm = [nn.GroupNorm(group_count(width), width)] if normalization in ("group", "group-ws") else []
    return [layer, *norm, ACTIVATIONS[activation]()]


def _layer(kind: type[nn.Module], normalization: str) -> type[nn.Module]:
    """``kind`` (``nn.Linear``, ``nn.Conv1d``, ``nn.Conv2d``), or its standardised form for ``ws`` and ``group-ws``."""
    if normalization not in ("ws", "group-ws"):
        return kind
    return {nn.Linear: StandardizedLinear, nn.Conv1d: StandardizedConv1d, nn.Conv2d: StandardizedConv2d}[kind]


class CNN1d(nn.Module):
    """Three ``Conv1d(k=5, s=2, p=1)`` + activation layers (normalised as chosen) and a linear head.

    Accepts ``[B, C, L]`` or, for one channel, ``[B, L]``.
    """

    def __init__(self, channels: int, length: int, num_classes: int, activation: str = DEFAULT_ACTIVATION,
                 normalization: str = DEFAULT_NORMALIZATION) -> None:
        super().__init__()
        out_len = length
        for _ in range(3):
            out_len = _conv_len(out_len, 5, 2, 1)
        if out_len < 1:
            raise ValueError(f"model: input length {length} is not allowed for cnn1d; expected >= 15")
        layers: list[nn.Module] = []
        conv = _layer(nn.Conv1d, normalization)
        for c_in in (channels, CNN1D_CHANNELS, CNN1D_CHANNELS):
            layers += _hidden(conv(c_in, CNN1D_CHANNELS, 5, stride=2, padding=1), CNN1D_CHANNELS, activation,
                              normalization)
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.head = nn.Linear(CNN1D_CHANNELS * out_len, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits for ``x`` of shape ``[B, C, L]`` or ``[B, L]``."""
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # [B, L] → [B, 1, L] without branching: torch.fx traces it
        return self.head(self.features(x))


class CNN2d(nn.Module):
    """``Conv2d(3x3)`` + activation, ``Conv2d(3x3, stride 2)`` + activation (normalised as chosen), a linear head.

    Sized for 8x8 digits; accepts ``[B, C, H, W]`` or, for one channel, ``[B, H, W]``.
    """

    def __init__(self, channels: int, height: int, width: int, num_classes: int,
                 activation: str = DEFAULT_ACTIVATION, normalization: str = DEFAULT_NORMALIZATION) -> None:
        super().__init__()
        c1, c2 = CNN2D_CHANNELS
        conv = _layer(nn.Conv2d, normalization)
        self.features = nn.Sequential(
            *_hidden(conv(channels, c1, 3, padding=1), c1, activation, normalization),
            *_hidden(conv(c1, c2, 3, stride=2, padding=1), c2, activation, normalization),
            nn.Flatten(),
        )
        self.head = nn.Linear(c2 * _conv_len(height, 3, 2, 1) * _conv_len(width, 3, 2, 1), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits for ``x`` of shape ``[B, C, H, W]`` or ``[B, H, W]``."""
        x = x.reshape(x.shape[0], -1, x.shape[-2], x.shape[-1])  # [B, H, W] → [B, 1, H, W], traceable (torch.fx)
        return self.head(self.features(x))


def load_factory(name: str) -> Callable[..., nn.Module]:
    """Import the callable ``package.module:factory``; the working directory is searched too.

    Raises ``ValueError`` naming ``model`` when the module cannot be imported,
    raises while importing, or lacks the attribute, or when that is not callable.
    """
    module_name, _, attribute = name.partition(":")
    if os.getcwd() not in sys.path:  # console scripts do not search it; `python -m` and notebooks do
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise ValueError(f"model: model={name!r} cannot be imported ({error}); the module must be importable by "
                         f"every process that builds the model: installed, in the working directory "
                         f"({os.getcwd()}) or in a folder on PYTHONPATH") from None
    except Exception as error:  # pylint: disable=broad-except  # the user's module failed while importing
        raise ValueError(f"model: model={name!r}: importing {module_name} raised "
                         f"{type(error).__name__}: {error}") from None
    factory: object = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"model: model={name!r}: module {module_name} ({module.__file__}) has no attribute "
                             f"{attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"model: model={name!r} is a {type(factory).__name__}, not a callable factory")
    return factory


def _build_user_model(name: str, shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Call the user's factory and check that its model maps a batch to ``num_classes`` logits."""
    factory = load_factory(name)
    call = f"{name.partition(':')[2]}(input_shape={shape}, num_classes={num_classes})"
    try:
        model = factory(input_shape=shape, num_classes=num_classes)
    except Exception as error:  # pylint: disable=broad-except  # the user's code: report it by key
        raise ValueError(f"model: model={name!r} raised {type(error).__name__}: {error} when called as "
                         f"{call}") from error
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: model={name!r} returned a {type(model).__name__} from {call}; "
                         "expected a torch.nn.Module")
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            output = model(torch.zeros(2, *shape))
    except Exception as error:  # pylint: disable=broad-except
        raise ValueError(f"model: model={name!r} fails on a batch of shape {(2, *shape)}: "
                         f"{type(error).__name__}: {error}") from error
    finally:
        model.train(training)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (2, num_classes):
        found = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(f"model: model={name!r} maps a batch of shape {(2, *shape)} to {found}; expected "
                         f"{(2, num_classes)}: one logit per class, num_classes={num_classes} (cross-entropy; a "
                         "binary label needs 2 outputs)")
    return model


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int,
                activation: str = DEFAULT_ACTIVATION, normalization: str = DEFAULT_NORMALIZATION) -> nn.Module:
    """Build a freshly initialised model (initialisation uses torch's global RNG).

    Parameters
    ----------
    name : str
        ``package.module:factory`` (the user's own, see the module docstring) or
        one of ``MODELS``: ``logreg`` (linear), ``mlp`` (two hidden layers of
        ``MLP_HIDDEN``), ``cnn1d`` (``input_shape`` ``(L,)`` or ``(C, L)``) or
        ``cnn2d`` (``input_shape`` ``(H, W)`` or ``(C, H, W)``). ``logreg`` and
        ``mlp`` flatten any ``input_shape``.
    input_shape : tuple of int
        Shape of one example, e.g. ``fedhog.data.dataset_info(spec)[0]``.
    num_classes : int
        Number of output logits.
    activation : str
        One of :data:`ACTIVATIONS`, after every hidden layer of the built-in
        models (``logreg`` has none; a factory builds its own: ignored). For a
        given torch seed the weights do not depend on it: only the
        nonlinearity changes, and ``"tanh"`` builds fedhog's earlier models
        exactly.
    normalization : str
        One of :data:`NORMALIZATIONS` (module docstring), of the same hidden
        layers (``logreg`` and a factory: ignored). For a given torch seed the
        layers' weights do not depend on it either; ``group`` adds GroupNorm's
        scale and shift (ones and zeros) after each.

    Returns
    -------
    torch.nn.Module
        Maps ``[B, *input_shape]`` to logits ``[B, num_classes]``.

    Raises
    ------
    ValueError
        For an unknown ``name``, ``activation`` or ``normalization``, an ``input_shape`` the model cannot take, or
        ``num_classes < 1``; for a factory that cannot be imported, raises, or
        whose model does not return ``[B, num_classes]``.
    """
    if is_factory(name):
        return _build_user_model(name, tuple(int(d) for d in input_shape), num_classes)
    if name not in MODELS:
        raise ValueError(f"model: model={name!r} is not allowed; expected one of {MODELS} or 'package.module:factory'")
    if activation not in ACTIVATIONS:
        raise ValueError(f"model: activation={activation!r} is not allowed; expected one of {tuple(ACTIVATIONS)}")
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"model: normalization={normalization!r} is not allowed; expected one of {NORMALIZATIONS}")
    shape = tuple(int(d) for d in input_shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"model: input_shape={input_shape!r} is not allowed; expected positive sizes")
    if num_classes < 1:
        raise ValueError(f"model: num_classes={num_classes!r} is not allowed; expected >= 1")
    if name == "logreg":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(shape), num_classes))
    if name == "mlp":
        linear = _layer(nn.Linear, normalization)
        return nn.Sequential(
            nn.Flatten(),
            *_hidden(linear(math.prod(shape), MLP_HIDDEN), MLP_HIDDEN, activation, normalization),
            *_hidden(linear(MLP_HIDDEN, MLP_HIDDEN), MLP_HIDDEN, activation, normalization),
            nn.Linear(MLP_HIDDEN, num_classes),
        )
    if name == "cnn1d":
        if len(shape) not in (1, 2):
            raise ValueError(f"model: input_shape={input_shape!r} is not allowed for cnn1d; expected (L,) or (C, L)")
        return CNN1d(shape[0] if len(shape) == 2 else 1, shape[-1], num_classes, activation, normalization)
    if len(shape) not in (2, 3):
        raise ValueError(f"model: input_shape={input_shape!r} is not allowed for cnn2d; expected (H, W) or (C, H, W)")
    return CNN2d(shape[0] if len(shape) == 3 else 1, shape[-2], shape[-1], num_classes, activation, normalization)
