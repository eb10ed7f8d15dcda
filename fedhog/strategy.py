"""SecureAggregator: a Flower strategy with client sampling, HOG mixing and accounting.

The strategy owns the orchestration of a round (whom to ask, which replies to
trust, what to release); the mathematics lives in :mod:`fedhog.privacy`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from . import protocol
from .alarms import PRIVACY_SEED_WARNING
from .layout import flatten_record, unflatten_like
from .privacy.accounting import Accountant
from .privacy.adaptive_clipping import AdaptiveClipping
from .privacy.lattice import MAX_CONTRIBUTIONS, NoiseLattice
from .privacy.mechanism import AggregateStats, Contribution, Mechanism
from .privacy.randomness import PrivacyRandomness, RoundRandomness
from .privacy.sampler_slack import MAX_TAIL_DELTA_SHARE
from .privacy.sampling import SamplingKind, expected_cohort_size, sample_cohort
from .protocol import BadReply, ClientResult, MetricValue, Rejection, client_error_summary
from .replies import (
    CohortReplies,
    CohortRunner,
    MessageRunner,
    ReducedCohort,
    ReducingRunner,
    ReductionPlan,
    ReplyCheck,
    ReplyReader,
    TrainRequest,
    train_messages,
)
from .secure_aggregation.server import SecAggSettings, SecureAggregationFailed, SecureSum, secure_sum
from .server_optimizer import ServerOptimizer, ServerOptimizerSettings

if TYPE_CHECKING:
    from .derivatives.step_size import StepSize

MAX_EMPTY_IN_A_ROW = 3  # the ServerApp stops a run after this many rounds in a row without an accepted contribution


@dataclass
class RoundRecord:
    """What one round did, as written to ``metrics.json``."""

    round: int
    clients_sampled: int
    clients_accepted: int = 0
    clients_rejected: int = 0
    epsilon: float = 0.0
    seconds: float = 0.0
    accuracy: float = math.nan
    loss: float = math.nan
    validation_accuracy: float = math.nan  # on the server's validation set (server-validation-fraction > 0)
    validation_loss: float = math.nan
    auroc: float = math.nan  # with metrics = "...auroc": test AUROC (binary labels), else NaN (null in metrics.json)
    auprc: float = math.nan  # with metrics = "...auprc": test average precision (binary labels)
    train_loss: float = math.nan
    mean_norm_before_clip: float = math.nan
    fraction_clipped: float = math.nan
    noise_std: float = 0.0
    server_step_scale: float = math.nan  # server-step: the multiple of the server optimizer's step taken
    mean_mixing_ratio: float = math.nan
    third_order_seconds_max: float = math.nan
    third_order_failures: int = 0
    clipping_norm: float = math.nan  # C that clipped this round
    noisy_unclipped_fraction: float = math.nan  # adaptive clipping's DP release b̃
    sample_level_epsilon_max: float = math.nan  # client-dp = dpsgd: largest per-client record-level ε
    bytes_received: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    failure: str = ""  # what went wrong: no accepted contribution (noise alone released), or an unmasking failed
    layers: dict[str, float] = field(default_factory=dict)  # fedhog.diagnostics: norm/, growth/, walk/, saturated/
    warnings: list[str] = field(default_factory=list)  # fedhog.alarms.warnings_for(layers)

    def divergence_warning(self, learning_rate: float) -> str:
        """A warning when most of the sampled cohort sent non-finite updates or terms (local training diverges,
        and the release is the noise and the few finite clients); empty otherwise."""
        non_finite = sum(self.rejections.get(kind, 0)
                         for kind in (Rejection.NON_FINITE_VALUES, Rejection.NON_FINITE_THIRD_ORDER_TERM))
        if not self.clients_sampled or 2 * non_finite <= self.clients_sampled:
            return ""
        return (f"divergence: {non_finite} of {self.clients_sampled} sampled clients sent NaN or inf (local "
                f"training diverges at learning-rate={learning_rate:g}); lower learning-rate, local-epochs or "
                "clipping-norm")

    def take_evaluation(self, metrics: Mapping[str, Any]) -> None:
        """The server's evaluation of the round's model: ``accuracy``, ``loss``; validation, AUROC and AUPRC
        where measured (NaN otherwise)."""
        self.accuracy, self.loss = float(metrics["accuracy"]), float(metrics["loss"])
        self.validation_accuracy = float(metrics.get("validation-accuracy", math.nan))
        self.validation_loss = float(metrics.get("validation-loss", math.nan))
        self.auroc, self.auprc = (float(metrics.get(name, math.nan)) for name in ("auroc", "auprc"))


class SecureAggregator(Strategy):
    """Sample clients, mix third-order terms into updates, clip, noise, account.

    Parameters
    ----------
    mechanism : Mechanism
        What each round does with its contributions (:mod:`fedhog.privacy.mechanism`):
        ``none``, ``gaussian`` (DP-FedAvg), ``hog`` (mixing + DP-FedAvg), or
        one of the last two with the clients adding the noise.
    accountant : Accountant
        Composes one event per released round; reports ε(δ) (the mechanism's :meth:`~Mechanism.accountant`).
    randomness : PrivacyRandomness
        Where each round's sampling, ξ and noise come from (OS entropy, or a
        fixed seed for experiments).
    sampling : {"poisson", "fixed"}
        Poisson sampling with rate q, or exactly q·N clients without replacement.
    sampling_rate : float
        q.
    server_optimizer : ServerOptimizerSettings
        How the global model moves by the release ū: ``sgd`` (θ + η·ū, the
        default with η = 1), FedAvgM, FedAdam or FedYogi (post-processing).
    max_epsilon : float
        Training stops before a release that would push ε above this.
    max_update_norm : float
        Replies whose update is longer than this are rejected as implausible (a
        sanity bound against broken or hostile clients; clipping, not this,
        is what bounds a contribution's privacy cost).
    adaptive_clipping : AdaptiveClipping, optional
        Track a quantile of the contribution norms (Andrew et al. 2021): round t
        clips at its current C and adds noise σ_Δ·C; the accountant composes σ,
        which covers the update and the noisy count together.
    equal_weights : bool
        Replies carry no record counts (DP-SGD clients): FedAvg (``none``)
        weighs every client equally. DP mechanisms never use the counts.
    step_length : callable, optional
        ``(θ, d) -> StepSize``: the multiple of the server optimizer's step d
        to take (:class:`fedhog.server_step.ProxyStepLength`, on the server's
        proxy data; post-processing).
    secure_aggregation : SecAggSettings, optional
        SecAgg+: each client mixes, clips and quantises its own contribution
        and the server receives masked vectors only; it unmasks their sum and
        the mechanism adds the noise to it (:meth:`secure_round`), or none
        where the clients added it (distributed noise).
    """

    def __init__(
        self,
        mechanism: Mechanism,
        accountant: Accountant,
        randomness: PrivacyRandomness,
        sampling: SamplingKind,
        sampling_rate: float,
        server_optimizer: ServerOptimizerSettings = ServerOptimizerSettings(),  # noqa: B008 -- frozen dataclass
        max_epsilon: float = math.inf,
        adaptive_clipping: AdaptiveClipping | None = None,
        max_update_norm: float = math.inf,
        equal_weights: bool = False,
        step_length: Callable[[torch.Tensor, torch.Tensor], StepSize] | None = None,
        secure_aggregation: SecAggSettings | None = None,
    ) -> None:
        self.mechanism = mechanism
        self.accountant = accountant
        self.randomness = randomness
        self.equal_weights = equal_weights
        self.sampling = sampling
        self.sampling_rate = sampling_rate
        self.server_optimizer = ServerOptimizer(server_optimizer)
        self.step_length = step_length
        self.max_epsilon = max_epsilon
        self.adaptive_clipping = adaptive_clipping
        self.max_update_norm = max_update_norm
        self.secure_aggregation = secure_aggregation
        if secure_aggregation is not None and (not mechanism.clips or adaptive_clipping is not None
                                               or math.isfinite(max_update_norm)):
            raise ValueError("secure aggregation needs a clipping mechanism, a fixed C and no max-update-norm")
        self.slot_of_node = {}  # node id -> position in the population (see discover)
        self._global: ArrayRecord | None = None
        self._cohort: dict[int, int] = {}  # node id -> slot, for this round's cohort
        self._round_randomness: RoundRandomness | None = None  # this round's streams, dropped once it is released
        self.current: RoundRecord | None = None
        self.client_metrics: list[dict[str, MetricValue]] = []  # MetricRecords of the last round's accepted replies
        self.rejection_reasons: dict[str, str] = {}  # the last round's first reason of each rejection kind
        self._rejections_logged: set[str] = set()  # the round's rejection reasons already in the log

    def __repr__(self) -> str:
        return (f"SecureAggregator(mechanism={self.mechanism!r}, sampling={self.sampling!r}, q={self.sampling_rate}, "
                f"server={self.server_optimizer!r}, max_epsilon={self.max_epsilon}, "
                f"secure_aggregation={self.secure_aggregation!r})")

    @property
    def round_record(self) -> RoundRecord:
        """The record of the round in progress (from :meth:`begin_round` on)."""
        if self.current is None:
            raise RuntimeError("no round in progress: begin_round first")
        return self.current

    @property
    def global_model(self) -> ArrayRecord:
        """The round's global model (from :meth:`begin_round` on)."""
        if self._global is None:
            raise RuntimeError("no round in progress: begin_round first")
        return self._global

    def _round_streams(self) -> RoundRandomness:
        """This round's private streams, while the round has not released."""
        if self._round_randomness is None:
            raise RuntimeError("this round's randomness is gone: it has released, or never began")
        return self._round_randomness

    def _take_round_streams(self) -> RoundRandomness:
        """This round's private streams, dropped from the strategy: a round releases once."""
        randomness, self._round_randomness = self._round_streams(), None
        return randomness

    def summary(self) -> None:
        """Log the settings and the privacy status at start."""
        log(INFO, "\t├──> %r", self)
        log(INFO, "\t├──> %s", self.mechanism.describe())
        if self.adaptive_clipping is not None:
            log(INFO, "\t├──> %r (the sum gets σ_Δ·C, the accountant composes σ)", self.adaptive_clipping)
        if self.secure_aggregation is not None:
            log(INFO, "\t├──> SecAgg+: clients clip, quantise mod 2^%d and mask; the server unmasks only the sum",
                self.secure_aggregation.lattice.modulus_bits)
        if self.accountant.has_guarantee:
            log(INFO, "\t└──> %s", self.accountant.describe())
        else:
            log(WARNING, "\t└──> NO DIFFERENTIAL PRIVACY: mechanism=%r with σ=%g releases unprotected "
                "updates; ε = ∞", self.mechanism.name, self.mechanism.noise_multiplier)
        if self.randomness.seed_is_fixed:
            log(WARNING, "%s", PRIVACY_SEED_WARNING)

    @property
    def slot_of_node(self) -> dict[int, int]:
        """Node id -> position in the population (see :meth:`discover`)."""
        return self._slot_of_node

    @slot_of_node.setter
    def slot_of_node(self, mapping: dict[int, int]) -> None:
        self._slot_of_node = dict(mapping)
        self._slots = sorted(mapping.values())  # computed once, not every round (100 000 clients: 25 ms)
        self._node_of_slot = {slot: node for node, slot in mapping.items()}

    def small_federation_warning(self, dimension: int) -> str:
        """A warning, with its numbers, when the noise on a round's average of K clipped updates is longer than that
        average can be (C): its expected norm σ·C·√d / K for a model of d parameters. Empty otherwise (no guarantee,
        or no population discovered yet)."""
        population = len(self.slot_of_node)
        if not self.accountant.has_guarantee or not population:
            return ""
        cohort = expected_cohort_size(population, self.sampling_rate)
        sigma, clip = self.mechanism.noise_multiplier, self.mechanism.clipping_norm
        noise = sigma * clip * math.sqrt(dimension) / cohort
        if noise <= clip:
            return ""
        return (f"small federation: the noise on each round's average has norm σ·C·√d/K = {sigma:.3g}·{clip:g}·"
                f"√{dimension}/{cohort} ≈ {noise:.3g}, {noise / clip:.3g}× the longest average of clipped updates "
                f"(C = {clip:g}); each client's noise share σ·C/K is {sigma * clip / cohort:.3g} per coordinate with "
                f"K = {cohort} expected of N = {population} clients. Expect accuracy well below training without DP: "
                "client-level DP needs a larger population (K grows faster than σ)")

    def cover_sampler(self, numel: int) -> None:
        """Tell the accountant what each release draws from the lattice sampler (its slack enters ε and δ).

        Where the clients add the noise the accountant ignores it: its own accounting covers their discrete Gaussians.
        """
        if not self.accountant.has_guarantee:
            return
        lattice = (NoiseLattice.for_settings(self.mechanism, numel) if self.secure_aggregation is None
                   else self.secure_aggregation.lattice.noise_lattice(numel))
        std_steps = lattice.sum_std(self.mechanism) / lattice.granularity
        count_values = 0 if self.adaptive_clipping is None else 1  # the noisy count: finer than the model's noise
        self.accountant.cover_sampler(std_steps, numel + count_values)

    # --- the population --------------------------------------------------------
    def discover(self, grid: Grid, population: int, timeout: float, identify: bool) -> None:
        """Fix the population and the order in which it is sampled.

        With ``identify`` every node is asked for its partition id and sampling
        is keyed by partition, so that a fixed privacy seed picks the same
        clients on every engine and every run (node ids are random per
        deployment). Without it (sampling from OS entropy, where no run repeats
        anyway) a node's slot is its rank among node ids, which spares one
        message per client: ~25 s for 1000 clients on the Simulation Engine.
        A grid that holds its nodes' data itself offers the answer as
        ``grid.known_partitions`` (node id -> partition id; the vectorized
        engine's), and no node is asked.
        """
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) != population:
            raise RuntimeError(_population_mismatch(population, f"{len(node_ids)} nodes are connected"))
        if not identify:
            self.slot_of_node = {node: rank for rank, node in enumerate(node_ids)}
            return
        known = getattr(grid, "known_partitions", None)  # a Grid that holds its nodes' data says so: no messages
        if known is not None:
            mapping = dict(known)
        else:
            messages = [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in node_ids]
            mapping = {}
            for reply in grid.send_and_receive(messages, timeout=timeout):
                partition = None if reply.has_error() else _partition_id(reply.content)
                if partition is not None:  # else the node counts as not answering
                    mapping[reply.metadata.src_node_id] = partition
        if sorted(mapping.values()) != list(range(population)):
            raise RuntimeError(_population_mismatch(
                population, f"the {len(mapping)} nodes that answered hold {len(set(mapping.values()))} "
                f"distinct partition ids of 0..{population - 1}"))
        self.slot_of_node = mapping

    # --- training round ------------------------------------------------------
    def begin_round(self, server_round: int, arrays: ArrayRecord) -> dict[int, int]:
        """Sample this round's cohort (node id -> slot) and start its record."""
        slots, node_of_slot = self._slots, self._node_of_slot
        self._round_randomness = self.randomness.for_round(server_round)
        chosen = sample_cohort(slots, self.sampling, self.sampling_rate, self._round_randomness.sampling)
        self._global = arrays
        self._cohort = {node_of_slot[slot]: slot for slot in chosen}
        # ε so far until the round releases: a round that releases nothing (an empty cohort) keeps the ledger's ε
        self.current = RoundRecord(round=server_round, clients_sampled=len(chosen), epsilon=self.accountant.epsilon())
        self.client_metrics = []
        self.rejection_reasons = {}
        self._rejections_logged = set()
        return dict(self._cohort)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample this round's cohort and send it the global model."""
        return train_messages(self._train_request(server_round, arrays, config, timeout=math.inf))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Read the replies into client results (:class:`~fedhog.replies.ReplyReader`), then :meth:`finish_replies`."""
        return self.finish_replies(server_round, self._reader().read(replies))

    def _train_request(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                       timeout: float) -> TrainRequest:
        """Sample this round's cohort (:meth:`begin_round`) and say what it is to train."""
        cohort = self.begin_round(server_round, arrays)
        config[protocol.SERVER_ROUND] = server_round
        return TrainRequest(server_round, arrays, config, cohort, self.mechanism.wants_term, timeout)

    def _reader(self) -> ReplyReader:
        return ReplyReader(self.global_model, self._cohort, self.mechanism.wants_term)

    def finish_replies(
        self, server_round: int, replies: CohortReplies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Count the replies refused on arrival and the bytes received, then :meth:`finish_round`."""
        self.round_record.bytes_received += replies.bytes_received
        for sender, error in replies.refused:
            self._count_rejection(server_round, sender, error)
        return self.finish_round(server_round, replies.results)

    def finish_round(
        self, server_round: int, results: Iterable[ClientResult]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate the cohort's results, run the mechanism, apply the update, compose the event.

        Every engine ends a trusted-server round here, with the results its
        :class:`~fedhog.replies.CohortRunner` delivered.
        """
        record = self.round_record
        results = list(results)
        contributions: list[tuple[int, Contribution, Mapping[str, MetricValue]]] = []
        for result, verdict in zip(results, self._validate(results), strict=True):
            if isinstance(verdict, BadReply):
                self._count_rejection(server_round, f"slot {result.slot}", verdict)
            else:
                contributions.append((result.slot, verdict, result.metrics))
        contributions.sort(key=lambda item: item[0])  # slot order, as the sum is exact whatever the order
        record.clients_accepted = len(contributions)
        if record.clients_sampled and not contributions and self.mechanism.clips:
            self._note_empty_round(server_round)

        flat_global = flatten_record(self.global_model)
        randomness = self._take_round_streams()
        expected_cohort = expected_cohort_size(len(self.slot_of_node), self.sampling_rate)
        mechanism = self._round_mechanism()
        # One ξ per slot of the population: a client's ξ does not depend on who else replied.
        xis = mechanism.xis(randomness.mixing, len(self.slot_of_node), [slot for slot, _, _ in contributions])
        averaged, stats = mechanism.aggregate([c for _, c, _ in contributions], expected_cohort, xis,
                                              randomness.noise, flat_global.numel(), flat_global.dtype)
        if not contributions and not mechanism.clips:  # a mean of nothing: FedAvg releases nothing
            return None, None
        return self._release(server_round, flat_global, averaged, stats, mechanism, randomness,
                             [metrics for _, _, metrics in contributions])

    def _round_mechanism(self) -> Mechanism:
        """The mechanism of this round: with adaptive clipping, its current C and the update's σ."""
        if self.adaptive_clipping is None:
            return self.mechanism
        return self.mechanism.with_clipping(self.adaptive_clipping.clipping_norm,
                                            self.adaptive_clipping.update_noise_multiplier)

    def reduction_plan(self) -> ReductionPlan:
        """What a :class:`~fedhog.replies.ReducingRunner` needs for this round's cohort (after :meth:`begin_round`)."""
        if len(self._cohort) > MAX_CONTRIBUTIONS:  # the shards' int64 sums must not overflow either
            raise ValueError(f"{len(self._cohort)} contributions exceed the {MAX_CONTRIBUTIONS} the int64 sum holds")
        mechanism = self._round_mechanism()
        slots = list(self._cohort.values())  # ξ drawn before training: the mixing stream is the round's own
        xis = mechanism.xis(self._round_streams().mixing, len(self.slot_of_node), slots)
        dimension = sum(int(np.prod(a.shape)) for a in self.global_model.values())
        return ReductionPlan(self.reply_check, mechanism, dict(zip(slots, map(float, xis), strict=True)), dimension)

    def finish_reduced(self, server_round: int, reduced: ReducedCohort,
                       plan: ReductionPlan) -> tuple[ArrayRecord, MetricRecord]:
        """End a round whose cohort a runner reduced to one lattice sum: count, noise the sum once, release.

        The same release as :meth:`finish_round` on the same results: the same checks, the
        same exact sum, the same noise, statistics over the accepted contributions in slot order.
        """
        record = self.round_record
        record.bytes_received += reduced.bytes_received
        for slot, error in sorted(reduced.refused, key=lambda item: item[0]):
            self._count_rejection(server_round, f"slot {slot}", error)
        accepted = sorted(reduced.accepted, key=lambda c: c.slot)
        record.clients_accepted = len(accepted)
        if record.clients_sampled and not accepted:
            self._note_empty_round(server_round)
        flat_global = flatten_record(self.global_model)
        randomness = self._take_round_streams()
        expected_cohort = expected_cohort_size(len(self.slot_of_node), self.sampling_rate)
        noisy_sum, sum_std = plan.mechanism.add_noise(reduced.lattice_sum, plan.lattice, randomness.noise,
                                                      len(accepted))
        norms = [c.norm_before_clip for c in accepted]
        ratios = [c.mixing_ratio for c in accepted if not math.isnan(c.mixing_ratio)]
        stats = AggregateStats(len(accepted), _mean(norms), _mean([float(c.clipped) for c in accepted]),
                               sum_std / expected_cohort, _mean(ratios), tuple(norms))
        averaged = (noisy_sum / expected_cohort).to(flat_global.dtype)
        return self._release(server_round, flat_global, averaged, stats, plan.mechanism, randomness,
                             [c.metrics for c in accepted])

    def _release(self, server_round: int, flat_global: torch.Tensor, averaged: torch.Tensor,
                 stats: AggregateStats, mechanism: Mechanism, randomness: RoundRandomness,
                 client_metrics: list[Mapping[str, MetricValue]]) -> tuple[ArrayRecord, MetricRecord]:
        """Adaptive clipping's step, the accountant's event, the server step, and the round's record."""
        record = self.round_record
        expected_cohort = expected_cohort_size(len(self.slot_of_node), self.sampling_rate)
        record.clipping_norm = mechanism.clipping_norm
        if self.adaptive_clipping is not None:
            step = self.adaptive_clipping.step(list(stats.norms_before_clip), expected_cohort, randomness.noise)
            record.noisy_unclipped_fraction = step.noisy_unclipped_fraction
        self.accountant.compose_round()  # σ covers the update and, with adaptive clipping, the count
        new_flat = self._server_step(flat_global, averaged, server_round, record)
        record.epsilon = self.accountant.epsilon()
        record.mean_norm_before_clip = stats.mean_norm_before_clip
        record.fraction_clipped = stats.fraction_clipped
        record.noise_std = stats.noise_std
        record.mean_mixing_ratio = stats.mean_mixing_ratio
        self.client_metrics = [dict(m) for m in client_metrics]
        losses = [v for v in _numbers(client_metrics, protocol.TRAIN_LOSS) if v >= 0]  # optional, informational
        record.train_loss = float(np.mean(losses)) if losses else math.nan
        record_epsilons = _numbers(client_metrics, protocol.DPSGD_EPSILON)
        record.sample_level_epsilon_max = max(record_epsilons) if record_epsilons else math.nan
        seconds = _numbers(client_metrics, protocol.THIRD_ORDER_SECONDS)
        record.third_order_seconds_max = max(seconds) if seconds else math.nan
        return unflatten_like(new_flat, self.global_model), MetricRecord(
            {"epsilon": record.epsilon, "clients-accepted": record.clients_accepted,
             "clients-rejected": record.clients_rejected}
        )

    def _note_empty_round(self, server_round: int) -> None:
        """Mark a round in which clients were sampled and none of their replies was accepted (``failure``).

        The round still releases the noise alone, and is accounted. Withholding
        it instead would not be differentially private: whether any reply is
        accepted depends on the replies, so in a federation whose other
        clients are all rejected, a withheld round (the model exactly
        unchanged) against a released one (the model moved by noise) would
        tell with certainty whether one well-behaved client was sampled — a
        privacy loss no ε covers, with probability q a round. The noise-only
        release is the mechanism's ordinary output on a sum of nothing, so the
        accountant's bound holds. A federation in this state is broken: the
        ServerApp stops the run after :data:`MAX_EMPTY_IN_A_ROW` such rounds in
        a row, quoting the rejection reasons (that stop, like the one when
        every sampled client raised, is an operational decision the accountant
        does not cover: it discloses that the federation failed).
        """
        record = self.round_record
        rejected = ", ".join(f"{kind} ×{count}" for kind, count in sorted(record.rejections.items()))
        record.failure = (f"no accepted contribution ({record.clients_sampled} sampled, "
                          + (f"rejected: {rejected}" if rejected else "no reply arrived")
                          + "): the noise alone was released")
        log(WARNING, "round %d: %s", server_round, record.failure)

    def secure_round(self, grid: Grid, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                     timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """A SecAgg+ round: sample, let the cohort mask its clipped contributions, unmask the sum, noise it.

        The strategy never holds a single client's contribution: only masked
        vectors (uniform mod M), then their sum. A round that cannot be
        unmasked releases nothing and spends no ε; ``failure`` says why.
        """
        settings = self.secure_aggregation
        if settings is None:
            raise RuntimeError("secure_round needs the strategy's secure_aggregation settings")
        cohort = self.begin_round(server_round, arrays)
        config[protocol.SERVER_ROUND] = server_round
        record = self.round_record
        dimension = sum(int(np.prod(a.shape)) for a in arrays.values())
        watch = _WeightsWatch(grid)
        try:
            result = secure_sum(watch, sorted(cohort), RecordDict({"arrays": arrays, "config": config}), dimension,
                                settings, timeout, group_id=str(server_round))
        except SecureAggregationFailed as error:
            for sender, reason in watch.reasons(error.dropped).items():
                self._count_rejection(server_round, sender, reason)
            self._round_randomness = None
            record.failure = f"secure aggregation failed: {error}"
            every_client_raised = all(r.kind is Rejection.CLIENT_ERROR for r in error.dropped.values())
            if str(error).startswith("setup:") and every_client_raised:
                record.failure += f" ({SECURE_NEEDS_FEDHOG_CLIENTS})"
            record.epsilon = self.accountant.epsilon()
            log(WARNING, "round %d released nothing: %s", server_round, record.failure)
            return None, MetricRecord({"epsilon": record.epsilon, "clients-accepted": 0})
        result.dropped = watch.reasons(result.dropped)
        return self.finish_secure_round(server_round, result)

    def finish_secure_round(self, server_round: int, result: SecureSum) -> tuple[ArrayRecord, MetricRecord]:
        """The mechanism noises the unmasked sum on its lattice, divide by K, apply the update, compose the event.

        With distributed noise the unmasked sum carries its contributors' noise
        and the mechanism releases it as it is: g·S/K.
        """
        record = self.round_record
        for sender, reason in result.dropped.items():
            self._count_rejection(server_round, sender, reason)
        record.bytes_received += result.bytes_received
        record.clients_accepted = result.contributors
        record.clipping_norm = self.mechanism.clipping_norm
        flat_global = flatten_record(self.global_model)
        randomness = self._take_round_streams()
        noisy_sum, sum_std = self.mechanism.add_noise(result.levels, result.lattice.noise_lattice(flat_global.numel()),
                                                      randomness.noise, result.contributors)
        expected_cohort = expected_cohort_size(len(self.slot_of_node), self.sampling_rate)
        self.accountant.compose_round()
        new_flat = self._server_step(flat_global, (noisy_sum / expected_cohort).to(flat_global.dtype), server_round,
                                     record)
        record.epsilon = self.accountant.epsilon()
        record.noise_std = sum_std / expected_cohort
        return unflatten_like(new_flat, self.global_model), MetricRecord(
            {"epsilon": record.epsilon, "clients-accepted": record.clients_accepted,
             "clients-rejected": record.clients_rejected})

    def _server_step(self, flat_global: torch.Tensor, release: torch.Tensor, server_round: int,
                     record: RoundRecord) -> torch.Tensor:
        """The new global model from the release: the server optimizer's step, scaled by ``step_length`` if set."""
        new_flat = self.server_optimizer.step(flat_global, release, server_round)
        if self.step_length is not None:  # post-processing: the release and the server's own proxy data
            proposed = new_flat - flat_global
            record.server_step_scale = self.step_length(flat_global, proposed).step
            new_flat = flat_global + record.server_step_scale * proposed
        return new_flat

    def _count_rejection(self, server_round: int, sender: str, error: BadReply) -> None:
        record = self.round_record
        kind = error.kind.value  # a plain str: records are written to metrics.json and checkpoints
        record.clients_rejected += 1
        record.rejections[kind] = record.rejections.get(kind, 0) + 1
        self.rejection_reasons.setdefault(kind, str(error))
        record.third_order_failures += error.kind is Rejection.NON_FINITE_THIRD_ORDER_TERM
        reason = f"{error.kind}: {client_error_summary(error.detail)}"  # one line: no client's traceback or paths
        if reason not in self._rejections_logged:  # the same reason from other clients: counted, not repeated
            self._rejections_logged.add(reason)
            log(WARNING, "round %d: rejected the result of %s: %s", server_round, sender, reason)

    def read_contribution(self, reply: Message) -> Contribution:
        """Turn a reply into a flat contribution, or raise :class:`BadReply` (for a sampled node)."""
        verdict = self._validate([self._reader().read_one(reply, set())])[0]
        if isinstance(verdict, BadReply):
            raise verdict
        return verdict

    def _validate(self, results: list[ClientResult]) -> list[Contribution | BadReply]:
        """Each well-formed result's contribution, or why it is refused (:class:`~fedhog.replies.ReplyCheck`)."""
        return self.reply_check.verdicts(results)

    @property
    def reply_check(self) -> ReplyCheck:
        """The check every result passes before it contributes, here or where a runner reduces the cohort."""
        return ReplyCheck(self.mechanism.wants_term, self.max_update_norm, self.equal_weights)

    # --- no federated evaluation: the server evaluates centrally -------------
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation is off: the ServerApp evaluates on a central test set."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see :meth:`configure_evaluate`)."""
        return None

    # --- the loop -------------------------------------------------------------
    def start(  # pylint: disable=too-many-arguments
        self,
        grid: Grid | None,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        on_round: Callable[[RoundRecord, ArrayRecord], None] | None = None,
        first_round: int = 1,
        runner: CohortRunner | None = None,
    ) -> Result:
        """Run rounds ``first_round``..``num_rounds``; stop before a release beyond ``max_epsilon``.

        Unlike :meth:`Strategy.start`, every finished round is handed to
        ``on_round`` (which writes results and checkpoints, then logs the round), so a crash loses
        nothing done, and a resumed run starts at ``first_round``. The initial
        model is not evaluated here (the ServerApp does that before round 1).
        Each trusted-server round's client results come from ``runner``
        (default: a :class:`~fedhog.replies.MessageRunner` over ``grid``);
        secure-aggregation rounds are messages through ``grid``. ``grid`` may
        be None for a trusted server whose ``runner`` needs none.
        """
        log(INFO, "Starting SecureAggregator for rounds %d..%d", first_round, num_rounds)
        self.summary()
        dimension = sum(int(np.prod(a.shape)) for a in initial_arrays.values())
        if warning := self.small_federation_warning(dimension):
            log(WARNING, "%s", warning)
        self.cover_sampler(dimension)
        self.accountant.plan(num_rounds)  # each round's ε, composed ahead in the background
        slack = self.accountant.sampler_slack(num_rounds)
        if slack is not None and slack.delta > MAX_TAIL_DELTA_SHARE * self.accountant.delta:
            raise ValueError(
                f"noise multiplier {self.accountant.noise_multiplier:g} is too small for the noise "
                f"sampler's analysis (values within 20 standard deviations): it adds up to {slack.delta:.3g} to "
                f"δ={self.accountant.delta:g} over {num_rounds} rounds; raise the noise multiplier")
        runner = runner if runner is not None else MessageRunner(_needed(grid, "a round without a runner"))
        result = Result()
        arrays = initial_arrays
        handed_over = time.perf_counter()  # when the last round's record was complete: where this round's time starts
        for server_round in range(first_round, num_rounds + 1):
            if self.accountant.would_exceed(self.max_epsilon):
                log(WARNING, "Stopping before round %d: its release would take ε past max-epsilon=%g "
                    "(ε so far %.4g)", server_round, self.max_epsilon, self.accountant.epsilon())
                break
            config = ConfigRecord(dict(train_config or {}))
            if self.secure_aggregation is not None:  # message by message through the Grid, on every engine
                new_arrays, train_metrics = self.secure_round(_needed(grid, "secure aggregation"), server_round,
                                                              arrays, config, timeout)
            else:
                request = self._train_request(server_round, arrays, config, timeout)
                if isinstance(runner, ReducingRunner) and self.mechanism.clips:  # reduced where trained
                    plan = self.reduction_plan()
                    new_arrays, train_metrics = self.finish_reduced(server_round, runner.reduce(request, plan), plan)
                else:
                    new_arrays, train_metrics = self.finish_replies(server_round, runner.train(request))
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[server_round] = train_metrics
            record = self.round_record
            if evaluate_fn and (metrics := evaluate_fn(server_round, arrays)) is not None:
                result.evaluate_metrics_serverapp[server_round] = metrics
                record.take_evaluation(metrics)
            # everything since the last round's record: that round's diagnostics, checkpoint and writes included
            record.seconds = (now := time.perf_counter()) - handed_over
            handed_over = now
            if on_round:
                on_round(record, arrays)  # which logs the round (log_round) once its checkpoint is written
            else:
                log_round(record)
        result.arrays = arrays
        return result


def log_round(record: RoundRecord) -> None:
    """The round's line in the log: accuracy, ε and the clients."""
    log(INFO, "round %d: accuracy %.4f, ε %.4g, clients %d sampled / %d accepted / %d rejected",
        record.round, record.accuracy, record.epsilon, record.clients_sampled, record.clients_accepted,
        record.clients_rejected)


WEIGHTS_UNDER_SECURE_AGGREGATION = (  # the detail of a Rejection.WEIGHTS_REFUSED
    "the reply carries the client's model under 'arrays' (a standard Flower ClientApp), which "
    "the server must never see under secure aggregation; each client must clip, quantise and mask its own update: "
    "run fedhog's ClientApp, or turn secure-aggregation off")


SECURE_NEEDS_FEDHOG_CLIENTS = (
    "every client failed at the protocol's first stage: under secure aggregation each client must run fedhog's "
    "ClientApp, which clips, quantises and masks its own update (a standard Flower ClientApp, which replies with its "
    "weights, cannot take part)")


class _WeightsWatch:
    """The Grid of a secure round, noting which nodes replied with their weights (a standard Flower ClientApp).

    Such a reply would hand the server that client's own model, which secure
    aggregation exists to hide; the protocol drops the node (its reply is not
    a stage reply), and the strategy gives :data:`WEIGHTS_UNDER_SECURE_AGGREGATION`
    as the reason.
    """

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self.senders: set[str] = set()  # "node <id>", as the protocol names dropped nodes

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """The grid's replies, unchanged; the senders of weights noted."""
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self.senders |= {f"node {r.metadata.src_node_id}" for r in replies
                         if not r.has_error() and protocol.WEIGHTS in r.content.array_records}
        return replies

    def reasons(self, dropped: Mapping[str, BadReply]) -> dict[str, BadReply]:
        """``dropped`` with the reason of every node that sent weights replaced by the clear one."""
        return {sender: BadReply(Rejection.WEIGHTS_REFUSED, WEIGHTS_UNDER_SECURE_AGGREGATION)
                if sender in self.senders else reason for sender, reason in dropped.items()}


def _needed(grid: Grid | None, what: str) -> Grid:
    """``grid``, which ``what`` sends its messages through (ValueError if there is none)."""
    if grid is None:
        raise ValueError(f"{what} needs a grid: its messages go through one")
    return grid


def _partition_id(content: RecordDict) -> int | None:
    """The partition id a node's query reply states, None if it states no integer one."""
    metrics = content.metric_records.get(protocol.METRICS)
    value = None if metrics is None else metrics.get(protocol.PARTITION_ID)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _population_mismatch(population: int, found: str) -> str:
    return (f"population={population} but {found}; start one SuperNode per client, each with its own "
            "partition-id (simulation: --federation-config num-supernodes=<population>)")


def _numbers(client_metrics: Iterable[Mapping[str, MetricValue]], key: str) -> list[int | float]:
    """The values of metric ``key``, of the clients that sent it (a number: :class:`~fedhog.replies.ReplyCheck`
    refuses a reply where it is not)."""
    return [value for m in client_metrics if protocol.is_number(value := m.get(key))]


def _mean(values: list[float]) -> float:
    """The mean in the order given (that of :func:`~fedhog.privacy.mechanism.aggregate`'s statistics), NaN if none."""
    return sum(values) / len(values) if values else math.nan
