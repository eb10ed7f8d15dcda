"""Flower ClientApp: local training plus the third-order noise term.

Thin by design: the work is in :mod:`fedhog.training` and
:mod:`fedhog.derivatives`; this module turns Flower messages into calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from logging import WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from . import protocol
from .aggregators import aggregator_of
from .client_state import (
    accountant_path,
    cached_calibration,
    load_accountant_state,
    save_accountant_state,
    state_dir,
)
from .config import RunConfig
from .data import ArrayData, dataset_info, load_client_data
from .derivatives import hessian_trace_gradient, third_order_vector
from .derivatives.engine import random_directions as hutchinson_directions
from .dpsgd import RecordPrivacy, train_dpsgd
from .flower_baseline import flower_dp_reply
from .layout import flatten
from .models import build_model
from .monitoring import measure_peak_memory
from .privacy.accounting import accountant_noise_multiplier
from .privacy.noise_aware import local_step_scale
from .privacy.randomness import PrivacyRandomness, client_bits
from .protocol import LocalWork
from .replies import global_model_of, metric_record, server_round_of, term_keyed_like, to_cpu, train_reply
from .secure_aggregation.client import ClientGuard, handle_stage, is_secaggplus
from .secure_aggregation.floors import NodeConfigError, NodeFloors, RunTerms
from .secure_aggregation.graph import threshold_count
from .secure_aggregation.ledger import Release, ReleaseLedger, RoundRefused, ledger_path
from .secure_aggregation.promise import ClientPromise
from .training import (
    control_term_seed,
    direction_seed,
    evaluate,
    hog_rows,
    random_direction,
    select_device,
    train_locally,
    unit_direction,
)

app = ClientApp()


@lru_cache(maxsize=8)
def _config(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return RunConfig.from_mapping(dict(items))


def run_config_of(context: Context) -> RunConfig:
    """The validated run config, parsed once per process."""
    return _config(tuple(sorted(context.run_config.items())))


@app.query()
def identify(msg: Message, context: Context) -> Message:
    """Tell the server which data partition this node holds."""
    metrics = MetricRecord({
        protocol.PARTITION_ID: int(context.node_config["partition-id"]),
        "num-partitions": int(context.node_config["num-partitions"]),
    })
    return Message(RecordDict({protocol.METRICS: metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train locally from the global model; reply with Δ, t and metrics (or run a SecAgg+ stage).

    Each contribution is admitted by the client's promise first (its release ledger and its operator's floors,
    :func:`client_promise`); a refusal reaches the server as one line, without paths or a traceback.
    """
    try:
        return _train(msg, context)
    except (RoundRefused, NodeConfigError) as refusal:
        reason = f"{type(refusal).__name__}: {' '.join(str(refusal).split())}"
        log(WARNING, "Refused a train message: %s", reason)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=msg)


def _train(msg: Message, context: Context) -> Message:
    config = run_config_of(context)
    if is_secaggplus(msg):
        return handle_stage(msg, context, lambda bits: secure_contribution(msg, context, bits),
                            client_guard(config), client_promise(context, config))
    _check_instruction(msg, config)
    if config.secure_aggregation != "off":
        raise RoundRefused(f"secure-aggregation={config.secure_aggregation!r}: this client contributes through "
                           "SecAgg+ only, never in the clear")
    promise = client_promise(context, config)
    partition_id = int(context.node_config["partition-id"])
    server_round = server_round_of(msg)
    dimension = _dimension(msg)
    promise.admit(server_round, dimension)
    if config.client_dp == "dpsgd":  # the reply carries Δ and ε only: no record counts, no raw-record statistics
        model, train_data, _, global_state = _load(msg, config, partition_id)
        privacy = _train_with_dpsgd(model, train_data, config, msg, context, partition_id, server_round)
        update = {k: (v.detach() - global_state[k]) for k, v in model.state_dict().items()}
        reply = Message(RecordDict({
            protocol.UPDATE: ArrayRecord(to_cpu(update)),
            protocol.METRICS: metric_record(protocol.dpsgd_metrics(partition_id, privacy.epsilon)),
        }), reply_to=msg)
    else:
        with_term = aggregator_of(config).takes_terms and config.privacy_mechanism.wants_term
        work = _local_work(msg, config, partition_id, server_round, with_term=with_term)
        reply = TRAIN_REPLIES[config.aggregator](msg, work, config)
    promise.commit(server_round, dimension)
    return reply


def _check_instruction(msg: Message, config: RunConfig) -> None:
    """Refuse a train message that is not the instruction of the config's aggregator: fedhog's replies are updates,
    which a stock Flower strategy (FedAvg, expecting weights) would average as a model."""
    config_record = msg.content.config_records.get("config")
    keys = INSTRUCTION_KEYS[config.aggregator]
    missing = [key for key in keys if config_record is None or key not in config_record]
    if missing or "arrays" not in msg.content.array_records:
        what = ", ".join(f"'{key}'" for key in missing) if missing else "the model under 'arrays'"
        raise RoundRefused(f"the train message lacks {what}: it is not from the ServerApp of aggregator="
                           f"{config.aggregator!r} (a stock Flower strategy such as FedAvg?); fedhog's ClientApp "
                           "replies with updates, not weights (docs/manual/your-model-and-data.md)")


def _dimension(msg: Message) -> int:
    """d, the global model's number of values."""
    return sum(int(np.prod(a.shape)) for a in global_model_of(msg).values())


def client_promise(context: Context, config: RunConfig) -> ClientPromise:
    """This node's ledger and floors for ``config``'s run (:mod:`fedhog.secure_aggregation.promise`).

    Raises
    ------
    NodeConfigError
        If the node config's floors are invalid.
    LedgerUntrusted
        If the ledger cannot be read.
    """
    floors = NodeFloors.from_node_config(context.node_config)
    directory = state_dir(context.node_config)
    path = ledger_path(directory, int(context.node_config["partition-id"]))
    return ClientPromise(ReleaseLedger.load(path), floors, context.run_id,
                         lambda d: run_terms(config, d, directory))


def run_terms(config: RunConfig, dimension: int | None, directory: Path) -> RunTerms:
    """What ``config``'s run asks of this client and what one contribution releases, as the client accounts it.

    Trusted server: the noise the run says the server adds (σ, calibrated if the run targets an ε: once per node,
    cached in its state ``directory``), composed without amplification by sampling. Distributed noise: the
    client's own plan (σ_l, m shares). Both need the model's dimension d; None (a SecAgg+ setup, which carries no
    model) gives the terms without the noise, which the collect stage checks.
    """
    terms = RunTerms(config.rounds, config.secure_aggregation != "off", config.secagg_threshold,
                     seeded=config.privacy_seed >= 0)
    if dimension is None:
        return terms
    if config.noise == "distributed":
        plan = config.distributed_noise(dimension)
        accounting = plan.accounting
        return replace(terms, noise_multiplier=plan.noise_multiplier,
                       release=Release("ddg", local_std=plan.local_std, shares=accounting.shares, l2=accounting.l2,
                                       dimension=accounting.dimension, draws=plan.draws_per_release))
    sigma = _calibrated_sigma(config, directory) if config.privacy_mechanism.has_guarantee else 0.0
    release = (Release("gaussian", noise_multiplier=accountant_noise_multiplier(sigma, config.sampling))
               if sigma > 0 else Release("none"))
    return replace(terms, noise_multiplier=sigma, release=release)


@lru_cache(maxsize=8)
def _calibrated_sigma(config: RunConfig, directory: Path) -> float:
    """σ of ``config``'s run (calibrated to its target-epsilon, if any), remembered in this process and on disk."""
    if not config.target_epsilon > 0:
        return config.noise_multiplier
    return cached_calibration(directory, repr(config.calibration_inputs), lambda: config.calibrated().noise_multiplier)


def _fedhog_reply(msg: Message, work: LocalWork, config: RunConfig) -> Message:
    """Δ, t (when computed and finite) and the metrics, as :class:`~fedhog.replies.ReplyReader` reads them."""
    return train_reply(msg, work)


def _flower_dp_reply(msg: Message, work: LocalWork, config: RunConfig) -> Message:
    """Flower's FedAvg reply: θ + η·Δ (the wrapper clips the change at η·C) and an equal weight."""
    return flower_dp_reply(msg, work.global_state, work.update, config.server_learning_rate,
                           float(work.metrics[protocol.TRAIN_LOSS]))


#: Each ``aggregator`` -> the keys its ServerApp's train instruction config carries (Flower's FedAvg: the round only).
INSTRUCTION_KEYS: dict[str, tuple[str, ...]] = {"fedhog": (protocol.SERVER_ROUND, protocol.JOB_ID),
                                                "flower-dp": (protocol.SERVER_ROUND,)}

#: Each ``aggregator`` (:data:`fedhog.aggregators.AGGREGATOR_REGISTRY`) -> the ClientApp's reply to a train
#: message, from the client's local work (the vectorized engine's batched replies too).
TRAIN_REPLIES: dict[str, Callable[[Message, LocalWork, RunConfig], Message]] = {
    "fedhog": _fedhog_reply, "flower-dp": _flower_dp_reply}


def _load(msg: Message, config: RunConfig,
          partition_id: int) -> tuple[torch.nn.Module, ArrayData, ArrayData, dict[str, torch.Tensor]]:
    """The model at the global state, this client's training and validation data, the global state on the device."""
    device = select_device(config.device)
    train_data, validation_data = load_client_data(config.data_spec, partition_id)
    model = build_model(config.model, *dataset_info(config.data_spec), config.activation,
                        config.normalization).to(device)
    global_state = global_model_of(msg).to_torch_state_dict()
    model.load_state_dict(global_state)
    return model, train_data, validation_data, {k: v.to(device) for k, v in global_state.items()}


def _local_work(msg: Message, config: RunConfig, partition_id: int, server_round: int, with_term: bool) -> LocalWork:
    """Local training from the global model and, ``with_term``, the third-order term."""
    seed = direction_seed(config.seed, server_round, partition_id)
    model, train_data, validation_data, global_state = _load(msg, config, partition_id)
    local = train_locally(model, train_data, config.local_epochs, config.batch_size,
                          config.learning_rate, config.momentum, seed, config.optimizer)
    update = {k: (v.detach() - global_state[k]) for k, v in model.state_dict().items()}
    metrics = protocol.train_metrics(partition_id, len(train_data), local.mean_loss, local.steps,
                                     cubic_steps=local.cubic_steps,
                                     validation_accuracy=evaluate(model, validation_data)[1])
    term = None
    if with_term:
        model.load_state_dict(global_state)
        with measure_peak_memory(next(model.parameters()).device) as peak:
            term, finite, seconds = third_order_term(model, train_data, update, config, seed)
        metrics.update(protocol.third_order_metrics(seconds, finite, peak.as_metrics()))
        term = term if finite else None
        if term is not None and config.hog_mixing == "noise-aware":  # λ_i ĝ_i (fedhog.privacy.noise_aware)
            scale = local_step_scale(config.learning_rate, local.steps, config.momentum)
            term = {k: v * scale for k, v in term.items()}
    return LocalWork(global_state, update, term, metrics)


def client_guard(config: RunConfig) -> ClientGuard:
    """What this client requires of a secure round: n, k, t and m from its own config (:class:`ClientGuard`)."""
    distributed = config.noise == "distributed"
    return ClientGuard(config.secagg_threshold, config.secagg_num_shares,
                       config.expected_cohort if config.sampling == "fixed" else None,
                       threshold_count(config.expected_cohort, config.secagg_threshold) if distributed else 2)


def secure_contribution(msg: Message, context: Context, modulus_bits: int) -> np.ndarray:
    """This client's share of the sum under SecAgg+: Δ_i mixed with its own ξ_i, clipped to C, quantised mod 2^bits.

    The same per-contribution step as the trusted server's
    (:meth:`~fedhog.privacy.mechanism.Mechanism.constrain_sensitivity`) on this one row.
    ξ_i and the stochastic rounding come from the client's own stream: OS
    entropy, or with a fixed ``privacy-seed`` the ξ the trusted server would
    draw for this client's slot (so both modes run the same experiment).
    The lattice (and, with ``noise = "distributed"``, σ_l) is the client's
    own computation from public config (:meth:`RunConfig.secure_plan`): it
    trusts nothing the server sends but the model. With distributed noise the
    mechanism adds its share of discrete Gaussian noise, drawn from the same
    stream, before masking (:meth:`~fedhog.privacy.mechanism.Mechanism.noise_share`).
    Nothing of the contribution leaves the client unmasked; a failed term
    raises, which the server sees as a dropout.
    """
    config = run_config_of(context)
    partition_id = int(context.node_config["partition-id"])
    server_round = server_round_of(msg)
    arrays = global_model_of(msg)
    keys = list(arrays.keys())
    mechanism = config.mechanism_for(sum(int(np.prod(a.shape)) for a in arrays.values()))
    work = _local_work(msg, config, partition_id, server_round, with_term=mechanism.wants_term)
    update = flatten(work.update, keys).detach().cpu()
    if not bool(torch.isfinite(update).all()):
        raise ValueError("non-finite values: the update holds NaN or inf")
    terms = None
    seed = None if config.privacy_seed < 0 else config.privacy_seed
    bits = client_bits(seed, server_round, partition_id, stream=1)
    if mechanism.wants_term:
        if work.term is None:
            raise ValueError("non-finite third-order term: the client cannot contribute this round")
        keyed = term_keyed_like(work.term, work.update)
        terms = flatten(keyed, keys).detach().cpu()[None]
    # ξ from the client's own stream, or with a fixed seed the trusted server's draw for this slot (none: no mixing)
    xis = (mechanism.xis(bits, 1, [0]) if seed is None else
           mechanism.xis(PrivacyRandomness(seed).for_round(server_round).mixing, config.population, [partition_id]))
    rows, _ = mechanism.constrain_sensitivity(update[None], terms, torch.from_numpy(xis))
    lattice, _ = config.secure_plan(update.numel())
    if lattice.modulus_bits != modulus_bits:
        raise RoundRefused(f"the server asks for residues mod 2^{modulus_bits}, "
                         f"the run config for 2^{lattice.modulus_bits}")
    return lattice.encode(mechanism.noise_share(lattice.stochastic_round(rows[0], bits), bits))


def _train_with_dpsgd(model: torch.nn.Module, data: ArrayData, config: RunConfig, msg: Message,
                      context: Context, partition_id: int, server_round: int) -> RecordPrivacy:
    """DP-SGD with this client's own randomness; its accountant is read from and written to its disk.

    Noise and batches come from OS entropy unless ``privacy-seed`` ≥ 0. The
    accountant file is named by the server's job id (see :mod:`fedhog.client_state`).
    """
    path = accountant_path(state_dir(context.node_config), msg.content.config_records["config"].get(protocol.JOB_ID),
                           partition_id)
    bits = client_bits(None if config.privacy_seed < 0 else config.privacy_seed, server_round, partition_id)
    _, privacy = train_dpsgd(model, data, config.local_epochs, config.batch_size, config.learning_rate,
                             config.momentum, bits, config.dpsgd_settings, load_accountant_state(path))
    save_accountant_state(path, privacy.accountant_state)
    return privacy


def third_order_term(
    model: torch.nn.Module,
    data: ArrayData,
    update: dict[str, torch.Tensor],
    config: RunConfig,
    seed: int,
) -> tuple[dict[str, torch.Tensor], bool, float]:
    """t = ∇_θ(vᵀ∇²L(θ)v) at the model's parameters on one local batch.

    v is a random unit direction from ``seed`` (``hog-direction = random``) or
    the unit local update (``update``; random when the update is zero). With
    ``hog-term = random`` (the control experiment) t is instead an isotropic
    random direction: the same mixing, without the third-order structure.
    Returns the term, whether it is finite, and the seconds it took. With ``hog-mixing = noise-aware`` the
    term is :func:`noise_aware_estimate` instead (unscaled: the caller multiplies it by λ_i).
    """
    started = time.perf_counter()
    if config.hog_mixing == "noise-aware":
        estimate, finite = noise_aware_estimate(model, data, config, seed)
        return estimate, finite, time.perf_counter() - started
    params = dict(model.named_parameters())
    if config.hog_term == "random":
        term = random_direction({k: p.detach() for k, p in params.items()}, control_term_seed(seed))
        return term, True, time.perf_counter() - started
    # v lives in parameter space: a buffer's change (BatchNorm's running statistics) is no direction of the loss
    direction = unit_direction({k: update[k] for k in params}) if config.hog_direction == "update" else None
    if direction is None:
        direction = random_direction({k: p.detach() for k, p in params.items()}, seed)
    if len(data) == 0:
        return {k: torch.zeros_like(p) for k, p in params.items()}, True, time.perf_counter() - started
    rows = hog_rows(len(data), config.hog_batch_size, seed)
    device = next(model.parameters()).device
    inputs = torch.as_tensor(data.x[rows], device=device)
    targets = torch.as_tensor(data.y[rows], device=device)
    result = third_order_vector(model, inputs, targets, direction, loss="cross_entropy")
    return result.vector, result.finite, time.perf_counter() - started


def noise_aware_estimate(model: torch.nn.Module, data: ArrayData, config: RunConfig,
                         seed: int) -> tuple[dict[str, torch.Tensor], bool]:
    """ĝ ≈ ∇_θ tr ∇²L(θ) on the client's term examples (:func:`~fedhog.training.hog_rows`), and whether it is finite.

    Hutchinson over ``noise-aware-samples`` Rademacher directions drawn from ``seed``
    (:func:`~fedhog.derivatives.hessian_trace_gradient`). With ``hog-term = random`` (the control) an isotropic
    random direction of ĝ's norm: the same scale, without the curvature's structure.
    """
    params = {k: p.detach() for k, p in model.named_parameters()}
    if len(data) == 0:
        return {k: torch.zeros_like(p) for k, p in params.items()}, True
    rows = hog_rows(len(data), config.hog_batch_size, seed)
    device = next(model.parameters()).device
    stacked = hutchinson_directions(params, config.noise_aware_samples, "rademacher",
                                    torch.Generator().manual_seed(seed))
    directions = [{k: d[j] for k, d in stacked.items()} for j in range(config.noise_aware_samples)]
    result = hessian_trace_gradient(model, torch.as_tensor(data.x[rows], device=device),
                                    torch.as_tensor(data.y[rows], device=device), directions=directions,
                                    loss="cross_entropy")
    assert result.vector is not None
    if config.hog_term != "random" or not result.finite:
        return result.vector, result.finite
    norm = torch.linalg.vector_norm(torch.cat([v.double().reshape(-1) for v in result.vector.values()]))
    control = random_direction(params, control_term_seed(seed))
    return {k: (v.double() * norm).to(v.dtype) for k, v in control.items()}, True
