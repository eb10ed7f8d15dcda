"""Flower ServerApp: run the config's aggregator (the SecureAggregator, or Flower's DP baseline) and write results."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from .aggregators import aggregator_of
from .alarms import alarms, warnings_for
from .checkpoint import Checkpoint, checkpointed_rounds, load_checkpoint, save_checkpoint
from .config import RunConfig
from .data import dataset_info, load_proxy_set, load_server_validation_set, load_test_set
from .diagnostics import saturated_fractions, weight_diagnostics
from .interrupts import deferred, interrupt_exit_code
from .models import build_model
from .monitoring import SNAPSHOT_NAME, ServerMetrics
from .privacy.adaptive_clipping import AdaptiveClipping
from .privacy.randomness import PrivacyRandomness
from .privacy.sampler_slack import sampler_label
from .protocol import JOB_ID, Rejection, client_error_summary
from .replies import metric_record, runner_for
from .results import ResultsWriter, default_results_dir, stop_requested
from .secure_aggregation.server import SecAggSettings, small_cohort_delta
from .server_step import ProxyStepLength
from .strategy import MAX_EMPTY_IN_A_ROW, RoundRecord, SecureAggregator, log_round
from .training import evaluate_metrics
from .write_behind import WriteBehind

app = ServerApp()
_stage = logging.getLogger("fedhog.stage").info  # the progress display's line before the first round
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord]
#: The writer thread's evaluation takes the round's model as tensors: decoding an ArrayRecord (``np.load``, whose
#: header ``ast.literal_eval`` parses) there while the round's thread decodes the next would build ASTs in two
#: threads, which CPython 3.11 can fail ("AST constructor recursion depth mismatch"; simulations/ast_threads.py).
StateEvaluateFn = Callable[[int, dict[str, torch.Tensor]], MetricRecord]
Diagnose = Callable[[RoundRecord, ArrayRecord], None]
DIAGNOSTIC_EXAMPLES = 512  # the server's test examples that saturation is counted on


@dataclass(frozen=True)
class ServerRun:
    """What the ServerApp hands its aggregator's rounds (:data:`SERVERS`)."""

    writer: ResultsWriter
    monitor: ServerMetrics
    initial: ArrayRecord
    evaluate_fn: EvaluateFn
    evaluate_behind: StateEvaluateFn  # the same evaluation with a model of its own, for the writer thread
    checkpoint: Checkpoint | None
    diagnose: Diagnose


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of the ServerApp under any Flower engine."""
    run_server(grid, RunConfig.from_mapping(context.run_config))


def build_strategy(config: RunConfig, dimension: int = 0) -> SecureAggregator:
    """The aggregator, its mechanism and the mechanism's accountant, its private randomness and, with
    ``server-step``, its step length.

    ``dimension`` (the model's number of parameters) is needed in secure mode with distributed noise.
    """
    mechanism = config.mechanism_for(dimension)
    secure = None
    if config.secure_aggregation != "off":
        lattice, noise = config.secure_plan(dimension)
        secure = SecAggSettings(config.secagg_num_shares, config.secagg_threshold, lattice, config.clipping_norm,
                                noise)
    accountant = mechanism.accountant(config.sampling, config.sampling_rate,
                                      config.population, config.delta, config.accountant)
    randomness = PrivacyRandomness(None if config.privacy_seed < 0 else config.privacy_seed)
    adaptive = config.adaptive_clipping_settings
    return SecureAggregator(mechanism, accountant, randomness, config.sampling,
                            config.sampling_rate, config.server_optimizer_settings, config.max_epsilon,
                            None if adaptive is None else AdaptiveClipping(adaptive, config.noise_multiplier),
                            config.max_update_norm, equal_weights=config.client_dp == "dpsgd",
                            step_length=_proxy_step_length(config), secure_aggregation=secure)


def _proxy_step_length(config: RunConfig) -> ProxyStepLength | None:
    """``server-step`` on the server's proxy set, or None when it is off."""
    if config.server_step == "none":
        return None
    with torch.random.fork_rng():  # its weights are overwritten every round: leave the run's torch RNG as it was
        model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
    return ProxyStepLength(config.server_step_settings, model, load_proxy_set(config.data_spec),
                           list(model.state_dict()))


def run_server(grid: Grid, config: RunConfig) -> Path:
    """Train (or resume), evaluate every round, write results; return the folder.

    After every round the results folder gets ``metrics.json`` and, with
    fedhog's aggregator, an atomic ``checkpoint.pt`` (model, accountant,
    adaptive clipping's C, rounds so far: no randomness, see
    :class:`~fedhog.privacy.randomness.PrivacyRandomness`); with
    ``resume = true`` the run continues from that checkpoint. The config's
    aggregator (:mod:`fedhog.aggregators`) runs the rounds: the SecureAggregator,
    or Flower's accounted DP wrapper (:mod:`fedhog.flower_baseline`), which writes no checkpoints.
    """
    started = time.perf_counter()
    directory = Path(config.results_dir) if config.results_dir else default_results_dir()
    checkpoint = load_checkpoint(directory) if config.resume else None
    kept = checkpointed_rounds(directory, checkpoint) if checkpoint is not None else None
    writer = ResultsWriter(directory, config.with_overrides({"resume": False}), rounds=kept)
    with _stages_into(writer), _outcome_recorded(writer, started):
        return _train(grid, config, writer, checkpoint, started)


@contextmanager
def _outcome_recorded(writer: ResultsWriter, started: float) -> Iterator[None]:
    """Whatever stops the run before it finishes, ``metrics.json`` says so: ``interrupted`` (Ctrl-C, SIGTERM:
    resumable from the last checkpoint) or ``failed`` with the error, from calibration to the last round."""
    try:
        yield
    except BaseException as error:
        with deferred():
            if interrupt_exit_code(error) is not None:
                writer.update(status="interrupted", seconds=time.perf_counter() - started)
            else:
                writer.update(status="failed", error=f"{type(error).__name__}: {error}",
                              seconds=time.perf_counter() - started)
        raise


@contextmanager
def _stages_into(writer: ResultsWriter) -> Iterator[None]:
    """Write what the run does before its first round (``fedhog.stage`` messages) into ``metrics.json``'s ``stage``.

    The progress display of a launcher in another process (Simulation Engine, ``deploy-local``) shows it.
    """
    class ToMetrics(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not writer.document["rounds"]:
                writer.update(stage=record.getMessage())

    logger, handler = logging.getLogger("fedhog.stage"), ToMetrics(logging.INFO)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _train(grid: Grid, config: RunConfig, writer: ResultsWriter, checkpoint: Checkpoint | None,
           started: float) -> Path:
    """:func:`run_server` once its results folder is open."""
    if checkpoint is not None:
        writer.update(resumed_after_round=checkpoint.round)
    log(INFO, "fedhog results folder: %s", writer.directory)
    monitor = ServerMetrics()

    if config.target_epsilon > 0 and config.noise != "distributed":  # distributed: σ_l is calibrated with the lattice
        _stage("calibrating σ to ε = %g over %d rounds…", config.target_epsilon, config.rounds)
        config = config.calibrated()
        log(INFO, "noise-multiplier σ=%.6g calibrated to target-epsilon=%g (δ=%g, %d rounds)",
            config.noise_multiplier, config.target_epsilon, config.delta, config.rounds)
    input_shape, num_classes = dataset_info(config.data_spec)
    config.check_metrics(num_classes)
    torch.manual_seed(config.seed)
    model = build_model(config.model, input_shape, num_classes, config.activation, config.normalization)
    test_set = load_test_set(config.data_spec)
    validation_set = load_server_validation_set(config.data_spec)

    def evaluate_with(evaluated: torch.nn.Module) -> StateEvaluateFn:
        """The test and validation sets' metrics of a round's model (its tensors), loaded into ``evaluated``."""
        def evaluate_fn(server_round: int, state: dict[str, torch.Tensor]) -> MetricRecord:
            evaluated.load_state_dict(state)
            metrics = evaluate_metrics(evaluated, test_set, config.test_metrics)
            if len(validation_set):
                held = evaluate_metrics(evaluated, validation_set)
                metrics["validation-loss"], metrics["validation-accuracy"] = held["loss"], held["accuracy"]
            return metric_record(metrics)

        return evaluate_fn

    evaluate_state = evaluate_with(model)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return evaluate_state(server_round, arrays.to_torch_state_dict())

    initial = ArrayRecord(model.state_dict())
    initial_state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    probe = torch.as_tensor(test_set.x[:DIAGNOSTIC_EXAMPLES])
    aggregator = aggregator_of(config)
    linear_momentum = ({"sgd": 0.0, "momentum": config.server_momentum}.get(config.server_optimizer)
                       if aggregator.applies_server_optimizer else None)
    warned: set[str] = set()

    def diagnose(record: RoundRecord, arrays: ArrayRecord) -> None:
        """Weight growth, the noise's random walk and saturation of the released model (post-processing)."""
        state = arrays.to_torch_state_dict()
        model.load_state_dict(state)
        record.layers = {**weight_diagnostics(initial_state, state, record.round, record.noise_std,
                                              config.server_learning_rate, linear_momentum),
                         **saturated_fractions(model, probe)}
        record.warnings = warnings_for(record.layers)
        shown = alarms(record.layers)
        if diverging := record.divergence_warning(config.learning_rate):
            record.warnings.append(diverging)
            shown.append(diverging)
        for warning in record.warnings:
            layer = warning.split(":")[0]
            if layer not in warned:  # once per layer and kind in the log; every round in metrics.json
                warned.add(layer)
                log(WARNING if warning in shown else INFO, "round %d: %s", record.round, warning)

    try:
        if config.metrics_port >= 0:
            port = monitor.start_http_server(config.metrics_port)  # 127.0.0.1 only
            writer.update(metrics_url=f"http://127.0.0.1:{port}/metrics")
            log(INFO, "fedhog metrics: http://127.0.0.1:%d/metrics", port)
        baseline = evaluate_fn(0, initial)
        writer.update(initial=dict(baseline))
        # behind the rounds (vectorized engine) the writer thread evaluates, with a model of its own
        arrays, epsilon = SERVERS[config.aggregator](grid, config, ServerRun(writer, monitor, initial, evaluate_fn,
                                                                   evaluate_with(copy.deepcopy(model)), checkpoint,
                                                                   diagnose))
    finally:
        if writer.document["rounds"]:  # the last rounds' gauges, which the snapshot's cadence may have skipped
            monitor.write_snapshot(writer.directory / SNAPSHOT_NAME)
        monitor.stop()
    rounds = writer.document["rounds"]
    final = rounds[-1] if rounds else {}
    with deferred():
        writer.save_model(arrays)
        writer.update(
            status="finished",
            seconds=time.perf_counter() - started,
            summary={
                "rounds_completed": len(rounds),
                "rounds_planned": config.rounds,
                "stopped_by_budget": len(rounds) < config.rounds,
                **{f"{edge}_{name}": value for name in config.test_metrics
                   for edge, value in (("final", final.get(name, baseline[name])), ("initial", baseline[name]))},
                "epsilon": epsilon,
                "delta": config.delta,
                "noise_multiplier": writer.document.get("privacy", {}).get("noise_multiplier"),
            },
        )
    log(INFO, "fedhog finished: accuracy %.4f, ε %s at δ=%g, results in %s",
        final.get("accuracy", math.nan), "∞ (no DP guarantee)" if math.isinf(epsilon) else f"{epsilon:.4g}",
        config.delta, writer.directory)
    return writer.directory


def run_secure_aggregator(grid: Grid, config: RunConfig, run: ServerRun) -> tuple[ArrayRecord, float]:
    """fedhog's own run: discovery, SecureAggregator rounds, a checkpoint after each; the model and ε.

    ``run.evaluate_behind`` evaluates a round in the writer thread (its own model) when the writes run behind.
    """
    writer, monitor, initial, checkpoint, diagnose = run.writer, run.monitor, run.initial, run.checkpoint, run.diagnose
    evaluate_behind = run.evaluate_behind
    numel = sum(int(math.prod(array.shape)) for array in initial.values())
    strategy = build_strategy(config, numel)
    # The vectorized engine's clients are this process's own computation: no one outside it sees a released
    # model before its round is shown, so the round's evaluation and writes may run behind the next round's
    # training. A grid that sends messages (the model) to clients writes each round before the next one starts.
    behind = getattr(grid, "cohort_runner", None) is not None
    writes = WriteBehind()
    rows = list(writer.document["rounds"])  # every round handed to the writes, shown or about to be

    def on_round(record: RoundRecord, arrays: ArrayRecord) -> None:
        if stop_requested(writer.directory):  # the launcher is stopping the clients: this round is not the run's
            raise KeyboardInterrupt("stopped by its launcher")
        diagnose(record, arrays)
        model = arrays.to_torch_state_dict()  # fresh tensors, read from the record's bytes: no copy
        accountant, server_optimizer, adaptive_clipping = copy.deepcopy((
            strategy.accountant.state_dict(), strategy.server_optimizer.state_dict(),
            None if strategy.adaptive_clipping is None else strategy.adaptive_clipping.state_dict()))
        shown, client_metrics, logged = copy.deepcopy(record), list(strategy.client_metrics), len(rows)

        def write() -> None:
            if behind:
                shown.take_evaluation(evaluate_behind(shown.round, model))
            # the checkpoint first: whatever shows the round (its log line, metrics.json, the Prometheus gauges)
            # is written after it, so a resume never releases again a round that anyone has seen
            save_checkpoint(writer.directory, Checkpoint(
                round=shown.round, model=model, accountant=accountant, rounds=[dataclasses.asdict(shown)],
                adaptive_clipping=adaptive_clipping, job_id=job_id, server_optimizer=server_optimizer,
                rounds_logged=logged))
            if writer.add_round(shown):
                monitor.write_snapshot(writer.directory / SNAPSHOT_NAME)
            monitor.observe_round(shown, client_metrics)
            log_round(shown)

        rows.append(dataclasses.asdict(record))
        with deferred():  # an interrupt waits until the round is handed over (and, not behind, written)
            writes.submit(write)
            if not behind:
                writes.drain()
        _stop_if_every_client_failed(record, strategy.rejection_reasons, config.delta)
        _stop_if_rounds_empty(rows, strategy.rejection_reasons, config.delta)

    # Names this training job across resumes: DP-SGD clients keep their record-level accountant under it.
    job_id = checkpoint.job_id if checkpoint is not None and checkpoint.job_id else uuid.uuid4().hex
    writer.update(job_id=job_id, privacy=_privacy_record(
        config, strategy.accountant.has_guarantee, strategy.accountant.method, strategy.accountant.noise_multiplier,
        **({"randomness": "fixed privacy-seed (repeatable, for experiments)", "epsilon_void_against": SEEDED_VOID}
           if strategy.randomness.seed_is_fixed else {"randomness": "OS entropy (ChaCha20, 256-bit keys)"}),
        **_sampler_record(strategy, numel, config.rounds),
        **_secure_aggregation_record(config, strategy.secure_aggregation)))
    discovery_started = time.perf_counter()
    _stage("discovering %d clients…", config.population)
    strategy.discover(grid, config.population, config.round_timeout, identify=strategy.randomness.seed_is_fixed)
    writer.update(discovery_seconds=time.perf_counter() - discovery_started)
    first_round = 1
    if checkpoint is not None:
        initial = ArrayRecord(checkpoint.model)
        strategy.accountant.load_state_dict(checkpoint.accountant)
        if strategy.adaptive_clipping is not None and checkpoint.adaptive_clipping is not None:
            strategy.adaptive_clipping.load_state_dict(checkpoint.adaptive_clipping)
        if checkpoint.server_optimizer is not None:
            strategy.server_optimizer.load_state_dict(checkpoint.server_optimizer)
        first_round = checkpoint.round + 1
        log(INFO, "resuming after round %d (ε so far %.4g)", checkpoint.round, strategy.accountant.epsilon())
    _stage("round %d of %d…", first_round, config.rounds)
    try:
        result = strategy.start(grid, initial, num_rounds=config.rounds, timeout=config.round_timeout,
                                train_config=ConfigRecord({JOB_ID: job_id}),
                                evaluate_fn=None if behind else run.evaluate_fn,
                                on_round=on_round, first_round=first_round, runner=runner_for(grid))
    finally:
        with deferred():  # finished rounds are written however the loop ended (an interrupt waits for them)
            writes.close()
    return result.arrays, strategy.accountant.epsilon()


def _stop_if_every_client_failed(record: RoundRecord, reasons: dict[str, str], delta: float) -> None:
    """Stop a run whose every sampled client raised this round (nothing can train), quoting why and the ε spent."""
    failed = record.rejections.get(Rejection.CLIENT_ERROR, 0)
    if record.clients_sampled and failed == record.clients_sampled:
        released = "nothing was released" if record.failure else "the round's noise was released all the same"
        raise RuntimeError(f"round {record.round}: every sampled client failed ({failed} of {record.clients_sampled}): "
                           f"{client_error_summary(reasons.get(Rejection.CLIENT_ERROR, ''))}; {released}: "
                           f"ε = {record.epsilon:.4g} (δ = {delta:g}) spent so far")


def _stop_if_rounds_empty(rounds: list[dict], reasons: dict[str, str], delta: float) -> None:
    """Stop a run whose last :data:`MAX_EMPTY_IN_A_ROW` rounds had no accepted contribution, quoting why."""
    empty = list(itertools.takewhile(lambda r: r.get("failure"), reversed(rounds)))
    if len(empty) < MAX_EMPTY_IN_A_ROW:
        return
    last = empty[0]
    first = ", ".join(client_error_summary(reason, 200) for reason in reasons.values())
    raise RuntimeError(f"rounds {last['round'] - len(empty) + 1}–{last['round']} had no accepted contribution: "
                       f"{last['failure']}" + (f"; first reasons: {first}" if first else "")
                       + f"; ε = {last['epsilon']:.4g} (δ = {delta:g}) spent so far. Fix the clients (their "
                       "replies are described in the README, 'Bringing an existing Flower app') and continue with "
                       "--resume")


def run_flower_baseline(grid: Grid, config: RunConfig, run: ServerRun) -> tuple[ArrayRecord, float]:
    """Flower's accounted DP wrapper over FedAvg (:mod:`fedhog.flower_baseline`); no checkpoints."""
    from .flower_baseline import run_flower_dp

    writer, monitor = run.writer, run.monitor

    def on_round(record: RoundRecord, arrays: ArrayRecord) -> None:
        if stop_requested(writer.directory):
            raise KeyboardInterrupt("stopped by its launcher")
        run.diagnose(record, arrays)
        if writer.add_round(record):
            monitor.write_snapshot(writer.directory / SNAPSHOT_NAME)
        monitor.observe_round(record)

    writer.update(privacy=_privacy_record(config, True, "flower-rdp-no-amplification", config.noise_multiplier,
                                          randomness="Flower's: NumPy's global generator (Mersenne Twister, "
                                          "not for deployment)"))
    return run_flower_dp(grid, config, run.initial, run.evaluate_fn, on_round)


#: Each ``aggregator`` (:data:`fedhog.aggregators.AGGREGATOR_REGISTRY`) -> the ServerApp's rounds for it, on a grid,
#: after σ is calibrated and the initial model evaluated: the final model and ε.
SERVERS: dict[str, Callable[[Grid, RunConfig, ServerRun], tuple[ArrayRecord, float]]] = {
    "fedhog": run_secure_aggregator, "flower-dp": run_flower_baseline}


def _secure_aggregation_record(config: RunConfig, settings: SecAggSettings | None) -> dict[str, object]:
    """What ``metrics.json`` says of secure aggregation (nothing when it is off): its δ charges, its noise."""
    if settings is None:
        return {}
    record = {"secure_aggregation": config.secure_aggregation, "secagg_granularity": settings.lattice.granularity}
    if settings.noise is None:
        return {**record, "noise": "central", "secagg_small_cohort_delta": small_cohort_delta(
            config.sampling, config.sampling_rate, config.population, config.rounds)}
    noise = settings.noise  # fixed-size cohorts only (K ≥ 2): no small-cohort δ; its σ replaces the config's
    return {**record, **noise.record(), "noise_multiplier": noise.noise_multiplier}


#: Whom a seeded run's ε does not protect against: its noise can be recomputed from the seed, and a seed
#: below 2⁶³ (all a TOML integer holds) is found from two released models by trying seeds in order.
SEEDED_VOID = "anyone who holds the config or can guess privacy-seed: the noise can be recomputed and subtracted"


def _sampler_record(strategy: SecureAggregator, numel: int, rounds: int) -> dict[str, object]:
    """How the noise is drawn, and what its sampler adds to (ε, δ) over the planned rounds (included in ε)."""
    strategy.cover_sampler(numel)
    slack = strategy.accountant.sampler_slack(rounds)
    if slack is None:  # no guarantee
        return {}
    return {"noise_sampler": sampler_label(),
            "sampler_epsilon_slack": slack.epsilon, "sampler_delta_slack": slack.delta}


def _privacy_record(config: RunConfig, has_guarantee: bool, accountant: str,
                    accountant_noise_multiplier: float | None, **details: object) -> dict[str, object]:
    """The ``privacy`` entry of ``metrics.json``: what was run, how it is accounted, where its noise comes from."""
    return {
        "aggregator": config.aggregator,
        "mechanism": config.mechanism,
        "has_guarantee": has_guarantee,
        "accountant": accountant,
        "noise_multiplier": config.noise_multiplier,
        "target_epsilon": config.target_epsilon if config.target_epsilon > 0 else None,
        "accountant_noise_multiplier": accountant_noise_multiplier,
        "delta": config.delta,
        **details,
    }
