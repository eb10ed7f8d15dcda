"""fedhog from Python: ``fedhog.run(config, **overrides)``, and ``fedhog.central_split(config)``, the exact data a
run trains and is tested on, for a central (non-federated) baseline."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import ConfigError, RunConfig, load_config
from .engines import DEFAULT_ENGINE, check_run, claim_run, engine_named, run_engine
from .flower_log import flower_log_level
from .results import mark_failed, mark_interrupted, read_run_document

if TYPE_CHECKING:
    from .data import ArrayData


@dataclass(frozen=True)
class RunResult:
    """A finished run: its results folder and its ``metrics.json``."""

    directory: Path
    document: dict[str, Any]

    @property
    def rounds(self) -> list[dict[str, Any]]:
        """One entry per round: ``accuracy``, ``auroc``, ``auprc`` (null when not measured), ``epsilon``, ..."""
        return self.document["rounds"]

    @property
    def summary(self) -> dict[str, Any]:
        """``final_<metric>`` and ``initial_<metric>`` of each of the run's ``metrics``, ``epsilon``, ``delta``,
        ``noise_multiplier`` (σ, calibrated when ``target-epsilon`` was given), ..."""
        return self.document["summary"]

    @property
    def noise_multiplier(self) -> float:
        """σ of the run: the configured one, or the one calibrated to ``target-epsilon``."""
        return self.document["privacy"]["noise_multiplier"]


class RunFailed(RuntimeError):
    """A run that started and did not finish; ``directory`` keeps what was done."""

    def __init__(self, message: str, directory: Path) -> None:
        super().__init__(message)
        self.directory = directory


def run(config: str | Path | Mapping[str, Any] | RunConfig | None = None, *, engine: str = DEFAULT_ENGINE,
        overwrite: bool = False, verbose: bool = False, **overrides: Any) -> RunResult:
    """Run one federated training, as ``fedhog run`` does, and return its results.

    Parameters
    ----------
    config : path, mapping, RunConfig or None
        A run-config TOML file, a mapping of config keys, a :class:`RunConfig`, or None for the defaults.
    engine : str
        ``vectorized`` (default; client by client where the run cannot be batched), ``inprocess``
        or ``simulation`` (Flower's Simulation Engine, see ``fedhog run --engine``).
    overwrite : bool
        Replace a run already in ``results-dir`` instead of refusing.
    verbose : bool
        Show Flower's and fedhog's INFO log (a line a round, ...); by default only warnings.
    **overrides
        Config keys, snake_case (``noise_multiplier=0.8``) or kebab-case (``**{"noise-multiplier": 0.8}``).

    Returns
    -------
    RunResult
        The results folder (a new ``results/<timestamp>`` when ``results-dir`` is empty) and its ``metrics.json``.

    Raises
    ------
    ConfigError
        Before anything runs: a bad key or value, a table or model factory that cannot be used.
    RunFailed
        The run started and failed; its folder says how far it got.
    """
    engine_named(engine)
    if isinstance(config, RunConfig):  # σ is calibrated from target-epsilon at the start: give one of the two
        config = {k: v for k, v in config.to_mapping().items()
                  if not (k == "noise-multiplier" and config.target_epsilon > 0)}
    values = None if config is None or isinstance(config, (str, Path)) else _kebab(config)
    resolved = load_config(values if values is not None else config, _kebab(overrides))
    check_run(resolved)
    resolved = claim_run(resolved, {"command": "run", "engine": engine, "client_cpus": 1}, overwrite)
    directory = Path(resolved.results_dir)
    try:
        with flower_log_level(logging.INFO if verbose else logging.WARNING):
            run_engine(engine, resolved)
    except ConfigError:
        raise
    except KeyboardInterrupt:  # what finished stays: fedhog run --resume <directory> continues it
        mark_interrupted(directory)
        raise
    except Exception as error:  # the ServerApp wrote the failure into metrics.json, unless it failed before
        mark_failed(directory, f"{type(error).__name__}: {error}")
        raise RunFailed(f"{type(error).__name__}: {error} (what was done is in {directory})", directory) from error
    document = read_run_document(directory) or {}
    if document.get("status") != "finished":
        mark_failed(directory, "the run ended without finishing")
        raise RunFailed(f"the run did not finish: {document.get('error', 'no metrics.json')} "
                        f"(what was done is in {directory})", directory)
    return RunResult(directory, document)


def central_split(config: str | Path | Mapping[str, Any] | RunConfig | None = None,
                  **overrides: Any) -> tuple[ArrayData, ArrayData]:
    """The train and test sets of a config's run, exactly as fedhog splits them, for a central baseline.

    ``train`` pools every client's training examples, in partition order (each client's validation share, the
    server's validation and proxy sets are left out, as they are from the clients' training); ``test`` is the set
    every round is evaluated on (:func:`fedhog.data.load_test_set`), disjoint from ``train``. A model trained
    centrally on ``train`` and tested on ``test`` is the ceiling a federated run of the same config compares with.

    Parameters
    ----------
    config, **overrides
        As for :func:`run` (``seed``, ``dataset``, ``population``, the partitioner... decide the split).

    Returns
    -------
    (ArrayData, ArrayData)
        ``(train, test)``, each with ``x`` (float32) and ``y`` (int64).
    """
    from .data import ArrayData, clients_training_data, load_test_set  # numpy and the datasets, not torch

    if isinstance(config, RunConfig):
        config = {k: v for k, v in config.to_mapping().items()
                  if not (k == "noise-multiplier" and config.target_epsilon > 0)}
    values = None if config is None or isinstance(config, (str, Path)) else _kebab(config)
    spec = load_config(values if values is not None else config, _kebab(overrides)).data_spec
    x, y, indices = clients_training_data(spec, list(range(spec.population)))
    rows = np.concatenate(indices) if indices else np.zeros(0, np.int64)
    return ArrayData(x[rows], y[rows]), load_test_set(spec)


def _kebab(values: Mapping[str, Any]) -> dict[str, Any]:
    """Config keys as the config files spell them: ``noise_multiplier`` -> ``noise-multiplier``."""
    return {key.replace("_", "-"): value for key, value in values.items()}
