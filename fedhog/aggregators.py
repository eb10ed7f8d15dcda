"""The ``aggregator`` a run uses, and everything that differs between them, in one registry.

``fedhog`` is fedhog's own :class:`~fedhog.strategy.SecureAggregator` (its
mechanism, accountant, checkpoints); ``flower-dp`` is Flower's accounted
``DifferentialPrivacyServerSideFixedClipping`` over ``FedAvg``, a baseline
(:mod:`fedhog.flower_baseline`). The config's validation and calibration, the
ServerApp, the ClientApp, the vectorized engine, the audit and the CLI's
``--resume`` ask the :class:`Aggregator` of a config (:func:`aggregator_of`)
and never compare its name. Light: what runs is imported when it runs, so
that reading a config loads neither torch nor Flower.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from flwr.app import ArrayRecord, Message
    from flwr.serverapp import Grid

    from .config import RunConfig
    from .privacy.audit.attacks import Relation
    from .protocol import LocalWork
    from .server_app import ServerRun


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
    audit_harness: ClassVar[str | None] = None  # the audit's harness for it; None: the config's mechanism decides
    audit_relation: ClassVar[Relation | None] = None  # the audit's neighbouring relation; None: the sampling decides

    @abstractmethod
    def calibrate(self, config: RunConfig) -> float:
        """The smallest σ whose ε after ``rounds`` releases at ``delta`` is within ``target-epsilon``."""

    @abstractmethod
    def serve(self, grid: Grid, config: RunConfig, run: ServerRun) -> tuple[ArrayRecord, float]:
        """The ServerApp's rounds on ``grid`` (σ calibrated, the initial model evaluated): the model and ε."""

    @abstractmethod
    def wants_term(self, config: RunConfig) -> bool:
        """Whether a client computes its third-order term for its reply."""

    @abstractmethod
    def reply(self, msg: Message, work: LocalWork, config: RunConfig) -> Message:
        """The ClientApp's reply to a train message, from the client's local work."""


class FedhogAggregator(Aggregator):
    """``fedhog``: the :class:`~fedhog.strategy.SecureAggregator`, with the config's mechanism and accountant."""

    name = "fedhog"
    resumable = True
    applies_server_optimizer = True

    def calibrate(self, config: RunConfig) -> float:
        """σ for the config's sampling and accountant (amplified by sampling)."""
        from .privacy.calibration import calibrate_noise_multiplier

        return calibrate_noise_multiplier(config.target_epsilon, config.delta, config.rounds, config.sampling,
                                          config.sampling_rate, config.population, config.accountant)

    def serve(self, grid: Grid, config: RunConfig, run: ServerRun) -> tuple[ArrayRecord, float]:
        """Discovery, SecureAggregator rounds, a checkpoint after each."""
        from .server_app import run_secure_aggregator

        return run_secure_aggregator(grid, config, run)

    def wants_term(self, config: RunConfig) -> bool:
        """The mechanism's choice (``hog``)."""
        return config.privacy_mechanism.wants_term

    def reply(self, msg: Message, work: LocalWork, config: RunConfig) -> Message:
        """Δ, t (when computed and finite) and the metrics, as :class:`~fedhog.replies.ReplyReader` reads them."""
        from .replies import train_reply

        return train_reply(msg, work)


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

    def calibrate(self, config: RunConfig) -> float:
        """σ as Flower's wrapper accounts it: RDP, no amplification."""
        from .privacy.calibration import calibrate_unamplified_noise_multiplier

        return calibrate_unamplified_noise_multiplier(config.target_epsilon, config.delta, config.rounds,
                                                      config.population, config.expected_cohort)

    def serve(self, grid: Grid, config: RunConfig, run: ServerRun) -> tuple[ArrayRecord, float]:
        """Flower's strategy and its own loop (:mod:`fedhog.flower_baseline`); no checkpoints."""
        from .server_app import run_flower_baseline

        return run_flower_baseline(grid, config, run)

    def wants_term(self, config: RunConfig) -> bool:
        """Never: FedAvg averages updates."""
        return False

    def reply(self, msg: Message, work: LocalWork, config: RunConfig) -> Message:
        """θ + η·Δ (the wrapper clips the change at η·C) and an equal weight."""
        from .flower_baseline import flower_dp_reply
        from .protocol import TRAIN_LOSS

        return flower_dp_reply(msg, work.global_state, work.update, config.server_learning_rate,
                               float(work.metrics[TRAIN_LOSS]))


#: The config's ``aggregator`` names (:data:`fedhog.choices.AGGREGATORS`) -> their aggregators.
AGGREGATOR_REGISTRY: dict[str, Aggregator] = {a.name: a for a in (FedhogAggregator(), FlowerDpAggregator())}


def aggregator_of(config: RunConfig) -> Aggregator:
    """The aggregator of a validated config."""
    return AGGREGATOR_REGISTRY[config.aggregator]
