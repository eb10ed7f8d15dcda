"""What the DP noise does to the model, read from the released model: weight growth, random walk, saturation.

Under DP the server adds Gaussian noise of standard deviation ``noise_std`` to
every coordinate of each round's averaged update; the server optimizer carries
it into the weights, where it adds up as a random walk. For a linear server
optimizer (``sgd``, FedAvgM ``momentum`` with β) the walk's expected length in a
layer of ``n`` weights after ``T`` rounds is

    ρ(T) = η · noise_std · √(n · Σₖ₌₁..T cₖ²),   cₖ = (1 − βᵏ) / (1 − β)   (cₖ = 1 for sgd),

(m ← β·m + ū, θ ← θ + η·m: a round's noise reaches the weights with weight
c, one more round of momentum each round). Comparing ρ with how far the layer
actually moved, ``‖W_T − W_0‖``, says how much of that movement is noise:
``walk = ρ / ‖W_T − W_0‖`` near 1 means the layer has mostly been moved by the
noise. Saturating activations (tanh, sigmoid) then lose their gradient as the
noise inflates their pre-activations: :func:`saturated_fractions` counts the
units whose derivative fell below 7 % of its maximum (``|x| > 2`` for tanh,
``|x| > 4`` for sigmoid) on the server's evaluation examples.

Which of these is an alarm: measured on the convergence federation (cnn1d at
ε = 3, 100 rounds), healthy GELU runs end with a noise walk of 1.01–1.07 and
weights grown 7.8–9.1×, the crippled tanh runs with 1.58 and 6.6×: under DP the
noise moves every layer, learning or not, so walk and growth do not separate
the two; saturation does (tanh 30–79 % of its units, GELU none). So
:func:`fedhog.alarms.alarms` (saturation) are for the progress line and the
log, and :func:`fedhog.alarms.noise_notes` (the noise moving a layer more than
its signal) are kept in ``metrics.json`` and the sweep report's noise-walk
column.

Privacy: everything here is a function of the released global models, of
public configuration (η, β, the noise's standard deviation) and of the
evaluation data the server itself holds — never of a client's data or
update. It is post-processing of the DP releases and costs no ε.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

# a saturating activation, and the |pre-activation| beyond which its derivative is below 7 % of its maximum
SATURATION_THRESHOLDS: dict[type[nn.Module], float] = {nn.Tanh: 2.0, nn.Sigmoid: 4.0}


def is_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether a state-dict entry is a layer's weight matrix or kernel (two or more dimensions, not a bias)."""
    return tensor.dim() >= 2 and name.endswith("weight")


def noise_walk_length(noise_std: float, numel: int, rounds: int, learning_rate: float, momentum: float) -> float:
    """ρ(T): the expected norm of the noise a linear server optimizer has added to ``numel`` weights in ``rounds``."""
    if momentum == 0:
        total = float(rounds)
    else:
        total = sum(((1 - momentum**k) / (1 - momentum)) ** 2 for k in range(1, rounds + 1))
    return learning_rate * noise_std * math.sqrt(numel * total)


def weight_diagnostics(initial: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor], rounds: int,
                       noise_std: float, learning_rate: float, momentum: float | None) -> dict[str, float]:
    """Per weight tensor: ``norm/<name>``, ``growth/<name>`` (‖W_T‖ / ‖W_0‖) and ``walk/<name>`` (ρ / ‖W_T − W_0‖).

    ``momentum`` is β of FedAvgM, 0 for server SGD, None for an optimizer whose
    step is not linear in the release (Adam, Yogi: no ``walk``). ``walk`` is
    left out without noise too (``noise_std`` 0 or NaN).
    """
    out: dict[str, float] = {}
    noised = noise_std > 0 and math.isfinite(noise_std)
    for name, weight in current.items():
        if not is_weight(name, weight):
            continue
        start = initial[name].to(weight.dtype)
        norm, start_norm = float(weight.norm()), float(start.norm())
        out[f"norm/{name}"] = norm
        out[f"growth/{name}"] = norm / start_norm if start_norm > 0 else math.inf
        if noised and momentum is not None:
            moved = float((weight - start).norm())
            walk = noise_walk_length(noise_std, weight.numel(), rounds, learning_rate, momentum)
            out[f"walk/{name}"] = walk / moved if moved > 0 else math.inf
    return out


@torch.no_grad()
def saturated_fractions(model: nn.Module, inputs: torch.Tensor) -> dict[str, float]:
    """``saturated/<module>``: the fraction of a saturating activation's inputs beyond its threshold.

    One forward pass of ``inputs`` (the server's own evaluation examples); a
    model without tanh or sigmoid modules gives an empty dict.
    """
    counts: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        threshold = SATURATION_THRESHOLDS.get(type(module))
        if threshold is None:
            continue

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...], __: object, name: str = name,
                 threshold: float = threshold) -> None:
            counts[f"saturated/{name}"] = float((args[0].abs() > threshold).float().mean())

        hooks.append(module.register_forward_hook(hook))
    if hooks:
        training = model.training
        model.eval()
        try:
            model(inputs)
        finally:
            model.train(training)
            for handle in hooks:
                handle.remove()
    return counts
