"""Flower's own accounted central DP, run as a baseline (``aggregator = "flower-dp"``).

The strategy is Flower's, unchanged: ``DifferentialPrivacyServerSideFixedClipping``
over ``FedAvg``, with Flower's ``RdpAccountant`` in the only mode the wrapper
accepts for accounting — ``SamplingMethod.NO_AMPLIFICATION`` (add/remove one),
exactly K = q·N replies a round, equal client weights. Each round FedAvg samples
K clients uniformly without replacement, the wrapper clips every reply's change
of the model to the clipping norm, averages, and adds N(0, (σ·clip/K)²) from
NumPy's global generator. One guard: a client whose update is zero passes the
clipping as it is (Flower's divides by its norm and crashes the round;
:func:`~fedhog.compat.zero_updates_pass_flowers_clipping`).

**Same update rule as fedhog.** Accounted mode refuses any strategy that
overrides ``FedAvg.aggregate_train``, so the server step is plain averaging
(η = 1). To take the same server step η as fedhog's cells, clients reply
θ + η·Δ (``REPLY_KEY``) and the wrapper clips at η·C: the released model is
θ + η·(mean of clip_C(Δ_i) + N(0, (σC/K)²)), fedhog's DP-FedAvg with Flower's
sampling, clipping, noise and accountant. Only σ differs: it is calibrated
without sampling amplification (:func:`~fedhog.privacy.calibration.calibrate_unamplified_noise_multiplier`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from logging import INFO, WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, RdpAccountant
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from . import protocol
from .compat import zero_updates_pass_flowers_clipping
from .config import RunConfig
from .replies import metric_record
from .strategy import RoundRecord

REPLY_KEY = protocol.WEIGHTS  # the client's θ + η·Δ, the one ArrayRecord FedAvg accepts


def flower_dp_reply(msg: Message, global_state: dict[str, torch.Tensor], update: dict[str, torch.Tensor],
                    server_learning_rate: float, train_loss: float) -> Message:
    """A client's FedAvg reply: θ + η·Δ (the wrapper clips the change at η·C) and an equal weight."""
    arrays = {k: (global_state[k] + server_learning_rate * delta).detach().cpu().contiguous()
              for k, delta in update.items()}
    metrics = metric_record(protocol.fedavg_metrics(train_loss))
    return Message(RecordDict({REPLY_KEY: ArrayRecord(arrays), protocol.METRICS: metrics}), reply_to=msg)


def build_flower_dp_strategy(
    config: RunConfig,
    on_train_metrics: Callable[[MetricRecord], None] = lambda metrics: None,
) -> DifferentialPrivacyServerSideFixedClipping:
    """Flower's accounted wrapper over FedAvg for this run config (σ already set or calibrated).

    ``on_train_metrics`` receives each round's averaged client metrics.
    """
    cohort = config.expected_cohort

    def aggregate_train_metrics(records: list[RecordDict], weighting_key: str) -> MetricRecord:
        metrics = aggregate_metricrecords(records, weighting_key)
        on_train_metrics(metrics)
        return metrics

    fedavg = FedAvg(fraction_train=cohort / config.population, fraction_evaluate=0.0, min_train_nodes=cohort,
                    min_available_nodes=cohort, weighted_by_key=protocol.FEDAVG_WEIGHT,
                    train_metrics_aggr_fn=aggregate_train_metrics)
    max_epsilon = config.max_epsilon if math.isfinite(config.max_epsilon) else None
    # dp-accounting (scipy.stats) loads here, not with the module: the ClientApp imports this module for its reply,
    # and every message of a deployment is a fresh flwr-clientapp process (1.1 s of its imports)
    from .privacy.calibration import unamplified_privacy_config

    accountant = RdpAccountant(unamplified_privacy_config(config.population, config.delta, max_epsilon))
    return DifferentialPrivacyServerSideFixedClipping(
        fedavg, config.noise_multiplier, config.server_learning_rate * config.clipping_norm, cohort,
        accountant=accountant)


def run_flower_dp(
    grid: Grid,
    config: RunConfig,
    initial: ArrayRecord,
    evaluate_fn: Callable[[int, ArrayRecord], MetricRecord],
    on_round: Callable[[RoundRecord, ArrayRecord], None],
) -> tuple[ArrayRecord, float]:
    """Run the baseline; report every round to ``on_round``; return the final model and ε.

    With a fixed ``privacy-seed`` Python's and NumPy's global generators (which
    Flower samples and draws noise from) are seeded with it: repeatable, for
    experiments only. A round whose replies Flower refuses releases nothing and
    spends nothing; a round that would exceed ``max-epsilon`` ends the run.
    """
    if config.privacy_seed >= 0:
        random.seed(config.privacy_seed)
        np.random.seed(config.privacy_seed % 2**32)
    train_metrics: list[MetricRecord] = []
    strategy = build_flower_dp_strategy(config, train_metrics.append)
    accountant = strategy.accountant
    if accountant is None:  # build_flower_dp_strategy gives the wrapper one
        raise RuntimeError("the flower-dp baseline's wrapper has no accountant")
    cohort = config.expected_cohort
    latest = initial
    releases = 0
    started = time.perf_counter()

    def record_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        nonlocal latest, releases, started
        if server_round == 0:  # the caller evaluated the initial model already
            return None
        latest = arrays
        spent = accountant.get_privacy_spent()
        released = spent.num_releases > releases
        releases = spent.num_releases
        metrics = evaluate_fn(server_round, arrays)
        # the clients' mean train-loss (a number unless some client sent a list: then, and without one, NaN)
        loss = train_metrics.pop().get(protocol.TRAIN_LOSS) if train_metrics and released else None
        train_loss = float(loss) if protocol.is_number(loss) else math.nan
        train_metrics.clear()
        # everything since the last round's record: that round's diagnostics and writes included
        seconds, started = (now := time.perf_counter()) - started, now
        record = RoundRecord(
            round=server_round, clients_sampled=cohort, clients_accepted=cohort if released else 0,
            clients_rejected=0 if released else cohort, epsilon=spent.epsilon, seconds=seconds,
            train_loss=train_loss, noise_std=config.noise_multiplier * config.clipping_norm / cohort,
            clipping_norm=config.clipping_norm)
        record.take_evaluation(metrics)
        on_round(record, arrays)
        return metrics

    log(INFO, "flower-dp baseline: %r, σ=%.6g, clip η·C=%.6g, K=%d of N=%d, RdpAccountant (no amplification)",
        strategy, config.noise_multiplier, strategy.clipping_norm, cohort, config.population)
    try:
        with zero_updates_pass_flowers_clipping():  # a client whose model did not move would crash Flower's round
            strategy.start(grid, initial, num_rounds=config.rounds, timeout=config.round_timeout,
                           evaluate_fn=record_round)
    except PrivacyBudgetExhausted as stop:
        log(WARNING, "flower-dp baseline stopped: %s", stop)
    return latest, accountant.get_epsilon(config.delta)
