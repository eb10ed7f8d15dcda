"""A real local deployment (SuperLink, SuperNodes, `flwr run`) gives the in-process engine's run and leaves
nothing behind.

Every ClientApp message costs a fresh process here (~6 s for a trivial one, ~10 s
with fedhog's imports), so the deployments are 2 nodes and 1–2 rounds.
"""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import read_metrics

from fedhog.config import ConfigError, RunConfig
from fedhog.deploy import (
    DeployError,
    LocalFederation,
    _check_finished,
    _last_error,
    deploy_local,
    generate_tls_files,
    marked_processes,
    run_on_local_federation,
)
from fedhog.results import config_to_toml

pytestmark = pytest.mark.usefixtures("private_dirs")  # never ~/.flwr, whatever deploy does
SETTINGS = {"dataset": "digits", "model": "logreg", "population": 2, "sampling-rate": 1.0, "rounds": 2,
            "partitioner": "iid", "privacy-seed": 11, "noise-multiplier": 0.5, "clipping-norm": 2.0}


def _processes_using(workdir: Path) -> list[str]:
    """Live processes whose FLWR_HOME is the deployment's: found without deploy's own marker."""
    needle = f"FLWR_HOME={workdir.resolve() / 'flwr-home'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "environ").read_bytes().split(b"\0"):
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name}: {command}")
        except OSError:
            continue
    return found


def _config(tmp_path: Path, name: str, **overrides) -> RunConfig:
    return RunConfig().with_overrides({**SETTINGS, **overrides, "results-dir": str(tmp_path / name)})


# --- fast ------------------------------------------------------------------------
def test_population_must_equal_the_number_of_nodes(tmp_path):
    with pytest.raises(ConfigError, match=r"population=2 .*nodes=3"):
        deploy_local(_config(tmp_path, "run"), nodes=3, workdir=tmp_path / "work")
    assert not (tmp_path / "run").exists()


def test_throwaway_certificates_verify_for_127_0_0_1_and_localhost(tmp_path):
    files = generate_tls_files(tmp_path / "tls")
    assert files.keyfile.stat().st_mode & 0o077 == 0
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(files.certfile, files.keyfile)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]

        def serve(connections: int) -> None:
            for _ in range(connections):
                connection, _ = listener.accept()
                with server_context.wrap_socket(connection, server_side=True) as tls:
                    tls.sendall(b"ok")

        server = threading.Thread(target=serve, args=(2,), daemon=True)
        server.start()
        client_context = ssl.create_default_context(cafile=str(files.ca_certfile))
        for host in ("127.0.0.1", "localhost"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    client_context.wrap_socket(raw, server_hostname=host) as tls:
                assert tls.recv(2) == b"ok"
        server.join(timeout=10)


@pytest.mark.subprocess
def test_stop_ends_detached_grandchildren(tmp_path):
    """Flower detaches its SuperExec and app processes; stop() finds them by the deployment's marker."""
    federation = LocalFederation(1, tmp_path / "work", tmp_path / "logs")
    parent = subprocess.Popen(["bash", "-c", "setsid sleep 300 & sleep 300"], env=federation.env,
                              start_new_session=True)
    deadline = time.monotonic() + 10
    while len(marked_processes(federation.deploy_id)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(marked_processes(federation.deploy_id)) == 3  # bash and two sleeps
    assert federation.stop() == []
    assert parent.wait(timeout=5) != 0
    assert marked_processes(federation.deploy_id) == []


def test_a_run_the_serverapp_rejected_is_an_error_that_quotes_it(tmp_path):
    """`flwr run --stream` exits with 0 when the ServerApp raises: the results folder decides."""
    (tmp_path / "flwr.log").write_text(
        "INFO :      Start `flwr-serverapp` process\n"
        "  File \".../fedhog/config.py\", line 214, in _check\n"
        "fedhog.config.ConfigError: sampling-rate=0.3 is not allowed; expected a rate whose ...\n"
        "ERROR :     Exit Code: 201\n")
    with pytest.raises(DeployError, match=r"status=None\): fedhog.config.ConfigError: sampling-rate=0.3"):
        _check_finished(tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: population"}))
    with pytest.raises(DeployError, match=r"status='failed'\): RuntimeError: population"):
        _check_finished(tmp_path)
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "finished"}))
    assert _check_finished(tmp_path) == tmp_path


def test_flwr_cli_errors_are_quoted_from_their_box(tmp_path):
    (tmp_path / "flwr.log").write_text(
        "Using SuperLink: fedhog-local (127.0.0.1:43175)\n"
        "╭─ Error ───────────────────────────────────╮\n"
        "│ [code: 15] Invalid run configuration.     │\n"
        "╰───────────────────────────────────────────╯\n")
    assert _last_error(tmp_path / "flwr.log") == "[code: 15] Invalid run configuration."


# --- real processes ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.subprocess
def test_a_deployment_over_tls_matches_the_inprocess_engine(tmp_path):
    """Over TLS with throwaway certificates (the other deployments here are insecure), two rounds."""
    from fedhog.client_app import app as client_app
    from fedhog.engines.inprocess import run_in_process
    from fedhog.server_app import app as server_app

    config = _config(tmp_path, "deployed")
    started = time.perf_counter()
    directory = deploy_local(config, nodes=2, tls=True, workdir=tmp_path / "work", timeout=300)
    print(f"deployment: {time.perf_counter() - started:.1f} s")
    assert directory == (tmp_path / "deployed").resolve()
    assert _processes_using(tmp_path / "work") == []
    assert "https://127.0.0.1:" in (directory / "logs" / "superlink.log").read_text()
    connection = (tmp_path / "work" / "flwr-home" / "config.toml").read_text()
    assert "root-certificates" in connection and "insecure" not in connection
    assert {p.name for p in (directory / "logs").iterdir()} == {"superlink.log", "supernode-0.log",
                                                                 "supernode-1.log"}
    run_in_process(server_app, client_app, 2, _config(tmp_path, "inprocess").to_mapping())

    deployed, in_process = (read_metrics(tmp_path / name)
                            for name in ("deployed", "inprocess"))
    assert deployed["status"] == in_process["status"] == "finished"
    for a, b in zip(deployed["rounds"], in_process["rounds"], strict=True):
        assert a["clients_sampled"] == b["clients_sampled"] == 2
        assert a["clients_accepted"] == b["clients_accepted"] == 2
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-9)
    model_a = torch.load(tmp_path / "deployed" / "final_model.pt")
    model_b = torch.load(tmp_path / "inprocess" / "final_model.pt")
    assert model_a.keys() == model_b.keys()
    for key in model_a:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("noise", [{}, {"sampling": "fixed", "noise": "distributed"}], ids=["central", "distributed"])
def test_secure_aggregation_runs_on_a_local_deployment(tmp_path, noise):
    """Each SecAgg+ stage is a message to a fresh flwr-clientapp process: the protocol's keys must survive in
    the SuperNode's context between them, and with distributed noise each process recomputes the same plan.
    Same privacy seed: the in-process engine unmasks the same sum."""
    from fedhog.client_app import app as client_app
    from fedhog.engines.inprocess import run_in_process
    from fedhog.server_app import app as server_app

    secure = {"population": 3, "rounds": 1, "secure-aggregation": "secagg+", **noise}
    directory = deploy_local(_config(tmp_path, "deployed", **secure), nodes=3, workdir=tmp_path / "work",
                             timeout=300)
    assert _processes_using(tmp_path / "work") == []
    run_in_process(server_app, client_app, 3, _config(tmp_path, "inprocess", **secure).to_mapping())
    deployed, in_process = (read_metrics(tmp_path / name)
                            for name in ("deployed", "inprocess"))
    assert deployed["status"] == "finished" and deployed["rounds"][0]["failure"] == ""
    assert deployed["rounds"][0]["clients_accepted"] == in_process["rounds"][0]["clients_accepted"] == 3
    assert deployed["rounds"][0]["epsilon"] == pytest.approx(in_process["rounds"][0]["epsilon"], rel=1e-12)
    assert deployed["rounds"][0]["epsilon"] > 0
    model_a = torch.load(directory / "final_model.pt")
    model_b = torch.load(tmp_path / "inprocess" / "final_model.pt")
    for key in model_a:
        torch.testing.assert_close(model_a[key], model_b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_during_a_run_leaves_no_process(tmp_path, signum):
    config = _config(tmp_path, "interrupted", rounds=20)
    # the process's owner handles its signals, as the CLI does
    script = ("import sys; from pathlib import Path; from fedhog import interrupts; "
              "from fedhog.config import load_config; from fedhog.deploy import deploy_local; "
              "\nwith interrupts.handled(): deploy_local(load_config(sys.argv[1]), nodes=2, workdir=Path(sys.argv[2]))")
    (tmp_path / "run.toml").write_text(config_to_toml(config))
    driver = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "run.toml"), str(tmp_path / "work")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "interrupted" / "metrics.json").exists():  # the ServerApp is running
        assert driver.poll() is None, driver.communicate()[0]
        assert time.monotonic() < deadline, "the ServerApp did not start"
        time.sleep(0.5)
    assert _processes_using(tmp_path / "work")
    driver.send_signal(signum)
    output = driver.communicate(timeout=60)[0]
    if signum == signal.SIGINT:
        assert driver.returncode != 0 and "KeyboardInterrupt" in output
    else:
        assert driver.returncode == 128 + signal.SIGTERM, output
    assert _processes_using(tmp_path / "work") == []


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_run_under_a_nodes_floor_is_refused_on_a_local_deployment(tmp_path):
    """The SuperNodes' operator sets min-noise-multiplier=0.8 in --node-config; the run is submitted with σ = 0.5:
    each ClientApp refuses it in one line naming the floor, and no client contributes."""
    floors = f'min-noise-multiplier=0.8 state-dir="{tmp_path / "state"}"'
    with pytest.raises(DeployError, match=r"min-noise-multiplier=0\.8 \(this node's floor\): the run asks for noise "
                                          r"multiplier 0\.5"):
        run_on_local_federation(_config(tmp_path, "floored", rounds=1, **{"privacy-seed": -1}), 2, tmp_path / "work",
                                timeout=300, node_config=floors)
    assert _processes_using(tmp_path / "work") == []
    metrics = read_metrics(tmp_path / "floored")
    assert metrics["status"] == "failed" and metrics["rounds"][0]["clients_accepted"] == 0
    assert "Traceback" not in metrics["error"] and "/" not in metrics["error"].split("RoundRefused")[1]
