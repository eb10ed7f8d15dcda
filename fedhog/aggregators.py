"""The ``aggregator`` a run uses, and what differs between them, declared once.

``fedhog`` is fedhog's own :class:`~fedhog.strategy.SecureAggregator` (its
mechanism, accountant, checkpoints); ``flower-dp`` is Flower's accounted
``DifferentialPrivacyServerSideFixedClipping`` over ``FedAvg``, a baseline
(:mod:`fedhog.flower_baseline`). The config's validation and calibration, the
ClientApp, the vectorized engine, the audit and the CLI's ``--resume`` ask the
:class:`Aggregator` of a config (:func:`aggregator_of`) and never compare its
name. What an aggregator *is* is declared here, below the config that reads
it; what it *runs* belongs to the apps, keyed by the same names: the
ServerApp's rounds (:data:`fedhog.server_app.SERVERS`) and the ClientApp's
train reply (:data:`fedhog.client_app.TRAIN_REPLIES`). Light: it imports
neither torch nor Flower (calibration imports the accountants when it runs).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from .choices import SamplingKind
    from .privacy.audit.attacks import Relation


class Aggregator(ABC):
    """One ``aggregator`` choice: what each part of fedhog does for it."""

    name: ClassVar[str]  # the config's ``aggregator`` value
    resumable: ClassVar[bool]  # it checkpoints every round: ``--resume`` continues an interrupted run
    #: Config keys it allows one value of (key -> value), and why (for the error that names a key).
    requires: ClassVar[Mapping[str, Any]] = {}
    requirement: ClassVar[str] = ""
    needs_noise: ClassVar[bool] = False  # refuses σ = 0 without a target-epsilon
    applies_server_optimizer: ClassVar[bool]  # the release moves the model by ``server-optimizer`` (diagnostics)
    #: The ClientApp answers one train message per client with the same model: the vectorized engine trains a
    #: round's messages as one batch (fedhog's own rounds come through its cohort runner instead).
    batches_train_messages: ClassVar[bool] = False
    #: Its clients send their third-order terms when the mechanism mixes them in (``hog``).
    takes_terms: ClassVar[bool] = False
    audit_harness: ClassVar[str | None] = None  # the audit's harness for it; None: the config's mechanism decides
    audit_relation: ClassVar[Relation | None] = None  # the audit's neighbouring relation; None: the sampling decides

    @abstractmethod
    def calibrate(self, *, target_epsilon: float, delta: float, rounds: int, sampling: SamplingKind,
                  sampling_rate: float, population: int, accountant: str, expected_cohort: int) -> float:
        """The smallest σ whose ε after ``rounds`` releases at ``delta`` is within ``target_epsilon``."""


class FedhogAggregator(Aggregator):
    """``fedhog``: the :class:`~fedhog.strategy.SecureAggregator`, with the config's mechanism and accountant."""

    name = "fedhog"
    resumable = True
    applies_server_optimizer = True
    takes_terms = True

    def calibrate(self, *, target_epsilon: float, delta: float, rounds: int, sampling: SamplingKind,
                  sampling_rate: float, population: int, accountant: str, expected_cohort: int) -> float:
        """σ for the config's sampling and accountant (amplified by sampling)."""
        from .privacy.calibration import calibrate_noise_multiplier

        return calibrate_noise_multiplier(target_epsilon, delta, rounds, sampling, sampling_rate, population,
                                          accountant)


class FlowerDpAggregator(Aggregator):
    """``flower-dp``: Flower's accounted fixed-clipping wrapper over FedAvg, a baseline."""

    name = "flower-dp"
    resumable = False
    requires: ClassVar[Mapping[str, Any]] = {
        "mechanism": "gaussian", "sampling": "fixed", "accountant": "rdp", "client-dp": "none",
        "adaptive-clipping": False, "resume": False, "max-update-norm": math.inf, "server-step": "none"}
    requirement = ("Flower's DifferentialPrivacyServerSideFixedClipping over FedAvg adds Gaussian noise to a "
                   "fixed-size cohort and accounts it with its RdpAccountant without amplification; it has no mixing, "
                   "adaptive clipping, reply filter or checkpoints")
    needs_noise = True
    applies_server_optimizer = False
    batches_train_messages = True
    audit_harness = "flower-dp"
    audit_relation = "add-remove"  # Flower's wrapper accounts add/remove one, without amplification

    def calibrate(self, *, target_epsilon: float, delta: float, rounds: int, sampling: SamplingKind,
                  sampling_rate: float, population: int, accountant: str, expected_cohort: int) -> float:
        """σ as Flower's wrapper accounts it: RDP, no amplification."""
        from .privacy.calibration import calibrate_unamplified_noise_multiplier

        return calibrate_unamplified_noise_multiplier(target_epsilon, delta, rounds, population, expected_cohort)


#: The config's ``aggregator`` names (:data:`fedhog.choices.AGGREGATORS`) -> their aggregators.
AGGREGATOR_REGISTRY: dict[str, Aggregator] = {a.name: a for a in (FedhogAggregator(), FlowerDpAggregator())}


class _Configured(Protocol):
    @property
    def aggregator(self) -> str: ...


def aggregator_of(config: _Configured) -> Aggregator:
    """The aggregator of a validated config (anything with its ``aggregator`` name)."""
    return AGGREGATOR_REGISTRY[config.aggregator]
