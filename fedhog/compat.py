"""Every private Flower and Opacus name fedhog uses, in one place, under public names.

Flower and Opacus give no public API for these; each is guarded by
``tests/test_compat.py`` (its signature and what fedhog relies on it doing),
so an upgrade that moves or changes one fails there, loudly, and not in a run.
No other fedhog module imports a private Flower or Opacus name (the test scans).

- SecAgg+ client stages (``flwr.client.mod.secure_aggregation.secaggplus_mod``):
  :func:`secaggplus_setup`, :func:`secaggplus_share_keys`, :func:`secaggplus_unmask`,
  each ``(state, configs) -> reply config``; fedhog's client runs them and only
  replaces the collect stage (:mod:`fedhog.secure_aggregation.client`).
- Flower's ``RdpAccountant`` state parsers and argument checks
  (``flwr.supercore.privacy_accounting.rdp_accountant``): fedhog's PLD accountant
  reads and checks the same state and arguments (:mod:`fedhog.privacy.pld`).
- :func:`stamp_message`: a message's id and run, set as the SuperLink sets them
  on push (Flower's ``Metadata`` has no setter; :mod:`fedhog.engines.inprocess`).
- :func:`opacus_processed_flags`: Opacus' check that a clipped-gradient sum is not
  used twice, for fedhog's lattice-noise DP optimizer (:mod:`fedhog.dpsgd`).
- :func:`zero_updates_pass_flowers_clipping`: Flower's server-side fixed clipping
  (``flwr.serverapp.strategy.dp_fixed_clipping.compute_clip_model_update``)
  divides by the update's norm, so one client whose update is zero (training that
  left its model unchanged, as a diverged model's can) crashes the round with
  ``ZeroDivisionError`` (flwrlabs/flower PR #7631, open); the flower-dp baseline
  runs inside it (:mod:`fedhog.flower_baseline`).
- :func:`partition_indices`: every client's rows as flwr-datasets' Dirichlet and
  pathological partitioners assigned them, read without a ``Dataset.select`` per
  client (:mod:`fedhog.data`; ≈ 2 ms each, 20 s of the quickstart's 10 000 clients).
- :func:`dense_pmfs` and :func:`new_dense_pmf`: the dense PMFs inside a ``dp_accounting``
  ``PrivacyLossDistribution`` (``_pmf_remove``, ``_pmf_add``, ``_symmetric``; a ``DensePLDPmf``'s ``_probs``,
  ``_lower_loss``, ``_infinity_mass``, ``_discretization``, ``_pessimistic_estimate``), for the memoised
  self-composition (:mod:`fedhog.privacy.self_composition`), whose bits the contract test compares with
  ``dp_accounting``'s own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.client.mod.secure_aggregation.secaggplus_mod import _setup as secaggplus_setup
from flwr.client.mod.secure_aggregation.secaggplus_mod import _share_keys as secaggplus_share_keys
from flwr.client.mod.secure_aggregation.secaggplus_mod import _unmask as secaggplus_unmask
from flwr.serverapp.strategy import dp_fixed_clipping
from flwr.supercore.differential_privacy import get_norm
from flwr.supercore.privacy_accounting.rdp_accountant import _parse_compositions as parse_compositions
from flwr.supercore.privacy_accounting.rdp_accountant import _parse_config as parse_config
from flwr.supercore.privacy_accounting.rdp_accountant import _validate_count as validate_count
from flwr.supercore.privacy_accounting.rdp_accountant import _validate_delta as validate_delta
from flwr.supercore.privacy_accounting.rdp_accountant import _validate_epsilon as validate_epsilon
from flwr.supercore.privacy_accounting.rdp_accountant import (
    _validate_positive_epsilon as validate_positive_epsilon,
)

if TYPE_CHECKING:
    import torch
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
    from flwr.app import Message

__all__ = ["DensePmf", "dense_pmfs", "new_dense_pmf", "opacus_processed_flags", "parse_compositions", "parse_config",
           "partition_indices", "secaggplus_setup", "secaggplus_share_keys", "secaggplus_unmask", "stamp_message",
           "validate_count", "validate_delta", "validate_epsilon", "validate_positive_epsilon",
           "zero_updates_pass_flowers_clipping"]


def stamp_message(message: Message, message_id: str, run_id: int) -> None:
    """Give ``message`` the id and run that a SuperLink gives it on push (they survive the message's protobuf)."""
    message.metadata.__dict__["_message_id"] = message_id
    message.metadata.__dict__["_run_id"] = run_id


def opacus_processed_flags() -> tuple[Callable[[torch.Tensor], None], Callable[[torch.Tensor], None]]:
    """Opacus' ``(check, mark)``: ``check`` refuses a gradient that ``mark`` marked as used in a step.

    Imported on first use: clients that do not run DP-SGD never load Opacus.
    """
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed

    return _check_processed_flag, _mark_as_processed


def partition_indices(partitioner: object) -> list[list[int]] | None:
    """Each partition's row indices, once a flwr-datasets partitioner has loaded one; None if it keeps none.

    Dirichlet and pathological partitioners compute every partition on their first ``load_partition`` and keep
    them in ``_partition_id_to_indices`` (flwr-datasets 0.6); the IID partitioner keeps nothing (None).
    """
    indices = getattr(partitioner, "_partition_id_to_indices", None)
    return [indices[i] for i in range(len(indices))] if indices else None


@contextlib.contextmanager
def zero_updates_pass_flowers_clipping() -> Iterator[None]:
    """Within it, Flower's server-side fixed clipping leaves an update of norm 0 as it is instead of dividing by 0.

    A zero update has nothing to clip (min(1, C/‖Δ‖) is 1 as ‖Δ‖ → 0), which is what flwrlabs/flower PR #7631
    proposes; every other update goes through Flower's own function unchanged.
    """
    flowers = dp_fixed_clipping.compute_clip_model_update

    def clip(param1: list[np.ndarray], param2: list[np.ndarray], clipping_norm: float) -> None:
        update = [np.subtract(new, old) for new, old in zip(param1, param2, strict=True)]
        if get_norm(update) > 0:
            flowers(param1, param2, clipping_norm)
            return
        for i, old in enumerate(param2):  # Flower's own arithmetic at the scale 1 (nothing to clip)
            param1[i] = old + update[i]

    dp_fixed_clipping.compute_clip_model_update = clip
    try:
        yield
    finally:
        dp_fixed_clipping.compute_clip_model_update = flowers


@dataclass(frozen=True)
class DensePmf:
    """What a ``dp_accounting`` ``DensePLDPmf`` holds: losses ``(lower_loss + i) · discretization`` with ``probs``."""

    pmf: Any  # the DensePLDPmf itself (dp_accounting has no type information)
    probs: np.ndarray
    lower_loss: int
    infinity_mass: float


def _dense(pmf: Any) -> DensePmf | None:
    from dp_accounting.pld.pld_pmf import DensePLDPmf

    if type(pmf) is not DensePLDPmf:
        return None
    return DensePmf(pmf, pmf._probs, pmf._lower_loss, pmf._infinity_mass)


def dense_pmfs(pld: PrivacyLossDistribution, densify: bool = False) -> tuple[DensePmf, DensePmf | None] | None:
    """The (remove, add) PMFs of ``pld`` (add None when it is symmetric); None unless they are dense (with
    ``densify``, sparse ones made dense, as ``dp_accounting`` does before composing them many times)."""
    pmfs = (pld._pmf_remove, pld._pmf_add)
    if densify:
        pmfs = tuple(pmf if type(pmf).__name__ == "DensePLDPmf" else pmf.to_dense_pmf() for pmf in pmfs)
    remove = _dense(pmfs[0])
    add = None if pld._symmetric else _dense(pmfs[1])
    if remove is None or (add is None and not pld._symmetric):
        return None
    return remove, add


def new_dense_pmf(template: DensePmf, lower_loss: int, probs: np.ndarray, infinity_mass: float) -> Any:
    """A ``DensePLDPmf`` on ``template``'s grid and estimate type with the given losses and masses."""
    from dp_accounting.pld.pld_pmf import DensePLDPmf

    pmf = template.pmf
    return DensePLDPmf(pmf._discretization, lower_loss, probs, infinity_mass,
                       pmf._pessimistic_estimate)
