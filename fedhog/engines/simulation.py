"""Flower's Simulation Engine (Ray) behind a SuperLink of fedhog's own: ``fedhog run --engine simulation``.

``flwr run`` alone would start Flower's shared local SuperLink (fixed ports,
``~/.flwr``), leave it running after the run and keep the caller's working
directory as the ServerApp's. :func:`simulate_local` runs on the local-federation
driver of :mod:`fedhog.deploy` instead: the SuperLink (simulation mode), its
SuperExec, ``flwr-simulation`` and Ray run in a private temporary folder (also
Ray's, unless ``RAY_TMPDIR`` is set) and are stopped when the run ends, fails
or is interrupted.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import ConfigError, RunConfig
from ..deploy import run_on_local_federation

RAY_TMPDIR_MAX_CHARS = 40  # Ray's socket paths (<tmp>/session_<date>_<pid>/sockets/plasma_store) must stay < 107 bytes


def simulate_local(config: RunConfig, client_cpus: int = 1, *, timeout: float | None = None,
                   startup_timeout: float = 180.0) -> Path:
    """Run ``config`` on Flower's Simulation Engine behind a SuperLink of fedhog's own; return the results folder.

    Parameters
    ----------
    config : RunConfig
        The run: ``population`` simulated SuperNodes.
    client_cpus : int
        CPUs Ray reserves for each simulated client.
    timeout, startup_timeout : float
        As in :func:`fedhog.deploy.deploy_local`.

    Returns
    -------
    Path
        The absolute results folder, with ``flwr.log`` and ``logs/superlink.log``.
    """
    if client_cpus < 1:
        raise ConfigError(f"client-cpus={client_cpus} is not allowed; expected an integer ≥ 1")
    federation_config = f"num-supernodes={config.population} client-resources-num-cpus={client_cpus}"
    return run_on_local_federation(config, config.population, timeout=timeout, startup_timeout=startup_timeout,
                                   federation_config=federation_config, environment=ray_environment)


def ray_environment(workdir: Path) -> dict[str, str]:
    """Ray's folder inside the work folder (removed with it), unless ``RAY_TMPDIR`` is set or the path is too long."""
    if "RAY_TMPDIR" not in os.environ and len(str(workdir / "ray")) <= RAY_TMPDIR_MAX_CHARS:
        return {"RAY_TMPDIR": str(workdir / "ray")}
    return {}
