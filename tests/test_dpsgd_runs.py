"""DP-SGD runs through the in-process engine: private client noise, and a record-level ε that survives resume."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import pytest
from flwr.app import Message
from flwr.common import MessageType
from helpers import read_metrics, read_run, same_state

from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.engines.inprocess import InProcessGrid
from fedhog.server_app import run_server

logging.getLogger("absl").setLevel(logging.ERROR)

pytestmark = pytest.mark.usefixtures("fresh_cache")  # the clients' accountants live under it
TINY = {
    "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 0.5, "rounds": 4,
    "partitioner": "iid", "mechanism": "gaussian", "client-dp": "dpsgd", "batch-size": 32,
}


class _Interrupted(RuntimeError):
    """The server stopped before a round, as a killed process would."""


class _GridThatStops(InProcessGrid):
    """Raises when the server sends its ``stop_at``-th round of train instructions, before any client trains."""

    def __init__(self, *args, stop_at: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stop_at, self.train_rounds = stop_at, 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        if not any(m.metadata.message_type == MessageType.QUERY for m in messages):  # a round, maybe empty
            self.train_rounds += 1
            if self.train_rounds == self.stop_at:
                raise _Interrupted(f"stopped at the start of round {self.stop_at}")
        return super().send_and_receive(messages, timeout=timeout)


def _run(results: Path, **overrides) -> tuple[dict, dict]:
    """metrics.json and the final model of a run in ``results``."""
    config = RunConfig().with_overrides({**TINY, **overrides, "results-dir": str(results)})
    run_server(InProcessGrid(client_app, config.population, config.to_mapping()), config)
    return read_run(results)


@pytest.mark.slow
def test_client_noise_is_private_by_default_and_repeatable_only_with_a_privacy_seed(tmp_path):
    # every client in every round (q = 1) and no server noise: the only randomness left is the clients' DP-SGD
    quiet_server = {"sampling-rate": 1.0, "noise-multiplier": 0.0, "rounds": 1}  # one round of DP-SGD noise shows it
    _, default_a = _run(tmp_path / "a", **quiet_server)
    _, default_b = _run(tmp_path / "b", **quiet_server)
    _, seeded_a = _run(tmp_path / "c", **quiet_server, **{"privacy-seed": 4})
    _, seeded_b = _run(tmp_path / "d", **quiet_server, **{"privacy-seed": 4})
    assert not same_state(default_a, default_b)  # privacy-seed = -1: noise and batches from each client's OS entropy
    assert same_state(seeded_a, seeded_b)
    assert not same_state(seeded_a, default_a)


@pytest.mark.slow
def test_a_resumed_run_spends_the_record_level_epsilon_of_a_never_stopped_one(tmp_path):
    seeded = {"privacy-seed": 11}
    reference, reference_model = _run(tmp_path / "whole", **seeded)

    config = RunConfig().with_overrides({**TINY, **seeded, "results-dir": str(tmp_path / "broken")})
    with pytest.raises(_Interrupted):
        run_server(_GridThatStops(client_app, config.population, config.to_mapping(), stop_at=3), config)
    assert len(read_metrics(tmp_path / "broken")["rounds"]) == 2
    resumed, resumed_model = _run(tmp_path / "broken", **seeded, resume=True)

    epsilons = [r["sample_level_epsilon_max"] for r in reference["rounds"]]
    assert resumed["resumed_after_round"] == 2
    assert [r["sample_level_epsilon_max"] for r in resumed["rounds"]] == epsilons
    assert same_state(resumed_model, reference_model)
    # the test can tell: a client of rounds 3-4 had trained before, so an accountant restarted on resume
    # would report the ε of fewer rounds than the one spent
    assert max(epsilons[2:]) > max(epsilons[:2])
