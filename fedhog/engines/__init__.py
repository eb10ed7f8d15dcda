"""The engines that run fedhog's ServerApp and ClientApp on one machine, and the one registry of them.

:mod:`~fedhog.engines.inprocess` (a Flower Grid in this process),
:mod:`~fedhog.engines.vectorized` (that Grid training each cohort as one
batch, with :mod:`~fedhog.engines.cohort`) and
:mod:`~fedhog.engines.simulation` (Flower's Simulation Engine, Ray).
``fedhog run --engine``, :func:`fedhog.run` and sweeps name an engine of
:data:`ENGINES` and start a run the same way: :func:`check_run`, then
:func:`claim_run`, then :func:`run_engine`. The engines' heavy imports
(torch, Flower, Ray) happen when one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import BINARY_METRICS, ConfigError, RunConfig, check_device


@dataclass(frozen=True)
class Engine:
    """One way of running the ServerApp and its clients on this machine (``fedhog run --engine NAME``).

    ``run(config, client_cpus)`` trains to the end and raises on failure. With
    ``in_process`` the CLI runs it in the main thread and shows the progress
    from a display thread; otherwise ``run`` shows it.
    """

    help: str
    run: Callable[[RunConfig, int], Any]
    in_process: bool


def _simulation(config: RunConfig, client_cpus: int) -> None:
    from .simulation import simulate_local

    simulate_local(config, client_cpus)


def _inprocess(config: RunConfig, client_cpus: int) -> None:
    from ..client_app import app as client_app
    from ..server_app import app as server_app
    from .inprocess import run_in_process

    run_in_process(server_app, client_app, config.population, config.to_mapping())


def _vectorized(config: RunConfig, client_cpus: int) -> None:
    from ..client_app import app as client_app
    from ..server_app import app as server_app
    from .vectorized import run_vectorized

    run_vectorized(server_app, client_app, config)


ENGINES: dict[str, Engine] = {
    "simulation": Engine("Flower's Simulation Engine (Ray) through `flwr run`, on a SuperLink fedhog starts "
                         "and stops", _simulation, in_process=False),
    "inprocess": Engine("the same apps through an in-process Flower Grid: no Ray, no SuperLink", _inprocess,
                        in_process=True),
    "vectorized": Engine("the in-process Grid training each sampled cohort as one batch (torch.func.vmap): the "
                         "same results, many times faster", _vectorized, in_process=True),
}
DEFAULT_ENGINE = "vectorized"  # the same results as Flower's engines (tests/test_vectorized.py), fastest


def engine_named(name: str) -> Engine:
    """The engine called ``name``; a :class:`ConfigError` naming it and the allowed names if there is none."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ConfigError(f"engine={name!r} is not allowed; expected one of {', '.join(ENGINES)}") from None


def run_engine(name: str, config: RunConfig, client_cpus: int = 1) -> None:
    """Run ``config`` to the end on the engine ``name`` (its results folder already claimed: :func:`claim_run`)."""
    engine = engine_named(name)
    if config.shards > 1 and name != "vectorized":
        raise ConfigError(f"shards={config.shards} is not allowed with engine={name!r}; expected 1 (only the "
                          "vectorized engine splits a cohort into shards)")
    engine.run(config, client_cpus)


def check_run(config: RunConfig) -> None:
    """The checks before a run starts on any engine: the device exists, :func:`check_inputs`, and the machine can
    hold its accounting (:func:`~fedhog.feasibility.check_feasible`)."""
    from ..feasibility import check_feasible

    check_device(config.device)
    check_inputs(config)
    check_feasible(config)


def check_inputs(config: RunConfig) -> None:
    """Load a table, build a user's model and check the metrics now, so bad input fails before any engine starts.

    Raises :class:`ConfigError` naming the key (``dataset``, ``label-column``,
    ``model``, ``metrics``, ...). Built-in datasets and models are not loaded.
    """
    from ..data import dataset_info, tabular_source
    from ..models import build_model, is_factory

    ranking = any(name in BINARY_METRICS for name in config.test_metrics)
    if tabular_source(config.dataset) is None and not is_factory(config.model) and not ranking:
        return
    try:
        input_shape, num_classes = dataset_info(config.data_spec)
        config.check_metrics(num_classes)
        if is_factory(config.model):
            build_model(config.model, input_shape, num_classes, config.activation, config.normalization)
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None


def claim_run(config: RunConfig, launch: dict[str, Any], overwrite: bool = False) -> RunConfig:
    """Claim a new run's results folder (``results/<timestamp>`` when ``results-dir`` is empty), record ``launch``
    and the config there; return the config with that folder."""
    from ..results import claim_results_dir, default_results_dir, record_launch

    directory = claim_results_dir(Path(config.results_dir).resolve() if config.results_dir else default_results_dir(),
                                  overwrite)
    config = config.with_overrides({"results-dir": str(directory)})
    record_launch(directory, launch, config)
    return config
