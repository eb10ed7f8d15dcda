"""The vectorized engine: a Grid that trains the whole sampled cohort as one batched computation.

:class:`VectorizedGrid` is the in-process Grid (the same ServerApp and
SecureAggregator; discovery and any message go through the real ClientApp)
that also offers a :class:`~fedhog.replies.CohortRunner` of its own,
:class:`VectorizedRunner`: the strategy hands it the round's cohort and gets
back, instead of one message per client, the cohort trained in fixed blocks by
:class:`~fedhog.engines.cohort.CohortTrainer` on ``shards`` workers
(:mod:`fedhog.engines.shards`: this process, or Ray actors), each of which
checks, clips and sums its clients' results on the noise lattice; the
strategy adds the sums and noises once (every client's result comes back
instead where the mechanism is ``none``). Flower's own strategy (the ``flower-dp``
baseline, an aggregator whose ``batches_train_messages``) sends one train
message per client: ``send_and_receive`` trains such a batch of messages at
once and answers each as the ClientApp would.
Sampling, ξ, the check of every result (the
strategy's own), the noise, accounting, results folder, checkpoints and
metrics are the strategy's, unchanged. What cannot be batched (Opacus' DP-SGD, the
``hog-step`` optimizer, secure aggregation, a user's model with buffers)
runs client by client, as on ``--engine inprocess``, and the run says so. A
user's model must also be a function ``torch.func.vmap`` can batch: no
data-dependent Python control flow, no ``.item()``, no in-place updates of
its inputs; one that is not fails in the first round, naming vmap's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from logging import WARNING

import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import ServerApp

from .. import protocol
from ..aggregators import aggregator_of
from ..client_app import TRAIN_REPLIES
from ..config import ConfigError, RunConfig
from ..data import dataset_info, training_sizes
from ..models import build_model, is_factory
from ..protocol import LocalWork
from ..replies import CohortReplies, ReducedCohort, ReductionPlan, TrainRequest, global_model_of, server_round_of
from ..training import direction_seed
from .cohort import unbatchable_model_reason
from .inprocess import InProcessGrid
from .shards import BLOCK_CLIENTS, LocalShards, Member, RayShards, cohort_blocks, shard_blocks


def unbatchable_reason(config: RunConfig) -> str | None:
    """Why ``config``'s clients cannot train as one batch (None when they can)."""
    if config.client_dp == "dpsgd":
        return "client-dp='dpsgd' trains each client with Opacus"
    if config.optimizer == "hog-step":
        return "optimizer='hog-step' sizes each client's steps from its own derivatives"
    if config.secure_aggregation != "off":
        return (f"secure-aggregation={config.secure_aggregation!r} runs the protocol's stages with every client, "
                "each masking its own contribution")
    if is_factory(config.model):  # a user's model: batchable when it is a pure function of parameters and inputs
        model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
        reason = unbatchable_model_reason(model)
        return None if reason is None else f"model={config.model!r}: {reason}"
    return None


class VectorizedGrid(InProcessGrid):
    """The in-process Grid whose ``cohort_runner`` trains a cohort as one batch (see the module docstring)."""

    def __init__(self, client_app: ClientApp, config: RunConfig) -> None:
        super().__init__(client_app, config.population, config.to_mapping())
        self.config = config
        self.known_partitions = self.partition_of_node  # discovery asks no node: a million messages and contexts
        self.cohort_runner = VectorizedRunner(config, self.partition_of_node)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Train messages of an aggregator that :attr:`~fedhog.aggregators.Aggregator.batches_train_messages` (one
        model for every node) train as one batch; other messages one by one."""
        messages = list(messages)
        if not aggregator_of(self.config).batches_train_messages or not messages or any(
                m.metadata.message_type != MessageType.TRAIN for m in messages):
            return super().send_and_receive(messages, timeout=timeout)
        for message in messages:
            self._stamp(message)
        replies = self.cohort_runner.train_messages([self._transport(m) for m in messages])
        return [self._transport(reply) for reply in replies]


class VectorizedRunner:
    """The vectorized engine's :class:`~fedhog.replies.ReducingRunner`: a cohort's local work in batches.

    The cohort is cut into fixed blocks, each trained as one batch, spread over
    ``config.shards`` shards (:mod:`fedhog.engines.shards`): this process for
    one, Ray actors for more. :meth:`reduce` has each shard check and reduce its
    clients' results to one lattice sum; :meth:`train` brings every result back.

    Parameters
    ----------
    config : RunConfig
        The run (its data, model, local training, ``hog`` settings and ``shards``).
    partition_of_node : mapping
        Node id -> the partition its ClientApp holds.
    shards : LocalShards or RayShards, optional
        Where the blocks train (default: :func:`start_shards`).
    block : int
        Clients per block (:data:`~fedhog.engines.shards.BLOCK_CLIENTS`).
    """

    def __init__(self, config: RunConfig, partition_of_node: Mapping[int, int],
                 shards: LocalShards | RayShards | None = None, block: int = BLOCK_CLIENTS) -> None:
        self.config = config
        self.partition_of_node = partition_of_node
        self.shards = shards if shards is not None else start_shards(config)
        self.block = block

    def _shares(self, request: TrainRequest) -> list[list[list[Member]]]:
        """Each shard's blocks of ``request.cohort``."""
        members = [(slot, self.partition_of_node[node]) for node, slot in request.cohort.items()]
        sizes = training_sizes(self.config.data_spec, [partition for _, partition in members])
        return shard_blocks(cohort_blocks(members, sizes, self.block), self.shards.count)

    def train(self, request: TrainRequest) -> CohortReplies:
        """What every node of the cohort would reply to this round's train message, and the bytes it would send."""
        if not request.cohort:  # Poisson sampling can draw nobody: the round releases the noise alone
            return CohortReplies()
        state = self.shards.shared(request.arrays.to_torch_state_dict())
        out = CohortReplies()
        for results, nbytes in self.shards.map("results", [(request.server_round, state, share)
                                                           for share in self._shares(request)]):
            out.results += results
            out.bytes_received += nbytes
        out.results.sort(key=lambda result: result.slot)
        return out

    def reduce(self, request: TrainRequest, plan: ReductionPlan) -> ReducedCohort:
        """The cohort trained, and each shard's results checked and summed on the lattice where they are; added.

        Each shard is sent the global model once and the ξ of its own clients only.
        """
        total = ReducedCohort(torch.zeros(plan.dimension, dtype=torch.int64))
        if not request.cohort:
            return total
        state = self.shards.shared(request.arrays.to_torch_state_dict())
        shares = self._shares(request)
        own_xis = [{slot: plan.xis[slot] for block in share for slot, _ in block} for share in shares]
        for part in self.shards.map("reduce", [(request.server_round, state, share, replace(plan, xis=xis))
                                               for share, xis in zip(shares, own_xis, strict=True)]):
            total = total.add(part)
        return total

    def train_messages(self, messages: list[Message]) -> list[Message]:
        """The ClientApp's replies to train messages of one model (the ``flower-dp`` baseline's), as one batch.

        The aggregator replies from each client's local work (its update and
        metrics; no third-order term: such aggregators want none).
        """
        if not isinstance(self.shards, LocalShards):
            raise ValueError(f"aggregator={self.config.aggregator!r} trains in this process: it cannot take shards > 1")
        reply = TRAIN_REPLIES[self.config.aggregator]  # the ClientApp's own reply, as it sends it
        arrays = global_model_of(messages[0])
        if any(global_model_of(m) != arrays for m in messages):
            raise ValueError(f"{self.config.aggregator}: the strategy sent different models in one round; "
                             "they cannot train as one batch")
        server_round = server_round_of(messages[0])
        partitions = [self.partition_of_node[m.metadata.dst_node_id] for m in messages]
        seeds = [direction_seed(self.config.seed, server_round, p) for p in partitions]
        start = arrays.to_torch_state_dict()
        shard = self.shards.shard
        work = shard.work(start, partitions, seeds, None)
        examples = shard.examples(partitions)
        return [reply(message, LocalWork(start, shard.trainer.unflatten(work.updates[k]), None,
                                         protocol.train_metrics(p, examples[k], work.mean_losses[k], work.steps[k])),
                      self.config)
                for k, (message, p) in enumerate(zip(messages, partitions, strict=True))]

    def close(self) -> None:
        """Stop the shards (and Ray, if they started it)."""
        self.shards.close()


def start_shards(config: RunConfig) -> LocalShards | RayShards:
    """``config.shards`` shards: this process for one (no Ray start-up), Ray actors for more."""
    return LocalShards(config) if config.shards == 1 else RayShards(config, config.shards)


def run_vectorized(server_app: ServerApp, client_app: ClientApp, config: RunConfig) -> None:
    """Run ``server_app`` on the vectorized engine (client by client where the config cannot batch)."""
    reason = unbatchable_reason(config)
    if config.aggregator == "flower-dp" and config.shards > 1:
        raise ConfigError(f"shards={config.shards} is not allowed with aggregator='flower-dp', whose train messages "
                          "train in this process; expected shards = 1")
    if reason is None:
        grid: InProcessGrid = VectorizedGrid(client_app, config)
    elif config.shards > 1:
        raise ConfigError(f"shards={config.shards} is not allowed here: {reason}, so the clients run one by one "
                          "in this process; expected shards = 1")
    else:
        log(WARNING, "vectorized engine: %s, so its clients run one by one, as with --engine inprocess", reason)
        grid = InProcessGrid(client_app, config.population, config.to_mapping())
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config.to_mapping())
    try:
        server_app(grid, context)
    finally:
        if isinstance(grid, VectorizedGrid):
            grid.cohort_runner.close()
