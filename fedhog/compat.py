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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from flwr.client.mod.secure_aggregation.secaggplus_mod import _setup as secaggplus_setup
from flwr.client.mod.secure_aggregation.secaggplus_mod import _share_keys as secaggplus_share_keys
from flwr.client.mod.secure_aggregation.secaggplus_mod import _unmask as secaggplus_unmask
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
    from flwr.app import Message

__all__ = ["opacus_processed_flags", "parse_compositions", "parse_config", "secaggplus_setup",
           "secaggplus_share_keys", "secaggplus_unmask", "stamp_message", "validate_count", "validate_delta",
           "validate_epsilon", "validate_positive_epsilon"]


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
