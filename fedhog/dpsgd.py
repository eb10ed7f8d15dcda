"""Sample-level DP: local DP-SGD with Opacus (``client-dp = dpsgd``).

fedhog's SecureAggregator protects whole clients: neighbouring datasets differ
in all the records of one client. DP-SGD protects each record of a client:
neighbouring datasets differ in one record of that client's training data. It
runs on the client, so every client accounts its own ε, over all the rounds it
trained in.

Each step Opacus draws a Poisson batch of the client's records (each record
independently with probability q = min(1, batch_size / N)), computes
per-example gradients, clips each to L2 norm ``max_grad_norm``, sums them,
adds N(0, (noise_multiplier · max_grad_norm)²) per coordinate and divides by
the expected batch size q·N. An epoch is ⌊1/q⌋ such steps. Opacus's accountant
(PRV or RDP) composes the Poisson-subsampled Gaussian mechanism over the steps
of all rounds. Its history is returned as a JSON-serialisable dict, because a
ClientApp may run in a fresh process for each message: pass it back the next
round or ε restarts from zero.

The ε bounds only what the optimiser's steps release. Anything else computed
from the raw records and sent out (the training loss, the third-order term of
``mechanism = hog``, the number of records) is outside it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from .data import ArrayData
from .training import LocalTraining, as_tensors

DPSGD_ACCOUNTANTS = ("prv", "rdp")


def _reject(key: str, value: object, expected: str) -> ValueError:
    return ValueError(f"dpsgd: {key}={value!r} is not allowed; expected {expected}")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclass(frozen=True)
class DpSgdSettings:
    """How DP-SGD privatises one client's local training.

    Attributes
    ----------
    noise_multiplier : float
        σ: noise std ÷ ``max_grad_norm``; ≥ 0 (0 clips without noise: ε = ∞).
    max_grad_norm : float
        C: each example's gradient is clipped to this L2 norm; > 0.
    delta : float
        The δ at which ε is reported, in (0, 1).
    accountant : str
        Opacus's ``"prv"`` (tight, numerical) or ``"rdp"`` (Rényi DP).
    secure_mode : bool
        Opacus's secure mode: noise and Poisson sampling from ``/dev/urandom``
        through ``torchcsprng`` and a Gaussian sampler hardened against
        floating-point attacks. This is what a deployment should run; it is off
        by default because it needs ``torchcsprng`` (not a fedhog dependency)
        and it makes runs irreproducible, as the ``seed`` is then ignored. With
        it off, noise and sampling come from torch generators seeded by
        ``seed``: anyone who knows the seed can predict, and remove, the noise.
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    accountant: str = "prv"
    secure_mode: bool = False

    def __post_init__(self) -> None:
        sigma, clip, delta = self.noise_multiplier, self.max_grad_norm, self.delta
        if not _is_number(sigma) or not (math.isfinite(sigma) and sigma >= 0):
            raise _reject("noise_multiplier", sigma, "a finite number ≥ 0")
        if not _is_number(clip) or not (math.isfinite(clip) and clip > 0):
            raise _reject("max_grad_norm", clip, "a finite number > 0")
        if not _is_number(delta) or not 0 < delta < 1:
            raise _reject("delta", delta, "a number in (0, 1)")
        if self.accountant not in DPSGD_ACCOUNTANTS:
            raise _reject("accountant", self.accountant, f"one of {DPSGD_ACCOUNTANTS}")


@dataclass(frozen=True)
class RecordPrivacy:
    """The sample-level privacy a client has spent on its records so far.

    ``accountant_state`` is Opacus's ``accountant.state_dict()`` as plain JSON
    types (``{"mechanism": "prv", "history": [[σ, q, steps], ...]}``); pass it
    to the next :func:`train_dpsgd` of the same client.
    """

    epsilon: float
    delta: float
    steps: int  # DP-SGD steps of this client, all rounds together
    accountant_state: dict[str, Any]


def record_privacy(settings: DpSgdSettings, accountant_state: Mapping[str, Any] | None) -> RecordPrivacy:
    """ε at ``settings.delta`` of a carried accountant state (ε = 0 for none).

    Raises
    ------
    ValueError
        If ``accountant_state`` is malformed or from another accountant.
    """
    accountant = _accountant(settings, accountant_state)
    return _privacy(accountant, settings)


def train_dpsgd(
    model: nn.Module,
    data: ArrayData,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    momentum: float,
    seed: int,
    settings: DpSgdSettings,
    accountant_state: Mapping[str, Any] | None = None,
) -> tuple[LocalTraining, RecordPrivacy]:
    """Train ``model`` in place with DP-SGD on ``data``; return what it did and ε.

    The drop-in counterpart of :func:`fedhog.training.train_locally`: the same
    ``model`` object is trained (Opacus's hooks are attached to it, not wrapped
    around it, and removed afterwards), so its ``state_dict`` keys are
    unchanged. ``accountant_state`` is the state returned for this client last
    round (``None`` for its first). With no records nothing is trained and ε is
    that of ``accountant_state``. ``mean_loss`` averages the non-empty Poisson
    batches' losses (NaN if all were empty).

    Raises
    ------
    ValueError
        Naming the first bad argument (``epochs``, ``batch_size``,
        ``learning_rate``, ``momentum``, ``accountant_state``).
    opacus.validators.errors.UnsupportedModuleError
        If the model has layers without per-example gradients (e.g. BatchNorm).
    """
    for key, value, ok, expected in (
        ("epochs", epochs, isinstance(epochs, int) and epochs >= 1, "an integer ≥ 1"),
        ("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1, "an integer ≥ 1"),
        ("learning_rate", learning_rate, _is_number(learning_rate) and math.isfinite(learning_rate)
         and learning_rate > 0, "a finite number > 0"),
        ("momentum", momentum, _is_number(momentum) and math.isfinite(momentum) and momentum >= 0,
         "a finite number ≥ 0"),
    ):
        if not ok:
            raise _reject(key, value, expected)
    accountant = _accountant(settings, accountant_state)
    if len(data) == 0:
        return LocalTraining(float("nan"), 0, 0), _privacy(accountant, settings)
    # Opacus is imported here, not at module level: a ClientApp message runs in a fresh process
    # on a deployment, and only DP-SGD clients should pay for the import (~1.4 s).
    from opacus.grad_sample import GradSampleHooks
    from opacus.optimizers import DPOptimizer
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler
    from opacus.validators import ModuleValidator

    ModuleValidator.validate(model, strict=True)

    device = next(model.parameters()).device
    x, y = as_tensors(data, device)
    sample_rate = min(1.0, batch_size / len(data))
    noise_generator, sampling_generator = _generators(seed, device, settings.secure_mode)
    sampler = UniformWithReplacementSampler(
        num_samples=len(data), sample_rate=sample_rate, generator=sampling_generator,
        steps=max(1, len(data) // batch_size),
    )
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean")
    try:
        hooks.forbid_grad_accumulation()
        optimizer = DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum),
            noise_multiplier=settings.noise_multiplier,
            max_grad_norm=settings.max_grad_norm,
            expected_batch_size=min(batch_size, len(data)),  # q·N
            loss_reduction="mean",
            generator=noise_generator,
            secure_mode=settings.secure_mode,
        )
        optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
        model.train()
        losses, steps = [], 0
        with warnings.catch_warnings():  # Opacus's backward hooks fire on inputs that need no grad
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            for _ in range(epochs):
                for batch in sampler:
                    index = torch.as_tensor(batch, dtype=torch.long, device=device)
                    optimizer.zero_grad(set_to_none=True)
                    loss = nn.functional.cross_entropy(model(x[index]), y[index])
                    loss.backward()
                    optimizer.step()  # an empty batch still takes a noise-only step
                    steps += 1
                    if len(batch):
                        losses.append(loss.item())
        optimizer.zero_grad(set_to_none=True)
    finally:
        hooks.cleanup()
        for parameter in model.parameters():  # DPOptimizer's buffer, which cleanup() leaves
            parameter.__dict__.pop("summed_grad", None)
    mean_loss = float(np.mean(losses)) if losses else float("nan")
    return LocalTraining(mean_loss, steps, 0), _privacy(accountant, settings)


def _generators(
    seed: int, device: torch.device, secure_mode: bool
) -> tuple[torch.Generator, torch.Generator]:
    """(noise, sampling) generators: seeded from ``seed``, or OS entropy in secure mode."""
    if secure_mode:
        try:
            import torchcsprng
        except ImportError as error:
            raise ImportError("dpsgd: secure_mode=True needs the torchcsprng package") from error
        secure = torchcsprng.create_random_device_generator("/dev/urandom")
        return secure, secure
    noise_seed, sampling_seed = np.random.SeedSequence(seed).generate_state(2, dtype=np.uint64)
    noise = torch.Generator(device=device)
    noise.manual_seed(int(noise_seed))
    sampling = torch.Generator()
    sampling.manual_seed(int(sampling_seed))
    return noise, sampling


def _accountant(settings: DpSgdSettings, state: Mapping[str, Any] | None):
    from opacus.accountants import create_accountant  # lazily, as in train_dpsgd

    accountant = create_accountant(settings.accountant)
    if state is None:
        return accountant
    try:
        history = [(float(s), float(q), int(n)) for s, q, n in state["history"]]
        accountant.load_state_dict({"history": history, "mechanism": state["mechanism"]})
    except (KeyError, TypeError, ValueError) as error:
        raise _reject("accountant_state", state,
                      f"the accountant_state of a {settings.accountant!r} accountant ({error})") from None
    return accountant


def _privacy(accountant, settings: DpSgdSettings) -> RecordPrivacy:
    history = [(float(s), float(q), int(n)) for s, q, n in accountant.history]
    steps = sum(n for _, _, n in history)
    if steps == 0:
        epsilon = 0.0
    elif any(s == 0 for s, _, _ in history):
        epsilon = math.inf  # Opacus's accountants cannot take σ = 0; nothing is private
    else:
        with np.errstate(divide="ignore"):  # PRV at q = 1 takes log(1 - q); its ε is still right
            epsilon = float(accountant.get_epsilon(delta=settings.delta))
    state = {"mechanism": accountant.mechanism(), "history": [list(h) for h in history]}
    return RecordPrivacy(epsilon, settings.delta, steps, state)
