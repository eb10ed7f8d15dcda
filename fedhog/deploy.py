"""Run fedhog on local Flower infrastructure that fedhog starts and stops: ``flwr run`` against its own SuperLink.

:func:`deploy_local` starts ``flower-superlink`` and ``flower-supernode``
processes on 127.0.0.1 (plain, or TLS with a throwaway CA from
:func:`generate_tls_files`); :func:`fedhog.engines.simulation.simulate_local`
starts a SuperLink in simulation mode (Flower's Simulation Engine, Ray) and no
SuperNode. Both run on :func:`run_on_local_federation`, which submits
the app with ``flwr run`` through a SuperLink connection in a private
``FLWR_HOME``, from a private temporary folder that is every process's working
directory (never the user's), show the progress from ``metrics.json`` and stop
every process they started, also on Ctrl-C, SIGTERM, errors and failed runs.
Runtime dependency installation is off everywhere. Flower's executables are
those of the running interpreter's environment (:func:`flower_scripts_dir`),
whatever ``PATH`` says.

Flower detaches some of its processes (the SuperLink's SuperExec, the ServerApp
and ClientApp processes) into sessions of their own, so process groups alone
do not reach them: every process of a deployment carries the environment
variable ``FEDHOG_DEPLOY_ID=<id>``, and :meth:`LocalFederation.stop` ends the
processes that carry the deployment's id.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType
from typing import IO

import psutil

from . import interrupts
from .app_bundle import write_app_bundle
from .choices import is_factory
from .config import ConfigError, RunConfig
from .progress import read_metrics_file, watch_metrics
from .results import clear_stop_request, config_to_toml, default_results_dir, request_stop

HOST = "127.0.0.1"
CONNECTION = "fedhog-local"
MARKER = "FEDHOG_DEPLOY_ID"
STOP_GRACE_SECONDS = 5.0


class DeployError(RuntimeError):
    """A local deployment that could not start, or a run on it that did not finish."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a CA and of a server certificate it signed."""

    ca_certfile: Path
    certfile: Path
    keyfile: Path


def generate_tls_files(directory: Path, hosts: Sequence[str] = (HOST, "localhost"), days: int = 2) -> TlsFiles:
    """Write a throwaway self-signed CA and a server certificate for ``hosts`` into ``directory``.

    Parameters
    ----------
    directory : Path
        Created if missing; receives ``ca.pem``, ``server.pem`` and ``server.key`` (mode 0600).
    hosts : sequence of str
        IP addresses and DNS names the server certificate is valid for (subject alternative names).
    days : int
        Validity of both certificates.

    Returns
    -------
    TlsFiles
        The paths, for ``--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile`` and ``--root-certificates``.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    def alternative_name(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    def usage(**allowed: bool) -> x509.KeyUsage:
        flags = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment",
                 "key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
        return x509.KeyUsage(**{flag: allowed.get(flag, False) for flag in flags})

    now = datetime.now(UTC)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_subject = name("fedhog throwaway CA")
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_subject).issuer_name(ca_subject)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server_cert = (
        x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca_subject)
        .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([alternative_name(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage(digital_signature=True, key_encipherment=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca_certfile.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.certfile.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    key = server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption())
    descriptor = os.open(files.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key)
    return files


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def flower_scripts_dir() -> Path:
    """The folder of Flower's executables (``flwr``, ``flower-superlink``, ...) for the running interpreter.

    Beside ``sys.executable`` in a venv or pipx, the interpreter's scripts folder
    otherwise (a ``--user`` install has its own); ``PATH`` only as the last
    resort, so that an unactivated venv's ``fedhog`` never runs another
    environment's Flower.
    """
    candidates = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))]
    with contextlib.suppress(KeyError):
        candidates.append(Path(sysconfig.get_path("scripts", f"{os.name}_user")))
    on_path = shutil.which("flwr")
    candidates += [Path(on_path).parent] if on_path else []
    for folder in candidates:
        if (folder / "flwr").is_file() and (folder / "flower-superlink").is_file():
            return folder
    raise DeployError(f"Flower's executables (flwr, flower-superlink) are neither beside {sys.executable} "
                      "nor on PATH; reinstall fedhog (it depends on flwr[simulation])")


def marked_processes(deploy_id: str) -> list[int]:
    """Ids of the live processes whose environment carries ``FEDHOG_DEPLOY_ID=deploy_id``."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(MARKER) == deploy_id and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):  # gone, or another user's
            continue
    return found


class LocalFederation:
    """A SuperLink and ``nodes`` SuperNodes on 127.0.0.1; a context manager that stops them all.

    Parameters
    ----------
    nodes : int
        SuperNodes to start; node i gets ``--node-config 'partition-id=i num-partitions=nodes'``.
        With ``simulation``, the simulated SuperNodes (none is started as a process).
    workdir : Path
        Holds ``flwr-home/`` (the private ``FLWR_HOME`` and its ``config.toml``); every process runs here.
    log_dir : Path
        Receives ``superlink.log`` and ``supernode-<i>.log``.
    tls : TlsFiles or None
        Serve the SuperLink over TLS with these files; ``None``: plain HTTP (``--insecure``).
    startup_timeout : float
        Seconds to wait for the SuperLink to listen and for every SuperNode to be online.
    simulation : bool
        Start the SuperLink in simulation mode (``--simulation``): runs go to Flower's
        Simulation Engine, sized by :meth:`start_run`'s ``federation_config``.
    env : mapping, optional
        Extra environment variables for every process.
    node_config : str
        More ``key=value`` pairs for every SuperNode's ``--node-config`` (an operator's floors, say).
    """

    def __init__(self, nodes: int, workdir: Path, log_dir: Path, tls: TlsFiles | None = None,
                 startup_timeout: float = 180.0, *, simulation: bool = False,
                 env: dict[str, str] | None = None, node_config: str = "") -> None:
        if nodes < 1:
            raise ValueError(f"nodes={nodes} is not allowed; expected an integer ≥ 1")
        self.nodes, self.workdir, self.log_dir, self.tls = nodes, workdir.resolve(), log_dir.resolve(), tls
        self.startup_timeout, self.simulation, self.node_config = startup_timeout, simulation, node_config
        self.deploy_id = uuid.uuid4().hex
        self.port = free_port()
        self.address = f"{HOST}:{self.port}"
        self.flwr_home = self.workdir / "flwr-home"
        self.bin = flower_scripts_dir()
        # Flower starts its helpers (flower-superexec, flwr-simulation, flwr-clientapp, ...) by name: put ours first.
        path = os.pathsep.join([str(self.bin), os.environ.get("PATH", "")])
        self.env = {**os.environ, **(env or {}), "PATH": path, MARKER: self.deploy_id,
                    "FLWR_HOME": str(self.flwr_home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
        self.processes: dict[str, subprocess.Popen] = {}
        self._logs: list[IO[str]] = []

    def __enter__(self) -> LocalFederation:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if survivors := self.stop():
            warnings.warn(f"processes {survivors} of deployment {self.deploy_id} survived SIGKILL", RuntimeWarning,
                          stacklevel=1)

    # --- start -----------------------------------------------------------------
    def start(self) -> None:
        """Start the SuperLink, write the connection, start the SuperNodes; wait until all are online."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._write_connection()
        tls_args = (["--ssl-ca-certfile", str(self.tls.ca_certfile), "--ssl-certfile", str(self.tls.certfile),
                     "--ssl-keyfile", str(self.tls.keyfile)] if self.tls else ["--insecure"])
        mode = ["--simulation"] if self.simulation else []
        self._spawn("superlink", [str(self.bin / "flower-superlink"), *tls_args, *mode, "--host", HOST,
                                  "--port", str(self.port), "--disable-runtime-dependency-installation"])
        deadline = time.monotonic() + self.startup_timeout
        self._wait(lambda: _listening(self.port), deadline, f"the SuperLink to listen on {self.address}")
        if self.simulation:
            return
        link_args = ["--root-certificates", str(self.tls.ca_certfile)] if self.tls else ["--insecure"]
        for i in range(self.nodes):
            node_config = f"partition-id={i} num-partitions={self.nodes} {self.node_config}".strip()
            self._spawn(f"supernode-{i}", [
                str(self.bin / "flower-supernode"), *link_args, "--superlink", self.address, "--host", HOST,
                "--port", str(free_port()), "--node-config", node_config])
        self._wait(lambda: self.online_nodes() >= self.nodes, deadline, f"{self.nodes} SuperNodes to be online")

    def _write_connection(self) -> None:
        """``$FLWR_HOME/config.toml`` with one connection, the default."""
        entry = [f"address = {json.dumps(self.address)}"]
        entry.append(f"root-certificates = {json.dumps(str(self.tls.ca_certfile.resolve()))}" if self.tls
                     else "insecure = true")
        self.flwr_home.mkdir(parents=True, exist_ok=True)
        (self.flwr_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n' + "\n".join(entry) + "\n")

    def _spawn(self, name: str, command: list[str], cwd: Path | None = None,
               log_path: Path | None = None) -> subprocess.Popen:
        log = open(log_path or self.log_dir / f"{name}.log", "w")  # noqa: SIM115 -- outlives the call: stop() closes it
        self._logs.append(log)
        # A session of its own: a terminal's Ctrl-C reaches only us, and we stop the group.
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   env=self.env, cwd=cwd or self.workdir, start_new_session=True)
        self.processes[name] = process
        return process

    def _wait(self, ready, deadline: float, what: str) -> None:
        while not ready():
            if (dead := self.dead_process()) is not None:
                raise DeployError(f"{dead} while waiting for {what}")
            if time.monotonic() > deadline:
                raise DeployError(f"timed out after {self.startup_timeout:g} s waiting for {what}; "
                                  f"logs in {self.log_dir}")
            time.sleep(0.5)

    # --- run -------------------------------------------------------------------
    def online_nodes(self) -> int:
        """SuperNodes the SuperLink reports online (``flwr supernode ls``)."""
        listing = subprocess.run([str(self.bin / "flwr"), "supernode", "ls", CONNECTION, "--format", "json"],
                                 env=self.env,
                                 cwd=self.workdir, capture_output=True, text=True, timeout=60)
        try:
            nodes = json.loads(listing.stdout).get("nodes", [])
        except json.JSONDecodeError:
            return 0
        return sum(node.get("status") == "online" for node in nodes)

    def start_run(self, app_dir: Path, run_config: Path, log_path: Path,
                  federation_config: str | None = None) -> subprocess.Popen:
        """``flwr run app_dir <connection> --stream --run-config run_config``, its output to ``log_path``.

        ``federation_config`` (``'num-supernodes=N client-resources-num-cpus=1'``) sizes a simulation.
        """
        command = [str(self.bin / "flwr"), "run", str(app_dir), CONNECTION, "--stream", "--run-config", str(run_config)]
        if federation_config:
            command += ["--federation-config", federation_config]
        return self._spawn("flwr-run", command, cwd=app_dir, log_path=log_path)

    def dead_process(self, nodes: bool = True) -> str | None:
        """Which SuperLink (or, with ``nodes``, SuperNode) has exited, and how; ``None`` while all run."""
        for name, process in self.processes.items():
            if name == "flwr-run" or (not nodes and name.startswith("supernode-")):
                continue
            if process.poll() is not None:
                return f"{name} exited with code {process.returncode} (log: {self.log_dir / name}.log)"
        return None

    # --- stop ------------------------------------------------------------------
    def stop(self) -> list[int]:
        """Stop ``flwr run``, the SuperNodes, the SuperLink and every process they started.

        SIGTERM first, SIGKILL after :data:`STOP_GRACE_SECONDS`. Returns the ids of
        processes that survived both (normally none).
        """
        with interrupts.rerouted(signal.SIG_IGN):  # a second Ctrl-C must not cut it short
            for process in reversed(self.processes.values()):  # flwr run, SuperNodes, then the SuperLink
                _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            for process in self.processes.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                if process.poll() is None:
                    _signal_group(process, signal.SIGKILL)
                    process.wait()
            for handle in self._logs:
                handle.close()
            self._logs.clear()
            return _end_marked(self.deploy_id)


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signum)


def _end_marked(deploy_id: str) -> list[int]:
    """SIGTERM the processes marked with ``deploy_id``, then SIGKILL those left; return the survivors."""
    pids = marked_processes(deploy_id)
    for signum, grace in ((signal.SIGTERM, STOP_GRACE_SECONDS), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = marked_processes(deploy_id)
    return pids


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((HOST, port)) == 0


class _StopRequest:
    """Ctrl-C or SIGTERM while a run is watched: noted by the handler, raised once the display has closed.

    Raised straight from the handler, the exception can land inside the live
    display between taking and releasing its lock, and closing the display then
    waits forever (seen once: the deployment outlived a Ctrl-C by over a minute).
    """

    def __init__(self) -> None:
        self.signum = 0

    def note(self, signum: int, frame: object) -> None:
        """Signal handler: remember the first signal; the watch loop ends within half a second."""
        self.signum = self.signum or signum

    def raise_if_requested(self) -> None:
        """KeyboardInterrupt for Ctrl-C, SystemExit(128 + signum) for SIGTERM, as if raised by the signal."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum:
            raise SystemExit(128 + self.signum)


def deploy_local(
    config: RunConfig,
    nodes: int,
    tls: bool = False,
    workdir: Path | None = None,
    *,
    app_dir: Path | None = None,
    timeout: float | None = None,
    startup_timeout: float = 180.0,
) -> Path:
    """Run ``config`` on a local SuperLink with ``nodes`` SuperNodes; return the results folder.

    Parameters
    ----------
    config : RunConfig
        The run; ``population`` must equal ``nodes``. An empty ``results-dir``
        becomes ``results/<timestamp>`` under the working directory.
    nodes : int
        SuperNodes to start.
    tls : bool
        Serve the SuperLink over TLS with a throwaway CA (:func:`generate_tls_files`).
    workdir : Path or None
        Keeps ``FLWR_HOME``, the certificates, the app bundle and the resolved run
        config; default: a temporary folder, removed at the end.
    app_dir : Path or None
        The Flower app (folder with ``pyproject.toml``); default: fedhog's, written
        into the work folder (:func:`~fedhog.app_bundle.write_app_bundle`).
    timeout : float or None
        Seconds the run may take once the federation is up; ``None``: no limit.
    startup_timeout : float
        Seconds the SuperLink and SuperNodes may take to come up.

    Returns
    -------
    Path
        The absolute results folder: ``config.toml``, ``metrics.json``, ``final_model.pt``,
        ``flwr.log`` (the ``flwr run`` stream) and ``logs/`` (SuperLink and SuperNodes).

    Raises
    ------
    ConfigError
        If ``population`` differs from ``nodes``.
    DeployError
        If the federation does not come up, a process dies, the run times out or does not finish.
    """

    if config.population != nodes:
        raise ConfigError(f"population={config.population} must equal the number of SuperNodes (nodes={nodes})")
    if app_dir is not None and not (app_dir / "pyproject.toml").is_file():
        raise DeployError(f"no Flower app (pyproject.toml) in app_dir={app_dir}")
    return run_on_local_federation(config, nodes, workdir, app_dir, timeout, startup_timeout, tls=tls)


def run_on_local_federation(config: RunConfig, nodes: int, workdir: Path | None = None, app_dir: Path | None = None,
                            timeout: float | None = None, startup_timeout: float = 180.0, *, tls: bool = False,
                            federation_config: str | None = None,
                            environment: Callable[[Path], dict[str, str]] | None = None,
                            node_config: str = "") -> Path:
    """Start a federation, run ``config`` on it with ``flwr run``, show its progress, stop it;
    return the results folder.

    The driver of :func:`deploy_local` and of the Simulation Engine
    (:func:`fedhog.engines.simulation.simulate_local`): with ``federation_config``
    the SuperLink runs in simulation mode and ``flwr run`` sizes the simulated
    federation. ``environment(workdir)`` adds variables for every process, ``node_config`` pairs to every
    SuperNode's node config.
    """
    directory = Path(config.results_dir).resolve() if config.results_dir else default_results_dir()
    config = config.with_overrides({"results-dir": str(directory)})
    simulation = federation_config is not None
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="fedhog-sim-" if simulation else "fedhog-deploy-", ignore_cleanup_errors=True)))
        workdir = workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        env = {}
        if is_factory(config.model):  # Flower's processes start in other folders: let them import the factory here
            env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        if environment is not None:
            env.update(environment(workdir))
        app_dir = (app_dir or write_app_bundle(workdir / "app")).resolve()
        run_config = workdir / "run-config.toml"
        run_config.write_text(config_to_toml(config))
        certificates = generate_tls_files(workdir / "tls") if tls else None
        clear_stop_request(directory)
        federation = stack.enter_context(LocalFederation(nodes, workdir, directory / "logs", certificates,
                                                         startup_timeout, simulation=simulation, env=env,
                                                         node_config=node_config))
        stack.push(_request_stop_on_error(directory))  # before the federation stops: see _request_stop_on_error
        run = federation.start_run(app_dir, run_config, directory / "flwr.log", federation_config)
        deadline = None if timeout is None else time.monotonic() + timeout
        problem: list[str] = []

        def running() -> bool:
            # a lost SuperNode is a client dropping out: the server's round-timeout handles it
            if (dead := federation.dead_process(nodes=False)) is not None:
                problem.append(dead)
            elif deadline is not None and time.monotonic() > deadline:
                problem.append(f"the run timed out after {timeout:g} s")
            return run.poll() is None and not problem

        stop = _StopRequest()
        with interrupts.rerouted(stop.note):  # the CLI's Ctrl-C and SIGTERM, raised once the display has closed
            watch_metrics(directory, config.rounds, lambda: running() and not stop.signum)
        stop.raise_if_requested()
        if problem:
            raise DeployError(f"{problem[0]}; the flwr run log: {directory / 'flwr.log'}")
        if run.returncode != 0:
            raise DeployError(f"flwr run exited with {run.returncode} ({_last_error(directory / 'flwr.log')}); "
                              f"its log: {directory / 'flwr.log'}")
    return _check_finished(directory)


def _request_stop_on_error(directory: Path):
    """An exit callback: when the run ends by an exception (Ctrl-C, SIGTERM, an error), ask its ServerApp to keep no
    further round before any process is stopped. Its clients die first, and a round of dead clients must not be
    recorded (or checkpointed) as the run's own."""

    def callback(kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if kind is not None:
            request_stop(directory)

    return callback


def _check_finished(directory: Path) -> Path:
    """``directory`` if its run finished; else a :class:`DeployError` with the ServerApp's error.

    ``flwr run --stream`` exits with 0 even when the ServerApp raised, so the
    results folder, not the exit code, says whether the run finished.
    """
    log_path = directory / "flwr.log"
    document = read_metrics_file(directory / "metrics.json") or {}
    if document.get("status") == "finished":
        return directory
    reason = document.get("error") or _last_error(log_path) or "no error was reported"
    raise DeployError(f"the run did not finish (status={document.get('status')!r}): {reason}; see {log_path}")


def _last_error(log_path: Path) -> str | None:
    """The last ``SomeError: message`` line of a log, else its last line of text (Flower's boxed CLI errors)."""
    try:
        lines = [line.strip(" │╭╮╰╯─\t") for line in log_path.read_text(errors="replace").splitlines()]
    except FileNotFoundError:
        return None
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt): ", line)]
    text = [line for line in lines if re.search(r"\w", line)]
    found = errors or text
    return found[-1] if found else None
