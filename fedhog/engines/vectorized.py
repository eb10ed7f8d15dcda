"""The vectorized engine: a Grid that trains the whole sampled cohort as one batched computation.

:class:`VectorizedGrid` is the in-process Grid (the same ServerApp and
SecureAggregator; discovery and any message go through the real ClientApp)
that also offers a :class:`~fedhog.replies.CohortRunner` of its own,
:class:`VectorizedRunner`: the strategy hands it the round's cohort and gets
every client's result back from :class:`~fedhog.engines.cohort.CohortTrainer`
instead of one message per client. Flower's own strategy (the ``flower-dp``
baseline, an aggregator whose ``batches_train_messages``) sends one train
message per client: ``send_and_receive`` trains such a batch of messages at
once and answers each as the ClientApp would.
Sampling, validation of the results, the
mechanism, accounting, results folder, checkpoints and metrics are the
strategy's, unchanged. What cannot be batched (Opacus' DP-SGD, the
``hog-step`` optimizer, secure aggregation, a user's model with buffers)
runs client by client, as on ``--engine inprocess``, and the run says so. A
user's model must also be a function ``torch.func.vmap`` can batch: no
data-dependent Python control flow, no ``.item()``, no in-place updates of
its inputs; one that is not fails in the first round, naming vmap's reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING

import torch
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import ServerApp

from .. import protocol
from ..aggregators import aggregator_of
from ..config import RunConfig
from ..data import dataset_info, population_training_data
from ..models import build_model, is_factory
from ..monitoring import measure_peak_memory
from ..protocol import ClientResult, LocalWork
from ..replies import CohortReplies, TrainRequest
from ..training import direction_seed, select_device
from .cohort import CohortTrainer, HogSettings, unbatchable_model_reason
from .inprocess import InProcessGrid


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
        self.partition_of_node = {node: int(c.node_config["partition-id"]) for node, c in self.contexts.items()}
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
    """The vectorized engine's :class:`~fedhog.replies.CohortRunner`: a cohort's local work as one batch.

    Parameters
    ----------
    config : RunConfig
        The run (its data, model, local training and ``hog`` settings).
    partition_of_node : mapping
        Node id -> the partition its ClientApp holds.
    """

    def __init__(self, config: RunConfig, partition_of_node: Mapping[int, int]) -> None:
        self.config = config
        self.partition_of_node = partition_of_node
        x, y, self.client_indices = population_training_data(config.data_spec)
        model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
        self.device = select_device(config.device)
        self.trainer = CohortTrainer(model, x, y, self.client_indices, self.device)
        self.hog = (HogSettings(config.hog_direction, config.hog_term, config.hog_batch_size)
                    if config.privacy_mechanism.wants_term else None)

    def train(self, request: TrainRequest) -> CohortReplies:
        """What every node of the cohort would reply to this round's train message, and the bytes it would send."""
        config, cohort = self.config, request.cohort
        nodes = list(cohort)
        if not nodes:  # Poisson sampling can draw nobody: the round releases the noise alone
            return CohortReplies()
        partitions = [self.partition_of_node[node] for node in nodes]
        seeds = [direction_seed(config.seed, request.server_round, p) for p in partitions]
        with measure_peak_memory(self.device) as peak:
            work = self.trainer.train(request.arrays.to_torch_state_dict(), partitions, seeds, config.local_epochs,
                                      config.batch_size, config.learning_rate, config.momentum, self.hog)
        results = []
        for k, (node, partition) in enumerate(zip(nodes, partitions, strict=True)):
            metrics = protocol.train_metrics(partition, len(self.client_indices[partition]), work.mean_losses[k],
                                             work.steps[k])
            term = None
            if self.hog is not None:
                metrics.update(protocol.third_order_metrics(work.third_order_seconds / len(nodes), work.term_finite[k],
                                                            peak.as_metrics()))
                term = work.terms[k] if work.term_finite[k] else None
            results.append(ClientResult(cohort[node], work.updates[k], term, metrics))
        return CohortReplies(results, bytes_received=sum(_nbytes(r.update) + _nbytes(r.term) for r in results))

    def train_messages(self, messages: list[Message]) -> list[Message]:
        """The ClientApp's replies to train messages of one model (the ``flower-dp`` baseline's), as one batch.

        The aggregator replies from each client's local work (its update and
        metrics; no third-order term: such aggregators want none).
        """
        aggregator = aggregator_of(self.config)
        arrays = messages[0].content["arrays"]
        if any(m.content["arrays"] != arrays for m in messages):
            raise ValueError(f"{self.config.aggregator}: the strategy sent different models in one round; "
                             "they cannot train as one batch")
        server_round = int(messages[0].content["config"][protocol.SERVER_ROUND])
        partitions = [self.partition_of_node[m.metadata.dst_node_id] for m in messages]
        seeds = [direction_seed(self.config.seed, server_round, p) for p in partitions]
        start = arrays.to_torch_state_dict()
        work = self.trainer.train(start, partitions, seeds, self.config.local_epochs, self.config.batch_size,
                                  self.config.learning_rate, self.config.momentum, None)
        return [aggregator.reply(message, LocalWork(start, self.trainer.unflatten(work.updates[k]), None,
                                                    protocol.train_metrics(p, len(self.client_indices[p]),
                                                                           work.mean_losses[k], work.steps[k])),
                                 self.config)
                for k, (message, p) in enumerate(zip(messages, partitions, strict=True))]


def _nbytes(tensor: torch.Tensor | None) -> int:
    """What a tensor weighs as a reply's array (0 for none)."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def run_vectorized(server_app: ServerApp, client_app: ClientApp, config: RunConfig) -> None:
    """Run ``server_app`` on the vectorized engine (client by client where the config cannot batch)."""
    reason = unbatchable_reason(config)
    if reason is None:
        grid: InProcessGrid = VectorizedGrid(client_app, config)
    else:
        log(WARNING, "vectorized engine: %s, so its clients run one by one, as with --engine inprocess", reason)
        grid = InProcessGrid(client_app, config.population, config.to_mapping())
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config.to_mapping())
    server_app(grid, context)
