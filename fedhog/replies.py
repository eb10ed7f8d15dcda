"""How a round's cohort answers the strategy: typed client results, whichever engine computed them.

Each trusted-server round the strategy hands a :class:`CohortRunner` a
:class:`TrainRequest` (the model, the cohort) and gets back
:class:`CohortReplies`: every sampled client's
:class:`~fedhog.protocol.ClientResult` and the replies refused before they
became one (each a :class:`~fedhog.protocol.BadReply`). :class:`MessageRunner`
serves any Flower Grid: one train message per node, every reply read and
checked by :class:`ReplyReader`. An engine that computes the cohort another
way offers its own runner as its Grid's ``cohort_runner`` (the vectorized
engine does); :func:`runner_for` takes it. Secure-aggregation rounds do not
come here: their stages are messages through the Grid on every engine. What
fedhog's ClientApp replies (:func:`train_reply`) is written here too, next to
what reads it.

A runner that can also do the mechanism's per-contribution half where the
clients' results are (a :class:`ReducingRunner`: the vectorized engine's
shards) is handed a :class:`ReductionPlan` and returns a
:class:`ReducedCohort`: the results checked by :class:`ReplyCheck` (the
strategy's own check), mixed, clipped and summed on the noise lattice by
:func:`reduce_results`; the strategy adds the noise once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from . import protocol
from .layout import flatten_record
from .monitoring import reply_nbytes
from .privacy.lattice import NoiseLattice
from .privacy.mechanism import Contribution, Mechanism, norms_of
from .protocol import BadReply, ClientResult, Rejection


@dataclass(frozen=True)
class TrainRequest:
    """One round's train instruction to its cohort."""

    server_round: int
    arrays: ArrayRecord  # the global model
    config: ConfigRecord  # the train instruction's config (its SERVER_ROUND set)
    cohort: Mapping[int, int]  # node id -> slot
    wants_term: bool  # mechanism = "hog": each client also sends its third-order term
    timeout: float


@dataclass
class CohortReplies:
    """What the cohort delivered: results to validate, replies refused on arrival, bytes of the arrays received."""

    results: list[ClientResult] = field(default_factory=list)
    refused: list[tuple[str, BadReply]] = field(default_factory=list)  # sender ("node <id>"), why
    bytes_received: int = 0


class CohortRunner(Protocol):
    """Whatever computes a round's client results for the strategy."""

    def train(self, request: TrainRequest) -> CohortReplies:
        """Every node of ``request.cohort``'s answer to this round's train instruction."""


def train_reply(msg: Message, work: protocol.LocalWork) -> Message:
    """fedhog's ClientApp's reply to a train message: Δ, t (when computed and finite) and the metrics, as
    :class:`ReplyReader` reads them."""
    records = RecordDict({protocol.UPDATE: ArrayRecord(to_cpu(work.update))})
    if work.term is not None:
        records[protocol.TERM] = ArrayRecord(to_cpu(term_keyed_like(work.term, work.update)))
    records[protocol.METRICS] = metric_record(work.metrics)
    return Message(records, reply_to=msg)


def metric_record(values: Mapping[str, int | float]) -> MetricRecord:
    """Numbers as a MetricRecord (whose constructor wants a dict of all its value types, lists too)."""
    record = MetricRecord()
    record.update(values)
    return record


def term_keyed_like(term: dict[str, torch.Tensor], update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The term (keyed by parameter) keyed like the update (the whole ``state_dict``, in its order).

    Buffers (BatchNorm's running statistics, say) have no derivative: their entries are 0.
    """
    return {key: term[key] if key in term else torch.zeros_like(value) for key, value in update.items()}


def to_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies, as a reply's arrays travel."""
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


@dataclass(frozen=True)
class ReplyCheck:
    """Whether a client result may contribute: the strategy's validation, wherever the results are.

    Parameters
    ----------
    wants_term : bool
        The mechanism mixes third-order terms: each result's term is checked too.
    max_update_norm : float
        Updates longer than this are refused as implausible.
    equal_weights : bool
        Results carry no record counts (DP-SGD clients); otherwise ``num-examples`` must be an integer ≥ 0.
    """

    wants_term: bool
    max_update_norm: float = math.inf
    equal_weights: bool = False

    def verdicts(self, results: Sequence[ClientResult]) -> list[Contribution | BadReply]:
        """Each well-formed result's contribution, or why it is refused.

        Norms are float64 and scaled (float32 entries near 1e19 do not make them inf), computed for the
        whole cohort in a few batched passes (:func:`~fedhog.privacy.mechanism.norms_of`).
        """
        update_norms, updates_finite = norms_of([r.update for r in results])
        with_terms = [(r, r.term) for r in results if self.wants_term and r.term is not None]
        term_norms, terms_finite = norms_of([term for _, term in with_terms])
        term_check = {id(r): (n, f) for (r, _), n, f in zip(with_terms, term_norms, terms_finite, strict=True)}
        verdicts: list[Contribution | BadReply] = []
        for result, norm, finite in zip(results, update_norms, updates_finite, strict=True):
            try:
                verdicts.append(self._accept(result, norm, finite, term_check.get(id(result))))
            except BadReply as error:
                verdicts.append(error)
        return verdicts

    def _accept(self, result: ClientResult, norm: float, finite: bool,
                term_check: tuple[float, bool] | None) -> Contribution:
        metrics = result.metrics
        weight = 1
        if not self.equal_weights:
            count = metrics.get(protocol.NUM_EXAMPLES)
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise BadReply(Rejection.MALFORMED, f"num-examples={count!r}")
            weight = count
        for key in protocol.NUMBER_METRICS:
            if key in metrics and not protocol.is_number(metrics[key]):
                raise BadReply(Rejection.MALFORMED, f"{key}={metrics[key]!r} is not a number")
        if not finite:
            raise BadReply(Rejection.NON_FINITE_VALUES, f"'{protocol.UPDATE}' holds NaN or inf")
        if not norm <= self.max_update_norm:
            raise BadReply(Rejection.TOO_LARGE,
                           f"update norm {norm:.4g} exceeds max-update-norm={self.max_update_norm:g}"
                           if math.isfinite(norm) else f"update norm {norm} is not finite")
        if not self.wants_term:
            return Contribution(update=result.update, weight=weight)
        if metrics.get(protocol.THIRD_ORDER_FINITE, 1) == 0:
            raise BadReply(Rejection.NON_FINITE_THIRD_ORDER_TERM, "the client reported a failed computation")
        if result.term is None or term_check is None:
            raise BadReply(Rejection.MALFORMED, f"no ArrayRecord '{protocol.TERM}'")
        term_norm, term_finite = term_check
        if not term_finite:
            raise BadReply(Rejection.NON_FINITE_VALUES, f"'{protocol.TERM}' holds NaN or inf")
        if not math.isfinite(term_norm):
            raise BadReply(Rejection.NON_FINITE_THIRD_ORDER_TERM, "its norm is not finite in float64")
        return Contribution(update=result.update, weight=weight, term=result.term)


@dataclass(frozen=True)
class ReductionPlan:
    """What a :class:`ReducingRunner` needs to reduce a round's results: how to check, mix and clip them.

    ``mechanism`` is the round's (adaptive clipping's current C in it);
    ``xis`` maps every cohort slot to its ξ, drawn by the server; ``dimension``
    is d, the flat model's length (the lattice's).
    """

    check: ReplyCheck
    mechanism: Mechanism
    xis: Mapping[int, float]
    dimension: int

    @property
    def lattice(self) -> NoiseLattice:
        """The lattice the contributions are rounded onto and the noise lives on."""
        return NoiseLattice.for_settings(self.mechanism, self.dimension)


@dataclass(frozen=True)
class ReducedContribution:
    """What the server keeps of one accepted result: its slot, its metrics and what clipping saw (private)."""

    slot: int
    norm_before_clip: float  # ‖u_i‖ before clipping: private, for adaptive clipping and the round's mean only
    clipped: bool
    mixing_ratio: float  # NaN: not mixed
    metrics: Mapping[str, protocol.MetricValue]


@dataclass
class ReducedCohort:
    """Part or all of a cohort reduced: the int64 sum of its clipped contributions on the lattice, and the rest.

    The sum is exact, so reductions of any split of a cohort add up (:meth:`add`) to the whole cohort's.
    """

    lattice_sum: torch.Tensor  # S = Σ round(c_i / g), int64 [d]
    accepted: list[ReducedContribution] = field(default_factory=list)
    refused: list[tuple[int, BadReply]] = field(default_factory=list)  # slot, why
    bytes_received: int = 0

    def add(self, other: ReducedCohort) -> ReducedCohort:
        """This reduction and ``other``, of disjoint parts of one cohort, as one."""
        return ReducedCohort(self.lattice_sum + other.lattice_sum, self.accepted + other.accepted,
                             self.refused + other.refused, self.bytes_received + other.bytes_received)


def reduce_results(results: Sequence[ClientResult], plan: ReductionPlan, bytes_received: int = 0) -> ReducedCohort:
    """Check every result (:class:`ReplyCheck`), mix and clip the accepted ones, sum them on the lattice.

    The per-contribution half of :meth:`~fedhog.privacy.mechanism.Mechanism.aggregate`: the same
    :meth:`~fedhog.privacy.mechanism.Mechanism.sum_on_lattice`.
    """
    out = ReducedCohort(torch.zeros(plan.dimension, dtype=torch.int64), bytes_received=bytes_received)
    accepted: list[tuple[ClientResult, Contribution]] = []
    for result, verdict in zip(results, plan.check.verdicts(results), strict=True):
        if isinstance(verdict, BadReply):
            out.refused.append((result.slot, verdict))
        else:
            accepted.append((result, verdict))
    total, seen = plan.mechanism.sum_on_lattice([c for _, c in accepted], [plan.xis[r.slot] for r, _ in accepted],
                                                plan.lattice)
    out.lattice_sum += total
    out.accepted += [ReducedContribution(r.slot, norm, clipped, ratio, dict(r.metrics)) for (r, _), norm, clipped, ratio
                     in zip(accepted, seen.norms_before_clip, seen.clipped, seen.mixing_ratios, strict=True)]
    return out


@runtime_checkable
class ReducingRunner(Protocol):
    """A :class:`CohortRunner` that can also check and reduce the cohort's results where they are."""

    def train(self, request: TrainRequest) -> CohortReplies:
        """Every node of ``request.cohort``'s answer to this round's train instruction."""

    def reduce(self, request: TrainRequest, plan: ReductionPlan) -> ReducedCohort:
        """The cohort trained and its results reduced by :func:`reduce_results` (in any split: the sum is exact)."""


def train_messages(request: TrainRequest) -> list[Message]:
    """One train message per node of the cohort: the global model and the config."""
    record = RecordDict({"arrays": request.arrays, "config": request.config})
    return [Message(record, dst_node_id=node, message_type=MessageType.TRAIN) for node in request.cohort]


def global_model_of(msg: Message) -> ArrayRecord:
    """A train instruction's global model (as :func:`train_messages` sends it)."""
    return msg.content.array_records["arrays"]


def server_round_of(msg: Message) -> int:
    """A train instruction's round number (ValueError if it holds no integer one)."""
    value = msg.content.config_records["config"][protocol.SERVER_ROUND]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{protocol.SERVER_ROUND}={value!r} is not allowed; expected an integer")
    return value


class MessageRunner:
    """The cohort's results through a Flower Grid: one train message per node, replies read by :class:`ReplyReader`."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def train(self, request: TrainRequest) -> CohortReplies:
        """Send the train messages, wait for the replies (up to ``request.timeout``), read them."""
        messages = train_messages(request)
        replies = self.grid.send_and_receive(messages, timeout=request.timeout)
        # every Grid stamps the ids on the messages it pushes: each reply must answer its node's instruction
        instructions = {m.metadata.dst_node_id: m.metadata.message_id for m in messages}
        return ReplyReader(request.arrays, request.cohort, request.wants_term, instructions).read(replies)


def runner_for(grid: Grid) -> CohortRunner:
    """The runner ``grid`` offers as its ``cohort_runner`` (the vectorized engine's), else a :class:`MessageRunner`."""
    offered = getattr(grid, "cohort_runner", None)
    return offered if offered is not None else MessageRunner(grid)


class ReplyReader:
    """Reads a round's train replies into client results, refusing what does not fit the round.

    A reply must come from a sampled node, once, without error, with a
    MetricRecord and an update (with ``wants_term`` also a third-order term)
    keyed, shaped and typed exactly like the global model; given
    ``instructions`` (node id -> the id of the round's train message to it),
    it must answer that message (a reply to another round's is refused). A
    reply in Flower's convention (weights under ``arrays``, no ``update``; see
    :mod:`fedhog.protocol`) is read as the update weights − global model.
    """

    def __init__(self, arrays: ArrayRecord, cohort: Mapping[int, int], wants_term: bool,
                 instructions: Mapping[int, str] | None = None) -> None:
        self.arrays = arrays
        self.cohort = cohort
        self.wants_term = wants_term
        self.instructions = instructions
        self._global_flat: torch.Tensor | None = None

    def read(self, replies: Iterable[Message]) -> CohortReplies:
        """Every reply as a result or a refusal, and the bytes of the arrays of those without error."""
        out = CohortReplies()
        seen: set[int] = set()
        for reply in replies:
            if not reply.has_error():
                out.bytes_received += reply_nbytes(reply.content)
            try:
                out.results.append(self.read_one(reply, seen))
            except BadReply as error:
                out.refused.append((f"node {reply.metadata.src_node_id}", error))
        return out

    def read_one(self, reply: Message, seen: set[int]) -> ClientResult:
        """The arrays and metrics of one reply from a sampled node not in ``seen`` (added), or :class:`BadReply`."""
        slot = self._check_sender(reply, seen)
        content = reply.content
        metrics = dict(_read_metrics(content))
        weights = protocol.UPDATE not in content.array_records and protocol.WEIGHTS in content.array_records
        if weights:  # clipped and noised as any update: the conversion is the reply's own, per client
            update = read_like(content, protocol.WEIGHTS, self.arrays) - self.global_flat()
        else:
            update = read_like(content, protocol.UPDATE, self.arrays)
        term = None
        if self.wants_term and metrics.get(protocol.THIRD_ORDER_FINITE, 1) != 0:
            if weights and protocol.TERM not in content.array_records:
                raise BadReply(Rejection.MALFORMED, f"mechanism='hog' needs the third-order term '{protocol.TERM}', "
                               "which a standard Flower ClientApp does not send (use mechanism='gaussian', or "
                               "fedhog's ClientApp)")
            term = read_like(content, protocol.TERM, self.arrays)
        return ClientResult(slot, update, term, metrics)

    def global_flat(self) -> torch.Tensor:
        """The round's global model, flat (computed once, for the replies that send weights)."""
        if self._global_flat is None:
            self._global_flat = flatten_record(self.arrays)
        return self._global_flat

    def _check_sender(self, reply: Message, seen: set[int]) -> int:
        node = reply.metadata.src_node_id
        if reply.has_error():
            raise BadReply(Rejection.CLIENT_ERROR, reply.error.reason or f"error code {reply.error.code}")
        if node not in self.cohort:
            raise BadReply(Rejection.NOT_SAMPLED, "the node was not in this round's cohort")
        if self.instructions is not None and reply.metadata.reply_to_message_id != self.instructions.get(node):
            raise BadReply(Rejection.WRONG_ROUND, "the reply answers another message than this round's "
                                                     "instruction to the node")
        if node in seen:
            raise BadReply(Rejection.DUPLICATE, "a second reply from the same node")
        seen.add(node)
        return self.cohort[node]


def _read_metrics(content: RecordDict) -> MetricRecord:
    """The reply's MetricRecord: ``metrics``, or the only one it holds, whatever its name."""
    records = content.metric_records
    if protocol.METRICS in records:
        return records[protocol.METRICS]
    if len(records) == 1:
        return next(iter(records.values()))
    raise BadReply(Rejection.MALFORMED, f"no MetricRecord '{protocol.METRICS}'")


def read_like(content: RecordDict, key: str, reference: ArrayRecord) -> torch.Tensor:
    """The ArrayRecord ``key`` flattened, if its keys, shapes and dtypes match ``reference`` exactly."""
    if key not in content.array_records:
        raise BadReply(Rejection.MALFORMED, f"no ArrayRecord '{key}'")
    record = content.array_records[key]
    if list(record.keys()) != list(reference.keys()):
        raise BadReply(Rejection.WRONG_KEYS, f"'{key}' has {list(record.keys())[:4]}...")
    for name in reference:
        got, want = record[name], reference[name]
        if tuple(got.shape) != tuple(want.shape):
            raise BadReply(Rejection.WRONG_SHAPE, f"'{key}/{name}' is {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype != want.dtype:
            raise BadReply(Rejection.WRONG_DTYPE, f"'{key}/{name}' is {got.dtype}, expected {want.dtype}")
    return flatten_record(record)
