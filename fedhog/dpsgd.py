"""Record-level DP: local DP-SGD with Opacus (``client-dp = dpsgd``).

fedhog's SecureAggregator protects whole clients: neighbouring datasets differ
in all the records of one client. DP-SGD protects each record of a client:
neighbouring datasets differ in one record of that client's training data. It
runs on the client, so every client accounts its own ε, over all the rounds it
trained in (:mod:`fedhog.client_state` keeps that history on the client's disk).

Each step draws a Poisson batch of the client's records (each record
independently with probability q = min(1, batch_size / N)), computes
per-example gradients, clips each to L2 norm C = ``max_grad_norm``, sums them,
adds Gaussian noise and divides by the expected batch size q·N. An epoch is
⌊N / batch_size⌋ such steps; an empty batch still takes a noise-only step.
Opacus's accountant (PRV or RDP) composes the Poisson-subsampled Gaussian
mechanism over the steps of all rounds.

Where the randomness comes from (``noise`` in :class:`DpSgdSettings`):

- ``"fedhog"`` (the default): batches and noise are drawn from the client's
  :class:`~fedhog.privacy.randomness.RandomBits`, OS entropy unless a fixed
  ``privacy-seed`` makes them repeatable (and predictable). The noise lives on
  a lattice as the server's does (:mod:`fedhog.privacy.mechanism`): the sum S
  of clipped gradients is rounded onto g·ℤ^d and integer Gaussian steps are
  added, so the released gradient carries no floating-point residue of the
  records (Mironov 2012). Rounding moves S by up to g√d/2 for each of two
  neighbouring datasets, so the noise std is σ·(C + g√d). The float32 sum of
  per-example gradients inside Opacus is not rounded exactly and its error is
  outside the bound, as in every DP-SGD library.
- ``"opacus-secure"``: Opacus's ``secure_mode`` (noise hardened against
  floating-point attacks, sampling and noise from ``/dev/urandom`` through the
  ``torchcsprng`` package, which must be installed; never repeatable).

The ε bounds only what the optimiser's steps release. A reply therefore
carries no record counts, and no loss or accuracy computed from the records.
The ε itself is sent to the (trusted) server; with the client's participation
it reveals roughly how many records the client holds.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .data import ArrayData
from .privacy.lattice import MAX_CONTRIBUTIONS, NoiseLattice
from .privacy.mechanism import GaussianMechanism
from .privacy.randomness import RandomBits, lattice_gaussian, uniform
from .privacy.sampler_slack import MAX_TAIL_DELTA_SHARE, sampler_slack
from .settings import DpSgdSettings
from .settings import dpsgd_error as _reject
from .settings import is_number as _is_number
from .training import LocalTraining, as_tensors

CHECKED_EPSILON = 64.0  # the sampler's δ slack is checked at this ε (it grows with e^ε; beyond, nothing is private)


@dataclass(frozen=True)
class RecordPrivacy:
    """The record-level privacy a client has spent on its records so far.

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
    return _privacy(accountant, settings, (accountant_state or {}).get("noise_values"))


def lattice_noisy_sum(summed: torch.Tensor, settings: DpSgdSettings, bits: RandomBits) -> tuple[torch.Tensor, float]:
    """g·(round(S/g) + n), n ~ N_ℤ(0, (s/g)²)^d, in float64, and s = σ·(C + g√d), for a flat sum S of clipped
    gradients.

    Adding or removing one record moves S by at most C; rounding each of the
    two sums onto the lattice moves it by at most g√d/2 more, so the lattice
    points differ by at most C + g√d: the std s covers that sensitivity. The
    noise is the trusted server's: an exact discrete Gaussian on the lattice
    (:mod:`fedhog.privacy.mechanism`).
    """
    lattice = _lattice(settings, summed.numel())
    std = _noise_std(settings, lattice)
    steps = lattice.quantize(summed)
    if std > 0:
        steps += torch.from_numpy(lattice_gaussian(bits, lattice.dimension, std / lattice.granularity))
    return steps.to(torch.float64) * lattice.granularity, std


def _lattice(settings: DpSgdSettings, dimension: int) -> NoiseLattice:
    return NoiseLattice.for_settings(GaussianMechanism(settings.max_grad_norm, settings.noise_multiplier), dimension)


def _noise_std(settings: DpSgdSettings, lattice: NoiseLattice) -> float:
    return settings.noise_multiplier * (settings.max_grad_norm + 2 * lattice.rounding_slack)


def train_dpsgd(
    model: nn.Module,
    data: ArrayData,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    momentum: float,
    bits: RandomBits,
    settings: DpSgdSettings,
    accountant_state: Mapping[str, Any] | None = None,
) -> tuple[LocalTraining, RecordPrivacy]:
    """Train ``model`` in place with DP-SGD on ``data``; return what it did and ε.

    The drop-in counterpart of :func:`fedhog.training.train_locally`: the same
    ``model`` object is trained (Opacus's hooks are attached to it, not wrapped
    around it, and removed afterwards), so its ``state_dict`` keys are
    unchanged. ``bits`` draws the Poisson batches and the noise (unused with
    ``noise = "opacus-secure"``). ``accountant_state`` is the state returned
    for this client last round (``None`` for its first). With no records
    nothing is trained and ε is that of ``accountant_state``. ``mean_loss``
    averages the non-empty Poisson batches' losses (NaN if all were empty).

    Raises
    ------
    ValueError
        Naming the first bad argument (``epochs``, ``batch_size``,
        ``learning_rate``, ``momentum``, ``accountant_state``, ``data``), or
        ``noise_multiplier`` when it is too small for the truncated normals
        of the fedhog noise.
    FloatingPointError
        If a step's sum of clipped gradients is not finite (diverged training).
    ImportError
        For ``noise = "opacus-secure"`` without ``torchcsprng``.
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
        return LocalTraining(float("nan"), 0, 0), _privacy(accountant, settings,
                                                           (accountant_state or {}).get("noise_values"))
    if len(data) > MAX_CONTRIBUTIONS:
        raise ValueError(f"dpsgd: {len(data)} records exceed the {MAX_CONTRIBUTIONS} that the int64 lattice sum holds")
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
    steps_per_epoch = max(1, len(data) // batch_size)
    sgd = torch.optim.SGD(model.parameters(), lr=learning_rate, momentum=momentum)
    common = {"noise_multiplier": settings.noise_multiplier, "max_grad_norm": settings.max_grad_norm,
              "expected_batch_size": min(batch_size, len(data)), "loss_reduction": "mean"}  # q·N
    noise_values = None  # Opacus' secure mode draws its own noise; fedhog's sampler is accounted below
    if settings.noise == "opacus-secure":
        secure = _secure_generator()
        batches = UniformWithReplacementSampler(num_samples=len(data), sample_rate=sample_rate,
                                                generator=secure, steps=steps_per_epoch)
        optimizer = DPOptimizer(sgd, generator=secure, secure_mode=True, **common)
    else:
        dimension = sum(p.numel() for p in model.parameters() if p.requires_grad)
        steps_so_far = sum(int(n) for _, _, n in accountant.history)
        lattice = _lattice(settings, dimension)
        noise_values = [_noise_std(settings, lattice) / lattice.granularity, dimension]
        _check_noise_tail(settings, noise_values, steps_so_far + epochs * steps_per_epoch)
        batches = _PoissonBatches(bits, len(data), sample_rate, steps_per_epoch)
        optimizer = _lattice_optimizer_class()(sgd, bits=bits, settings=settings, **common)
    hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean")
    try:
        hooks.forbid_grad_accumulation()
        optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
        model.train()
        losses, steps = [], 0
        with warnings.catch_warnings():  # Opacus's backward hooks fire on inputs that need no grad
            warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
            for _ in range(epochs):
                for batch in batches:
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
    return LocalTraining(mean_loss, steps, 0), _privacy(accountant, settings, noise_values)


class _PoissonBatches:
    """``steps`` Poisson batches per iteration: each record independently with probability ``rate``."""

    def __init__(self, bits: RandomBits, num_records: int, rate: float, steps: int) -> None:
        self.bits, self.num_records, self.rate, self.steps = bits, num_records, rate, steps

    def __iter__(self) -> Iterator[np.ndarray]:
        for _ in range(self.steps):
            yield np.flatnonzero(uniform(self.bits, self.num_records) < self.rate)


@functools.cache
def _lattice_optimizer_class() -> type:
    """Opacus's DPOptimizer with :func:`lattice_noisy_sum` as its noise (built on first use: Opacus loads lazily)."""
    from opacus.optimizers import DPOptimizer

    from .compat import opacus_processed_flags

    check_processed, mark_processed = opacus_processed_flags()

    class LatticeNoiseDPOptimizer(DPOptimizer):
        """Adds lattice noise from fedhog's random bits to the sum of all parameters' clipped gradients."""

        def __init__(self, *args: Any, bits: RandomBits, settings: DpSgdSettings, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.bits, self.settings = bits, settings

        def add_noise(self) -> None:
            for p in self.params:
                check_processed(p.summed_grad)
            summed = torch.cat([p.summed_grad.detach().reshape(-1).to("cpu", torch.float64) for p in self.params])
            if not torch.isfinite(summed).all():
                raise FloatingPointError("dpsgd: the sum of clipped gradients is not finite (diverged training?)")
            noisy, _ = lattice_noisy_sum(summed, self.settings, self.bits)
            offset = 0
            for p in self.params:
                p.grad = noisy[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
                offset += p.numel()
                mark_processed(p.summed_grad)

    return LatticeNoiseDPOptimizer


def _check_noise_tail(settings: DpSgdSettings, noise_values: list, steps: int) -> None:
    """Refuse a σ for which the noise sampler's slack would add more than 1 % of δ over ``steps`` releases."""
    if settings.noise_multiplier == 0:
        return
    std_steps, dimension = noise_values
    tail = sampler_slack(settings.noise_multiplier, std_steps, dimension, steps, CHECKED_EPSILON,
                         settings.delta).delta
    if tail > MAX_TAIL_DELTA_SHARE * settings.delta:
        raise _reject("noise_multiplier", settings.noise_multiplier,
                      f"a σ large enough for the analysis of fedhog's noise sampler (values within 20 standard "
                      f"deviations), which adds {tail:.3g} to δ={settings.delta:g} over {steps} steps")


def _secure_generator() -> torch.Generator:
    try:
        import torchcsprng
    except ImportError as error:
        raise ImportError("dpsgd-noise='opacus-secure' needs the torchcsprng package, which is not installed; "
                          "install a torchcsprng built for this torch, or use dpsgd-noise='fedhog'") from error
    return torchcsprng.create_random_device_generator("/dev/urandom")


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


def _privacy(accountant, settings: DpSgdSettings, noise_values: list | None) -> RecordPrivacy:
    """ε so far (with fedhog's sampler slack when its noise was drawn: ``noise_values`` = [σ/g, d]) and the state."""
    history = [(float(s), float(q), int(n)) for s, q, n in accountant.history]
    steps = sum(n for _, _, n in history)
    if steps == 0:
        epsilon = 0.0
    elif any(s == 0 for s, _, _ in history):
        epsilon = math.inf  # Opacus's accountants cannot take σ = 0; nothing is private
    else:
        with np.errstate(divide="ignore"):  # PRV at q = 1 takes log(1 - q); its ε is still right
            epsilon = float(accountant.get_epsilon(delta=settings.delta))
    if noise_values is not None and math.isfinite(epsilon) and steps:
        std_steps, dimension = noise_values
        epsilon += sampler_slack(settings.noise_multiplier, std_steps, dimension, steps, epsilon,
                                 settings.delta).epsilon
    state = {"mechanism": accountant.mechanism(), "history": [list(h) for h in history]}
    if noise_values is not None:
        state["noise_values"] = [float(noise_values[0]), int(noise_values[1])]  # public: σ/g and the model size
    return RecordPrivacy(epsilon, settings.delta, steps, state)
