"""Flower's Simulation Engine (`flwr run`, Ray) and the in-process engine give the same run.

Both drive the very same ServerApp and ClientApp; sampling is keyed by
partition id and replies are aggregated in partition order, so with a fixed
seed the two differ at most by floating-point summation inside torch kernels.
The Simulation Engine's SuperLink, SuperExec, flwr-simulation and Ray are
fedhog's own: they run in a private folder and are gone when `fedhog run` exits.

Cost: each Simulation Engine run is a `fedhog run` subprocess that starts a SuperLink and Ray (the expensive part);
the in-process reference runs in this process (`cli.main`, the same command without the interpreter's start-up),
and the module's runs share one data cache, so the digits partitions are made once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, set_args
from tagged import new_tag, tagged

from fedhog import cli

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
CHECKOUT = Path(__file__).resolve().parents[1]

SETTINGS = ["dataset=\"digits\"", "model=\"logreg\"", "population=6", "sampling-rate=0.5", "rounds=3",
            "partitioner=\"iid\"", "privacy-seed=11", "noise-multiplier=0.5", "clipping-norm=2.0"]


def _fedhog_run(engine: str, results, env, settings=SETTINGS, seen: dict | None = None) -> dict:
    """Run `fedhog run` to the end; with ``seen``, collect every process it started (pid -> command, cwd)."""
    args = [sys.executable, "-m", "fedhog.cli", "run", "--engine", engine,
            *set_args(*settings, f'results-dir="{results}"')]
    tag = new_tag()
    with subprocess.Popen(args, env={**env, **tag}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=CHECKOUT) as run:
        deadline = time.monotonic() + 420
        while run.poll() is None and seen is not None and time.monotonic() < deadline:
            seen.update(tagged(tag))
            time.sleep(0.5)
        output = run.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
    assert run.returncode == 0, output + _tail(results / "flwr.log")
    assert tagged(tag) == {}, "processes left behind"  # fedhog's SuperLink, SuperExec, flwr-simulation, Ray
    return read_metrics(results)


def _in_process(results, env, monkeypatch: pytest.MonkeyPatch, settings=SETTINGS) -> dict:
    """The same `fedhog run --engine inprocess`, in this process, with the runs' cache."""
    monkeypatch.setenv("FEDHOG_CACHE", env["FEDHOG_CACHE"])
    assert cli.main(["run", "--engine", "inprocess", *set_args(*settings, f'results-dir="{results}"')]) == 0
    return read_metrics(results)


def _tail(path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's data cache: every run here uses the same digits partitions."""
    return tmp_path_factory.mktemp("engines-cache")


@pytest.fixture
def env(cache):
    """The runs' environment; Ray's socket paths must stay under 107 bytes, so its folder is short."""
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as ray:
        yield {**os.environ, "FEDHOG_CACHE": str(cache),
               "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "RAY_TMPDIR": os.environ.get("RAY_TMPDIR", ray)}


def test_simulation_engine_matches_inprocess(tmp_path, env, monkeypatch):
    seen: dict[int, tuple[str, str]] = {}
    simulated = _fedhog_run("simulation", tmp_path / "simulation", env, seen=seen)
    in_process = _in_process(tmp_path / "inprocess", env, monkeypatch)

    # run from the checkout, yet no Flower process works in it: a later `flwr run` cannot write into it
    superlinks = [cwd for command, cwd in seen.values() if "flower-superlink" in command]
    assert superlinks and all(not Path(cwd).is_relative_to(CHECKOUT) for cwd in superlinks), seen
    assert all(not Path(cwd).is_relative_to(CHECKOUT) for command, cwd in seen.values()
               if "fedhog.cli" not in command), seen

    assert simulated["status"] == in_process["status"] == "finished"
    for a, b in zip(simulated["rounds"], in_process["rounds"], strict=True):
        assert a["clients_sampled"] == b["clients_sampled"]
        assert a["clients_accepted"] == b["clients_accepted"]
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-9)
    model_a = torch.load(tmp_path / "simulation" / "final_model.pt")
    model_b = torch.load(tmp_path / "inprocess" / "final_model.pt")
    for key in model_a:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6)


def test_flowers_dp_baseline_runs_under_the_simulation_engine(tmp_path, env):
    """Flower samples node ids and draws noise from global generators, so the engines differ in the draws;
    the released rounds and their ε (three Gaussian releases, no amplification) do not."""
    from dp_accounting import dp_event, rdp

    settings = [s for s in SETTINGS if not s.startswith("noise-multiplier")] + [
        "aggregator=\"flower-dp\"", "mechanism=\"gaussian\"", "sampling=\"fixed\"", "accountant=\"rdp\"",
        "noise-multiplier=1.5"]
    metrics = _fedhog_run("simulation", tmp_path / "simulation", env, settings)
    assert metrics["status"] == "finished"
    for record in metrics["rounds"]:
        assert record["clients_accepted"] == 3
        reference = rdp.RdpAccountant().compose(dp_event.GaussianDpEvent(1.5), record["round"]).get_epsilon(1e-5)
        assert record["epsilon"] == pytest.approx(reference, rel=1e-9)


@pytest.mark.parametrize("noise", [[], ["sampling=\"fixed\"", "noise=\"distributed\""]],
                         ids=["central", "distributed"])
def test_secure_aggregation_runs_under_the_simulation_engine(tmp_path, env, noise, monkeypatch):
    """SecAgg+'s client state lives in each node's context between the stages' messages, which the
    Simulation Engine keeps as the in-process engine does: with a fixed privacy seed the clients draw
    the same ξ, roundings and (distributed) noise shares, so both engines unmask the same sums."""
    settings = [*SETTINGS, "secure-aggregation=\"secagg+\"", "mechanism=\"hog\"", *noise]
    simulated = _fedhog_run("simulation", tmp_path / "simulation", env, settings)
    in_process = _in_process(tmp_path / "inprocess", env, monkeypatch, settings)
    assert simulated["status"] == in_process["status"] == "finished"
    for a, b in zip(simulated["rounds"], in_process["rounds"], strict=True):
        assert a["clients_accepted"] == b["clients_accepted"] and a["failure"] == b["failure"]
        assert a["clients_accepted"] == (0 if a["failure"] else a["clients_sampled"])  # nobody dropped out
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
    assert simulated["rounds"][-1]["epsilon"] > 0
    model_a = torch.load(tmp_path / "simulation" / "final_model.pt")
    model_b = torch.load(tmp_path / "inprocess" / "final_model.pt")
    for key in model_a:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6)
