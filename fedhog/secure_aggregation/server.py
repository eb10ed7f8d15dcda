"""The server's side of SecAgg+: drive Flower's four stages over a Grid and unmask only the sum.

The stages and their messages are those of Flower's ``SecAggPlusWorkflow``
(same config keys, so the client runs Flower's stage functions), driven
from fedhog's Message-API strategy instead of a legacy ``DefaultWorkflow``:

0. setup: every sampled node makes two key pairs and sends the public keys;
1. share keys: each node gets its neighbours' public keys and returns Shamir
   shares (threshold t of k) of its self-mask seed and its masking key,
   encrypted to each neighbour;
2. collect masked vectors: each node gets the global model and the shares
   meant for it, trains, and sends y_i = q_i + masks mod M;
3. unmask: survivors send, per neighbour, a share of its self-mask seed
   (if it sent y) or of its masking key (if it dropped after step 1).

With ≥ t shares of each secret the server removes the self masks of the
vectors it received and the pairwise masks the dropped nodes left in them:
what remains is Σ q_i mod M over the survivors (each q_i noised by its client
with distributed noise). Fewer shares, or fewer than two survivors (m with
distributed noise), end the round with :class:`SecureAggregationFailed` and
nothing is unmasked.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from .. import protocol
from ..monitoring import reply_nbytes
from ..protocol import BadReply, Rejection
from .distributed_noise import DistributedNoise
from .graph import share_count, threshold_count
from .masking import mask
from .quantization import ModularLattice

T = TypeVar("T")


class MessageExchange(Protocol):
    """What the stages need of a Grid (or of a wrapper around one): messages out, replies back."""

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send ``messages``; the replies that arrive within ``timeout``."""


class SecureAggregationFailed(RuntimeError):
    """A round whose sum cannot be unmasked (too few survivors or shares): nothing is released.

    ``dropped`` maps ``"node <id>"`` to why that node dropped out.
    """

    def __init__(self, reason: str, dropped: dict[str, BadReply] | None = None) -> None:
        super().__init__(reason)
        self.dropped = dict(dropped or {})


@dataclass(frozen=True)
class SecAggSettings:
    """How SecAgg+ runs.

    Parameters
    ----------
    num_shares : int
        k, the neighbours each node shares its secrets with (itself included);
        0 or ≥ the cohort: the whole cohort (the SecAgg of Bonawitz et al.).
    threshold : float
        t = max(2, ⌈threshold·k⌉) shares reconstruct a secret: the server and
        fewer than t of a node's neighbours learn nothing of its vector, and
        up to k − t of its neighbours may drop out.
    lattice : ModularLattice
        g and M = 2^b, fixed before the run from public config
        (:meth:`fedhog.config.RunConfig.secure_plan`), as every client computes them.
    clipping_norm : float
        C, which every client clips to before quantising.
    noise : DistributedNoise, optional
        With distributed noise, the plan: a sum of fewer than its m
        contributions is never unmasked.
    """

    num_shares: int
    threshold: float
    lattice: ModularLattice
    clipping_norm: float
    noise: DistributedNoise | None = None

    @property
    def min_contributors(self) -> int:
        """The fewest masked vectors whose sum the server unmasks: 2, or m with distributed noise."""
        return 2 if self.noise is None else self.noise.shares


@dataclass
class SecureSum:
    """What a SecAgg+ round gave the server: the sum of the survivors' integers, and who dropped out."""

    levels: torch.Tensor  # int64 [d], Σ q_i over ``contributors``
    lattice: ModularLattice
    contributors: int
    dropped: dict[str, BadReply] = field(default_factory=dict)  # "node <id>" -> why (a client error, or no reply)
    bytes_received: int = 0


@dataclass
class _Round:
    nodes: list[int]
    neighbours: dict[int, set[int]]
    threshold: int
    lattice: ModularLattice
    dropped: dict[str, BadReply] = field(default_factory=dict)
    bytes_received: int = 0


def secure_sum(grid: MessageExchange, nodes: list[int], train_content: RecordDict, dimension: int,
               settings: SecAggSettings, timeout: float, group_id: str) -> SecureSum:
    """Run the four stages with ``nodes``; ``train_content`` (global model, config) goes out with stage 2.

    Raises
    ------
    SecureAggregationFailed
        With the reason, when the sum cannot be unmasked.
    """
    n = len(nodes)
    if n < settings.min_contributors:
        raise SecureAggregationFailed(f"a cohort of {n} cannot be aggregated securely (SecAgg+ needs ≥ 2"
                                      + ("" if settings.noise is None else
                                         f", distributed noise m = {settings.min_contributors}") + ")")
    k = share_count(n, settings.num_shares)
    state = _Round(nodes=list(nodes), neighbours=_ring(nodes, k), threshold=threshold_count(k, settings.threshold),
                   lattice=settings.lattice)

    instruction = _instruction(train_content)

    def setup() -> RecordDict:
        return RecordDict({**instruction, RECORD_KEY_CONFIGS: ConfigRecord({
            Key.STAGE: Stage.SETUP, Key.SAMPLE_NUMBER: n, Key.SHARE_NUMBER: k, Key.THRESHOLD: state.threshold,
            Key.CLIPPING_RANGE: float(settings.clipping_norm), Key.TARGET_RANGE: state.lattice.max_level,
            Key.MOD_RANGE: state.lattice.modulus, Key.MAX_WEIGHT: 1.0})})

    public_keys = _exchange(grid, state, {node: setup() for node in nodes}, timeout, group_id, read=_public_keys)
    _check(state, set(public_keys), "setup")

    def share_keys(node: int) -> RecordDict:
        record = ConfigRecord({str(m): public_keys[m] for m in state.neighbours[node] if m in public_keys})
        record[Key.STAGE] = Stage.SHARE_KEYS
        return RecordDict({**instruction, RECORD_KEY_CONFIGS: record})

    ciphertexts = _exchange(grid, state, {node: share_keys(node) for node in public_keys}, timeout, group_id,
                            read=lambda reply: _pairs(reply, Key.DESTINATION_LIST, int, Key.CIPHERTEXT_LIST))
    shared = set(ciphertexts)
    _check(state, shared, "share-keys")
    forwarded: dict[int, tuple[list[int], list[bytes]]] = {node: ([], []) for node in shared}
    for source, pairs in ciphertexts.items():
        for destination, ciphertext in pairs:
            if destination in forwarded and destination in state.neighbours[source]:
                forwarded[destination][0].append(source)
                forwarded[destination][1].append(ciphertext)

    def collect(node: int) -> RecordDict:
        content = RecordDict(dict(train_content))
        content[RECORD_KEY_CONFIGS] = ConfigRecord({Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                                                    Key.SOURCE_LIST: forwarded[node][0],
                                                    Key.CIPHERTEXT_LIST: forwarded[node][1]})
        return content

    vectors = _exchange(grid, state, {node: collect(node) for node in shared}, timeout, group_id,
                        read=lambda reply: _masked_vector(reply, state.lattice, dimension))
    active = set(vectors)
    dead = shared - active
    _check(state, active, "collect-masked-vectors", owners=shared)
    if len(active) < settings.min_contributors:
        raise SecureAggregationFailed(
            f"collect-masked-vectors: {len(active)} masked vectors arrived, the accountant counts the noise of "
            f"m = {settings.min_contributors} clients ({len(state.dropped)} of {n} nodes dropped out); "
            "nothing was unmasked", state.dropped)
    total = np.zeros(dimension, dtype=np.uint64)
    for vector in vectors.values():
        total += vector  # wraps mod 2^64, a multiple of M

    def unmask(node: int) -> RecordDict:
        return RecordDict({**instruction, RECORD_KEY_CONFIGS: ConfigRecord({
            Key.STAGE: Stage.UNMASK,
            Key.ACTIVE_NODE_ID_LIST: sorted(state.neighbours[node] & active),
            Key.DEAD_NODE_ID_LIST: sorted(state.neighbours[node] & dead)})})

    unmasked = _exchange(grid, state, {node: unmask(node) for node in active}, timeout, group_id,
                         read=lambda reply: _pairs(reply, Key.NODE_ID_LIST, int, Key.SHARE_LIST))
    shares: dict[int, list[bytes]] = {node: [] for node in shared}
    for pairs in unmasked.values():
        for owner, share in pairs:
            if owner in shares:
                shares[owner].append(share)
    bits = state.lattice.modulus_bits
    for owner in sorted(shared):
        if len(shares[owner]) < state.threshold:
            raise SecureAggregationFailed(
                f"unmask: {len(shares[owner])} shares of node {owner}'s secret arrived, {state.threshold} are "
                f"needed ({len(state.dropped)} of {n} nodes dropped out); nothing was unmasked", state.dropped)
        secret = combine_shares(shares[owner][:state.threshold])  # any t shares determine it
        if owner in active:  # its self mask
            total -= mask(secret, dimension, bits)
            continue
        key = bytes_to_private_key(secret)  # a dropped node's masking key: remove its pairwise masks
        for other in sorted(state.neighbours[owner] & active):
            pairwise = mask(generate_shared_key(key, bytes_to_public_key(public_keys[other][0])), dimension, bits)
            total = total + pairwise if owner > other else total - pairwise  # undo ±, as ``other`` applied it
    return SecureSum(state.lattice.decode_sum(total), state.lattice, len(active), state.dropped,
                     state.bytes_received)


def small_cohort_delta(sampling: str, sampling_rate: float, population: int, rounds: int) -> float:
    """What rounds that cannot run SecAgg+ (a cohort below 2) add to δ over ``rounds`` rounds.

    Such a round releases nothing, and whether it happens depends on who was
    sampled. Under Poisson sampling the event has probability at most
    P[Bin(N − 1, q) ≤ 1] with or without any one client, so the run is
    (ε, δ + rounds · that), ε and δ as accounted for the releases. A fixed
    cohort of K ≥ 2 never falls below 2 by sampling: 0.
    """
    if sampling != "poisson":
        return 0.0
    from scipy.stats import binom

    return min(1.0, rounds * float(binom.cdf(1, population - 1, sampling_rate)))


def _instruction(train_content: RecordDict) -> dict[str, ConfigRecord]:
    """The train instruction's config (its round), which every stage carries: each client's ledger admits a setup
    for a round it has not served, and holds the later stages to that round."""
    config = train_content.config_records.get("config")
    return {} if config is None else {"config": config}


def _ring(nodes: list[int], k: int) -> dict[int, set[int]]:
    """Each node's k neighbours (itself included) on a ring in a random order, as Flower's workflow builds it."""
    order = list(nodes)
    secrets.SystemRandom().shuffle(order)
    half = k // 2
    if k >= len(order):
        return {node: set(order) for node in order}
    return {node: {order[(i + offset) % len(order)] for offset in range(-half, half + 1)}
            for i, node in enumerate(order)}


def _exchange(grid: MessageExchange, state: _Round, contents: dict[int, RecordDict], timeout: float, group_id: str,
              read: Callable[[Message], T]) -> dict[int, T]:
    """Send each node its content; return node -> ``read(reply)``, noting dropouts (a reply ``read`` refuses with
    KeyError, TypeError or ValueError is malformed: its node is dropped)."""
    messages = [Message(content, dst_node_id=node, message_type=MessageType.TRAIN, group_id=group_id)
                for node, content in contents.items()]
    answers: dict[int, T] = {}
    for reply in grid.send_and_receive(messages, timeout=timeout):
        node = reply.metadata.src_node_id
        if node not in contents or node in answers:
            continue
        if reply.has_error():
            state.dropped[f"node {node}"] = BadReply(Rejection.CLIENT_ERROR,
                                                     reply.error.reason or f"error code {reply.error.code}")
            continue
        state.bytes_received += reply_nbytes(reply.content)
        try:
            answers[node] = read(reply)
        except (KeyError, TypeError, ValueError) as error:
            state.dropped[f"node {node}"] = BadReply(Rejection.MALFORMED, str(error))
    for node in contents:
        if node not in answers and f"node {node}" not in state.dropped:
            state.dropped[f"node {node}"] = BadReply(Rejection.DROPPED_OUT, "no reply")
    return answers


def _stage_record(reply: Message) -> ConfigRecord:
    """A stage reply's config record (KeyError when there is none)."""
    return reply.content.config_records[RECORD_KEY_CONFIGS]


def _public_keys(reply: Message) -> list[bytes]:
    """A setup reply's two public keys."""
    record = _stage_record(reply)
    first, second = record[Key.PUBLIC_KEY_1], record[Key.PUBLIC_KEY_2]
    if not (isinstance(first, bytes) and isinstance(second, bytes)):
        raise TypeError("the public keys must be bytes")
    return [first, second]


def _pairs(reply: Message, first: str, kind: type[T], second: str) -> list[tuple[T, bytes]]:
    """The reply's lists ``first`` (of ``kind``) and ``second`` (of bytes), of equal length, as pairs."""
    record = _stage_record(reply)
    keys, values = record[first], record[second]
    if not (isinstance(keys, list) and isinstance(values, list)):
        raise TypeError(f"'{first}' and '{second}' must be lists")
    pairs = [(k, v) for k, v in zip(keys, values, strict=True)  # ValueError when their lengths differ
             if isinstance(k, kind) and not isinstance(k, bool) and isinstance(v, bytes)]
    if len(pairs) != len(keys):
        raise TypeError(f"'{first}' and '{second}' must hold {kind.__name__} and bytes")
    return pairs


def _masked_vector(reply: Message, lattice: ModularLattice, dimension: int) -> np.ndarray:
    array = reply.content.array_records[protocol.MASKED][protocol.MASKED].numpy()
    if array.dtype != lattice.wire_dtype or array.shape != (dimension,):
        raise ValueError(f"the masked vector is {array.dtype}{list(array.shape)}, expected "
                         f"{lattice.wire_dtype}[{dimension}]")
    return array.astype(np.uint64)


def _check(state: _Round, alive: set[int], stage: str, owners: set[int] | None = None) -> None:
    """Fail now if some node's secret could no longer be reconstructed (fewer than t live neighbours)."""
    if len(alive) < 2:
        raise SecureAggregationFailed(f"{stage}: {len(alive)} of {len(state.nodes)} nodes remain, "
                                      "SecAgg+ needs ≥ 2; nothing was unmasked", state.dropped)
    for node in sorted(owners if owners is not None else alive):
        live = len(state.neighbours[node] & alive)
        if live < state.threshold:
            raise SecureAggregationFailed(
                f"{stage}: node {node} has {live} live neighbours, the threshold is {state.threshold} "
                f"({len(state.nodes) - len(alive)} of {len(state.nodes)} nodes dropped out); nothing was unmasked",
                state.dropped)
