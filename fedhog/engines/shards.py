"""A cohort cut into fixed blocks, trained by shards (this process, or Ray actors) and reduced where it trained.

The vectorized engine's :class:`~fedhog.engines.vectorized.VectorizedRunner`
hands each round's cohort to ``shards`` workers. The cohort is sorted (by the
clients' numbers of training examples, then partition id) and cut into blocks
of :data:`BLOCK_CLIENTS` consecutive clients (:func:`cohort_blocks`); shard j of
N takes a contiguous run of whole blocks (:func:`shard_blocks`). A
:class:`CohortShard` trains one block at a time as one vmapped batch
(:class:`~fedhog.engines.cohort.CohortTrainer`), so a client's result depends
on its block only — its padding width, its batch's kernels and their
reductions — and the blocks depend on the cohort only: the results, and so
the release, are the same bits for every number of shards. Each shard then
checks its results with the strategy's own :class:`~fedhog.replies.ReplyCheck`,
mixes, clips and sums them on the noise lattice
(:func:`~fedhog.replies.reduce_results`) and returns one int64 sum and what
the server needs of each client (its norm before clipping, its metrics); the
strategy adds the shards' sums, exactly, and noises once.

Every shard runs torch with the same number of threads (the driver's, when
the shards start), since a kernel's reduction order may follow it. Shards
other than this process are Ray actors (:class:`RayShards`): ``ray.init()``
joins the cluster named by ``RAY_ADDRESS`` when it is set, else starts a
local one; every worker needs fedhog (this version) and torch installed, and
builds the data from the run config itself (``synthetic-large`` generates only
the clients it trains; MNIST-1D is generated and cached on each machine).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import protocol
from ..config import RunConfig
from ..data import clients_training_data, dataset_info, holds_population, population_training_data
from ..models import build_model
from ..monitoring import measure_peak_memory
from ..protocol import ClientResult
from ..replies import ReducedCohort, ReductionPlan, reduce_results
from ..training import direction_seed, select_device
from .cohort import CohortTrainer, CohortWork, HogSettings

if TYPE_CHECKING:
    from ray.actor import ActorHandle

BLOCK_CLIENTS = 128  # clients trained as one batch: a block's composition never depends on the number of shards
Member = tuple[int, int]  # a cohort member: (slot, partition id)


def cohort_blocks(members: Sequence[Member], sizes: Sequence[int], block: int = BLOCK_CLIENTS) -> list[list[Member]]:
    """The cohort in blocks of ``block``: sorted by (training examples, partition id), cut in order.

    Clients of similar size share a block, so padding to a block's largest costs little.
    """
    order = sorted(zip(sizes, members, strict=True), key=lambda item: (item[0], item[1][1]))
    ordered = [member for _, member in order]
    return [ordered[start:start + block] for start in range(0, len(ordered), block)]


def shard_blocks(blocks: list[list[Member]], shards: int) -> list[list[list[Member]]]:
    """Shard j's blocks: the j-th of ``shards`` contiguous runs of whole blocks (some empty when blocks are few)."""
    return [blocks[j * len(blocks) // shards:(j + 1) * len(blocks) // shards] for j in range(shards)]


class CohortShard:
    """One shard: trains blocks of a cohort, returns their results or their reduction.

    Parameters
    ----------
    config : RunConfig
        The run (data, model, local training, ``hog`` settings, device).
    threads : int
        torch threads for this shard's work; 0 leaves the process's own count.
    """

    def __init__(self, config: RunConfig, threads: int = 0) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.config = config
        self.spec = config.data_spec
        self.device = select_device(config.device)
        model = build_model(config.model, *dataset_info(self.spec), config.activation, config.normalization)
        self.holds_population = holds_population(self.spec)
        x, y, indices = (population_training_data(self.spec) if self.holds_population
                         else clients_training_data(self.spec, []))
        self.trainer = CohortTrainer(model, x, y, indices, self.device)
        self.hog = (HogSettings(config.hog_direction, config.hog_term, config.hog_batch_size, config.hog_mixing,
                                config.noise_aware_samples)
                    if config.privacy_mechanism.wants_term else None)

    def work(self, state: dict[str, torch.Tensor], partitions: list[int], seeds: list[int],
             hog: HogSettings | None) -> CohortWork:
        """These clients trained as one batch from ``state`` (their data generated first where it is not held)."""
        config = self.config
        if not self.holds_population:
            self.trainer.use_data(*clients_training_data(self.spec, partitions))
            partitions = list(range(len(partitions)))
        return self.trainer.train(state, partitions, seeds, config.local_epochs, config.batch_size,
                                  config.learning_rate, config.momentum, hog)

    def examples(self, partitions: list[int]) -> list[int]:
        """How many training examples each of the clients of the last :meth:`work` has."""
        own = self.trainer.client_indices
        return [len(own[p]) for p in partitions] if self.holds_population else [len(i) for i in own]

    def results(self, server_round: int, state: dict[str, torch.Tensor],
                blocks: list[list[Member]]) -> tuple[list[ClientResult], int]:
        """Every client's result, block by block, and the bytes its reply would have carried."""
        results: list[ClientResult] = []
        for block in blocks:
            results += self._block(server_round, state, block)
        return results, _reply_bytes(results)

    def reduce(self, server_round: int, state: dict[str, torch.Tensor], blocks: list[list[Member]],
               plan: ReductionPlan) -> ReducedCohort:
        """These blocks trained, checked, mixed, clipped and summed on the lattice (one block's results at a time)."""
        total = ReducedCohort(torch.zeros(plan.dimension, dtype=torch.int64))
        for block in blocks:
            results = self._block(server_round, state, block)
            total = total.add(reduce_results(results, plan, _reply_bytes(results)))
        return total

    def _block(self, server_round: int, state: dict[str, torch.Tensor], block: list[Member]) -> list[ClientResult]:
        partitions = [partition for _, partition in block]
        seeds = [direction_seed(self.config.seed, server_round, p) for p in partitions]
        with measure_peak_memory(self.device) as peak:
            work = self.work(state, partitions, seeds, self.hog)
        examples = self.examples(partitions)
        results = []
        for k, (slot, partition) in enumerate(block):
            metrics = protocol.train_metrics(partition, examples[k], work.mean_losses[k], work.steps[k])
            term = None
            if self.hog is not None and work.terms is not None:  # with hog, every client computed its term
                metrics.update(protocol.third_order_metrics(work.third_order_seconds / len(block), work.term_finite[k],
                                                            peak.as_metrics()))
                term = work.terms[k] if work.term_finite[k] else None
            results.append(ClientResult(slot, work.updates[k], term, metrics))
        return results


class LocalShards:
    """``count`` shards in this process: one :class:`CohortShard` called once per shard's share, in turn.

    What the shards compute does not depend on where they run; this is the
    split without Ray (``shards = 1``, and tests of any split).
    """

    def __init__(self, config: RunConfig, count: int = 1) -> None:
        self.count = count
        self.shard = CohortShard(config)

    def shared(self, value: Any) -> Any:
        """``value``, to pass to every shard (here: as it is)."""
        return value

    def map(self, method: str, shares: list[tuple[Any, ...]]) -> list[Any]:
        """``shard.method(*share)`` for every shard's share."""
        return [getattr(self.shard, method)(*share) for share in shares]

    def close(self) -> None:
        """Nothing to stop."""


class RayShards:
    """``count`` shards as Ray actors, each a :class:`CohortShard` with the driver's torch thread count.

    ``ray.init()`` joins the cluster at ``RAY_ADDRESS`` when that is set (and
    Ray is not initialised yet), else starts a local Ray that never spills its
    object store to disk (a cluster's own configuration decides that:
    ``automatic_object_spilling_enabled``) and that :meth:`close` stops. Each
    actor asks for its share of the cluster (:func:`actor_options`) and
    chooses its device on its own machine.
    """

    def __init__(self, config: RunConfig, count: int) -> None:
        import ray

        self.count = count
        self.started = not ray.is_initialized()
        if self.started:
            env = {name: os.environ[name] for name in ("FEDHOG_CACHE",) if name in os.environ}
            if os.environ.get("RAY_ADDRESS"):  # a cluster's own configuration decides its dashboard and spilling
                ray.init(logging_level=logging.WARNING, runtime_env={"env_vars": env})
            else:  # private norms and ξ never spill to disk
                ray.init(logging_level=logging.WARNING, runtime_env={"env_vars": env}, include_dashboard=False,
                         _system_config={"automatic_object_spilling_enabled": False})
        actor = ray.remote(CohortShard).options(**actor_options(ray.cluster_resources(), config.device, count))
        threads = torch.get_num_threads()
        # Ray's stubs type a remote class as the handle or the class itself; these are handles
        self.actors = [cast("ActorHandle[CohortShard]", actor.remote(config, threads)) for _ in range(count)]

    def shared(self, value: Any) -> Any:
        """``value`` put in Ray's object store once, to pass to every actor (each call resolves it)."""
        import ray

        return ray.put(value)

    def map(self, method: str, shares: list[tuple[Any, ...]]) -> list[Any]:
        """``actor.method(*share)`` on every actor at once; their answers in shard order."""
        import ray

        return ray.get([getattr(actor, method).remote(*share) for actor, share in zip(self.actors, shares,
                                                                                       strict=True)])

    def close(self) -> None:
        """Stop the actors, and Ray if this started it."""
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.started:
            ray.shutdown()


def actor_options(resources: dict[str, float], device: str, count: int) -> dict[str, float]:
    """What each of ``count`` shard actors asks of a cluster with ``resources``: a CPU (a share where there are
    fewer CPUs than shards) and, unless ``device`` is ``cpu``, an equal share of the cluster's GPUs (none where it
    has none: ``auto`` then picks the CPU in the actor, ``cuda`` fails there, naming the device)."""
    gpus = resources.get("GPU", 0.0) if device != "cpu" else 0.0
    return {"num_cpus": min(1.0, resources.get("CPU", 1.0) / count), "num_gpus": min(1.0, gpus / count)}


def _reply_bytes(results: list[ClientResult]) -> int:
    """What the results' updates and terms weigh as replies' arrays."""
    return sum(_nbytes(r.update) + _nbytes(r.term) for r in results)


def _nbytes(tensor: torch.Tensor | None) -> int:
    """What a tensor weighs as a reply's array (0 for none)."""
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
