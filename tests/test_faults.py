"""Faults on a real deployment: a SuperNode killed mid-run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import read_metrics

from fedhog.checkpoint import CheckpointError, load_checkpoint
from fedhog.config import RunConfig
from fedhog.deploy import deploy_local
from fedhog.privacy.accounting import ClientLevelAccountant

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.usefixtures("private_dirs")]


def _supernode_pid(flwr_home: Path, partition: int) -> int:
    """The flower-supernode process of this deployment that holds ``partition``."""
    needle = f"FLWR_HOME={flwr_home}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            command = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("flower-supernode" in part for part in command) and f"partition-id={partition}" in " ".join(command):
            return int(entry.name)
    raise AssertionError(f"no flower-supernode with partition-id={partition} under {flwr_home}")


ROUND_TIMEOUT = 180.0
"""Each train message starts a ``flwr-clientapp`` process (Python, torch, Flower, fedhog): on a loaded 2-core machine
that took longer than the 40 s this test gave a round, and all three rounds ran out with every reply late (43 s a
round). The dead node's slot does not wait for it: Flower reports it unavailable after two missed heartbeats."""


def test_a_supernode_killed_mid_run_is_recorded_and_the_run_completes(tmp_path):
    config = RunConfig().with_overrides({
        "dataset": "digits", "model": "logreg", "partitioner": "iid", "population": 3, "sampling-rate": 1.0,
        "rounds": 3, "noise-multiplier": 0.5, "clipping-norm": 2.0, "round-timeout": ROUND_TIMEOUT,
        "results-dir": str(tmp_path / "run")})
    workdir = tmp_path / "work"
    outcome: dict[str, object] = {}

    def deploy() -> None:
        try:
            outcome["results"] = deploy_local(config, nodes=3, workdir=workdir)
        except BaseException as error:  # reported below
            outcome["error"] = error

    runner = threading.Thread(target=deploy)
    runner.start()
    deadline = time.time() + 400
    while time.time() < deadline and runner.is_alive():
        try:
            if load_checkpoint(tmp_path / "run").round >= 1:
                break
        except CheckpointError:
            pass
        time.sleep(0.2)
    assert runner.is_alive(), outcome
    os.kill(_supernode_pid((workdir / "flwr-home").resolve(), 2), signal.SIGKILL)
    runner.join(timeout=600)
    assert "error" not in outcome, outcome.get("error")

    metrics = read_metrics(tmp_path / "run")
    assert metrics["status"] == "finished" and len(metrics["rounds"]) == 3
    last = metrics["rounds"][-1]
    assert last["clients_sampled"] == 3 and last["clients_accepted"] == 2  # the dead node's slot is recorded
    assert last["clients_sampled"] - last["clients_accepted"] == 1
    # every round was released, so ε is that of three compositions, dropout or not
    accountant = ClientLevelAccountant(config.noise_multiplier, "poisson", 1.0, 3, config.delta,
                                       accountant=config.accountant)
    for _ in range(3):
        accountant.compose_round()
    assert metrics["summary"]["epsilon"] == pytest.approx(accountant.epsilon(), rel=1e-9)
