"""The client's side of SecAgg+: Flower's stages, with fedhog's quantised contribution and masks.

Setup (key pairs), share-keys (Shamir shares of the self-mask seed and of the
masking key, encrypted to each neighbour) and unmask (shares for the server)
are Flower's own stage functions from ``secaggplus_mod``, and the protocol's
state lives where Flower keeps it (``context.state``, in memory). Only the
collect stage is fedhog's: the contribution is the client's clipped,
quantised row (:mod:`.quantization`), with distributed noise plus its noise
share (:mod:`.distributed_noise`), masked with :func:`.masking.mask`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState, check_configs, check_stage
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from .. import protocol
from ..compat import secaggplus_setup, secaggplus_share_keys, secaggplus_unmask
from .graph import share_count, threshold_count
from .ledger import RoundRefused
from .masking import mask
from .promise import ClientPromise

#: ``contribute(modulus_bits)``: this client's quantised (and, with distributed noise, noised) contribution
#: as residues mod 2^bits (uint64).
Contribute = Callable[[int], np.ndarray]


def is_secaggplus(msg: Message) -> bool:
    """Whether a train message is a stage of SecAgg+."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


@dataclass(frozen=True)
class ClientGuard:
    """What a client requires of every secure round, from its own run config and never from the server.

    A malicious server could otherwise talk clients into a lower SecAgg+
    threshold (fewer shares reconstruct a client's mask), a smaller share
    graph, or, with distributed noise, unmasking a sum of fewer than the m
    noise shares each client's σ_l was calibrated for.

    Parameters
    ----------
    threshold : float
        ``secagg-threshold``: t must be at least max(2, ⌈threshold·k⌉).
    num_shares : int
        ``secagg-num-shares``: k must follow from it and the cohort size n.
    cohort : int or None
        With fixed-size cohorts, the n every round must have; None under Poisson sampling.
    min_survivors : int
        m with distributed noise (2 otherwise): with the whole cohort as the
        share graph, a client releases its shares only when at least m
        contributions are unmasked together. With a sparse ring a client sees
        only its neighbours, so against a server that misreports dropouts only
        the threshold check holds (the README's threat model says so).
    """

    threshold: float
    num_shares: int
    cohort: int | None
    min_survivors: int = 2

    def check_setup(self, configs: ConfigRecord) -> None:
        """Refuse a setup whose n, k or t is not what this client's config implies."""
        n, k, t = (int(cast(int, configs[key])) for key in (Key.SAMPLE_NUMBER, Key.SHARE_NUMBER, Key.THRESHOLD))
        if self.cohort is not None and n != self.cohort:
            raise RoundRefused(f"the server's setup has a cohort of {n}; this client's config fixes {self.cohort}")
        if k != share_count(n, self.num_shares):
            raise RoundRefused(f"the server's setup shares secrets with {k} nodes; this client's config "
                               f"(secagg-num-shares={self.num_shares}) implies {share_count(n, self.num_shares)}")
        if t < threshold_count(k, self.threshold):
            raise RoundRefused(f"the server's setup asks for a threshold of {t} shares; this client's config "
                               f"(secagg-threshold={self.threshold:g}) requires ≥ {threshold_count(k, self.threshold)}")

    def check_unmask(self, state: SecAggPlusState, configs: ConfigRecord) -> None:
        """Refuse to help unmask a sum of fewer than m contributions (where the client sees the whole cohort)."""
        survivors = len(cast(list[int], configs[Key.ACTIVE_NODE_ID_LIST]))
        if state.share_num == state.sample_num and survivors < self.min_survivors:
            raise RoundRefused(f"the server asks to unmask a sum of {survivors} contributions; this client's noise "
                               f"share was calibrated for sums of ≥ {self.min_survivors}")


def handle_stage(msg: Message, context: Context, contribute: Contribute, guard: ClientGuard,
                 promise: ClientPromise | None = None) -> Message:
    """Run the stage ``msg`` asks for; reply with its config record (and the masked vector when collecting).

    ``guard`` checks the setup and the unmask request against the client's own config first; ``promise`` (its
    ledger and floors) admits the setup's round, records the contribution before the masked vector leaves, and
    answers one unmask request a round.
    """
    if RECORD_KEY_STATE not in context.state.config_records:
        context.state.config_records[RECORD_KEY_STATE] = ConfigRecord({})
    state = SecAggPlusState(**context.state.config_records[RECORD_KEY_STATE])
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    # a replayed unmask request is refused by the ledger first, by name (Flower's stage order would refuse it too)
    unmasked = (promise.check_unmask(msg, context)
                if promise is not None and configs.get(Key.STAGE) == Stage.UNMASK else None)
    check_stage(state.current_stage, configs)
    state.current_stage = cast(str, configs.pop(Key.STAGE))
    check_configs(state.current_stage, configs)
    content = RecordDict()
    if state.current_stage == Stage.SETUP:
        guard.check_setup(configs)
        if promise is not None:
            promise.open_session(msg, context)
        state.nid = msg.metadata.dst_node_id
        result = secaggplus_setup(state, configs)
    elif state.current_stage == Stage.SHARE_KEYS:
        result = secaggplus_share_keys(state, configs)
    elif state.current_stage == Stage.COLLECT_MASKED_VECTORS:
        content[protocol.MASKED] = ArrayRecord({protocol.MASKED: Array(_collect(msg, context, state, configs,
                                                                                contribute, promise))})
        result = {}
    else:
        guard.check_unmask(state, configs)
        result = secaggplus_unmask(state, configs)
        if promise is not None and unmasked is not None:
            promise.commit_unmask(unmasked)
    context.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    content[RECORD_KEY_CONFIGS] = ConfigRecord(result, False)
    return Message(content, reply_to=msg)


def _collect(msg: Message, context: Context, state: SecAggPlusState, configs: ConfigRecord, contribute: Contribute,
             promise: ClientPromise | None) -> np.ndarray:
    """The masked vector; with ``promise``, admitted for the session's round and recorded before it leaves."""
    if promise is None:
        return _masked_vector(state, configs, contribute)
    server_round = promise.session_round(msg, context)
    arrays = msg.content.array_records.get("arrays")
    dimension = None if arrays is None else sum(int(np.prod(a.shape)) for a in arrays.values())
    if dimension is None:
        raise RoundRefused("the collect stage carries no model")
    promise.admit(server_round, dimension)
    vector = _masked_vector(state, configs, contribute)
    promise.commit(server_round, dimension)
    return vector


def _masked_vector(state: SecAggPlusState, configs: ConfigRecord, contribute: Contribute) -> np.ndarray:
    """Store the neighbours' shares, then y = q + PRG(b) + Σ_j ±PRG(s_ij) mod M (Bonawitz et al. 2017)."""
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    sources = cast(list[int], configs[Key.SOURCE_LIST])
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError(f"only {len(ciphertexts) + 1} of the threshold {state.threshold} neighbours remain")
    for source, ciphertext in zip(sources, ciphertexts, strict=True):
        sender, destination, seed_share, key_share = share_keys_plaintext_separate(
            decrypt(state.ss2_dict[source], ciphertext))
        if sender != source or destination != state.nid:
            raise RoundRefused(f"node {state.nid}: a share from {sender} to {destination} arrived as {source}'s")
        state.rd_seed_share_dict[source] = seed_share
        state.sk1_share_dict[source] = key_share
    bits = state.mod_range.bit_length() - 1
    vector = contribute(bits)
    vector = vector + mask(state.rd_seed, vector.size, bits)
    own_key = bytes_to_private_key(state.sk1)
    for node in sources:
        pairwise = mask(generate_shared_key(own_key, bytes_to_public_key(state.public_keys_dict[node][0])),
                        vector.size, bits)
        vector = vector + pairwise if state.nid > node else vector - pairwise  # uint64 wraps mod 2^64
    vector &= np.uint64(state.mod_range - 1)
    return vector.astype(np.uint32 if bits <= 32 else np.uint64)
