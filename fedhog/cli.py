"""The ``fedhog`` command: ``fedhog run | deploy-local [CONFIG.toml] [--set key=value ...]``,
``fedhog export RESULTS``, ``fedhog sweep SWEEP.toml``."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .config import ConfigError, RunConfig, load_config, parse_override
from .deploy import DeployError, deploy_local
from .export import FORMATS, ExportError, export_model
from .progress import console, format_value, read_metrics_file, watch_metrics
from .results import config_to_toml, default_results_dir

ENGINES = ("simulation", "inprocess")
QUICKSTART = "configs/quickstart.toml"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = argparse.ArgumentParser(prog="fedhog", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one federated training and report accuracy and ε")
    _add_config_arguments(run)
    run.add_argument("--resume", metavar="RESULTS_DIR",
                     help="continue a stopped run from its last checkpoint (same config, same folder)")
    run.add_argument("--engine", choices=ENGINES, default="simulation",
                     help="Flower's Simulation Engine (Ray, via `flwr run`) or the in-process engine")
    run.add_argument("--client-cpus", type=int, default=1,
                     help="CPUs per simulated client (Simulation Engine only)")
    deploy = commands.add_parser("deploy-local", help="run on a real local deployment: a SuperLink and "
                                 "one SuperNode per client, started and stopped here")
    _add_config_arguments(deploy)
    deploy.add_argument("--nodes", type=int, help="SuperNodes to start; must equal population (default: population)")
    deploy.add_argument("--tls", action="store_true", help="serve the SuperLink over TLS with a throwaway CA")
    deploy.add_argument("--workdir", type=Path,
                        help="keep FLWR_HOME, certificates and the run config here (default: a temporary folder)")
    export = commands.add_parser("export", help="export the final model of a results folder for serving")
    export.add_argument("results", type=Path, help="a results folder (config.toml, final_model.pt)")
    export.add_argument("--format", dest="fmt", choices=FORMATS, default="torchscript",
                        help="TorchScript (LibTorch, DJL) or a plain state dict")
    export.add_argument("--out", type=Path, help="output file (default: model.<format>.pt in the results folder)")
    sweep = commands.add_parser("sweep", help="run a grid of in-process runs (resumable); write results.csv, "
                                "summary.md with paired tests, and plots")
    sweep.add_argument("config", help="sweep TOML: output, [base], [grid], [[variants]], paired (see fedhog.sweep)")
    sweep.add_argument("--output", help="output folder (default: the sweep file's `output`)")
    sweep.add_argument("--list", dest="list_only", action="store_true",
                       help="list the cells and which are finished; run nothing")
    sweep.add_argument("--threads", type=int, default=1, help="PyTorch threads while cells run (default: 1)")
    args = parser.parse_args(argv)
    if args.command == "sweep":
        from .sweep import sweep_command  # matplotlib and the sweep machinery only for sweeps

        return sweep_command(args.config, args.output, args.list_only, args.threads)
    if args.command == "export":
        return export_command(args.results, args.fmt, args.out)
    try:
        config = (_resume_config(args.resume, args.config, args.overrides) if getattr(args, "resume", None)
                  else _resolve_config(args.config, args.overrides))
    except ConfigError as error:
        console.print(f"[bold red]config error:[/] {error}")
        return 2
    if args.command == "deploy-local":
        return deploy_command(config, args.nodes or config.population, args.tls, args.workdir)
    return run_command(config, args.engine, args.client_cpus)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help=f"run-config TOML (default: {QUICKSTART})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable), e.g. --set noise-multiplier=1.2")


def _resolve_config(path: str | None, overrides: list[str]) -> RunConfig:
    if path is None:
        path = str(_find_quickstart())
    config = load_config(path, dict(parse_override(o) for o in overrides))
    results_dir = Path(config.results_dir).resolve() if config.results_dir else default_results_dir()
    return config.with_overrides({"results-dir": str(results_dir)})


def _resume_config(directory: str, path: str | None, overrides: list[str]) -> RunConfig:
    if path or overrides:
        raise ConfigError("--resume takes the config saved in the results folder; give no CONFIG or --set")
    folder = Path(directory).resolve()
    if not (folder / "config.toml").is_file():
        raise ConfigError(f"--resume {directory}: no config.toml there (not a fedhog results folder)")
    return load_config(folder / "config.toml", {"resume": True, "results-dir": str(folder)})


def _find_quickstart() -> Path:
    for base in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (base / QUICKSTART).is_file():
            return base / QUICKSTART
    raise ConfigError(f"no config given and {QUICKSTART} not found in {Path.cwd()}")


def run_command(config: RunConfig, engine: str, client_cpus: int = 1) -> int:
    """Run ``config`` on ``engine`` with a live progress display; print the summary."""
    directory = Path(config.results_dir)
    _print_privacy_banner(config)
    console.print(f"results → [bold]{directory}[/]  (engine: {engine})")
    outcome: dict[str, object] = {}
    if engine == "inprocess":
        worker = threading.Thread(target=_run_inprocess, args=(config, outcome), daemon=True)
        worker.start()
        watch_metrics(directory, config.rounds, worker.is_alive)
        worker.join()
        failed = "error" in outcome
    else:
        returncode = _run_simulation_engine(config, directory, client_cpus)
        failed = returncode != 0
    return _report(directory, failed, outcome.get("error"))


def deploy_command(config: RunConfig, nodes: int, tls: bool = False, workdir: Path | None = None) -> int:
    """Run ``config`` on a local SuperLink with ``nodes`` SuperNodes (:func:`deploy_local`); print the summary."""
    directory = Path(config.results_dir)
    _print_privacy_banner(config)
    try:
        deploy_local(config, nodes, tls=tls, workdir=workdir)
    except ConfigError as error:
        console.print(f"[bold red]config error:[/] {error}")
        return 2
    except DeployError as error:
        return _report(directory, True, error)
    return _report(directory, False, None)


def export_command(results: Path, fmt: str, out: Path | None = None) -> int:
    """Export the final model of ``results`` (:func:`export_model`); print where it went."""
    try:
        path = export_model(results, fmt, out)  # type: ignore[arg-type]
    except ExportError as error:
        console.print(f"[bold red]export error:[/] {error}")
        return 2
    console.print(f"{fmt} model → [bold]{path}[/]")
    return 0


def _run_inprocess(config: RunConfig, outcome: dict[str, object]) -> None:
    from .client_app import app as client_app  # heavy imports only when running
    from .engine import run_in_process
    from .server_app import app as server_app

    logging.getLogger("flwr").setLevel(logging.WARNING)
    try:
        run_in_process(server_app, client_app, config.population, config.to_mapping())
    except BaseException as error:  # reported by the main thread
        outcome["error"] = f"{type(error).__name__}: {error}"


def _run_simulation_engine(config: RunConfig, directory: Path, client_cpus: int) -> int:
    """``flwr run`` this project with the resolved config; its log goes to ``flwr.log``."""
    app_dir = Path(__file__).resolve().parents[1]
    if not (app_dir / "pyproject.toml").is_file():
        raise SystemExit(f"the Flower app bundle (pyproject.toml) is not beside {app_dir / 'fedhog'}; "
                         "use --engine inprocess for an installed package")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as handle:
        handle.write(config_to_toml(config))
    command = ["flwr", "run", str(app_dir), "--stream", "--run-config", handle.name,
               "--federation-config", f"num-supernodes={config.population} client-resources-num-cpus={client_cpus}"]
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    log_path = directory / "flwr.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=app_dir)
        try:
            watch_metrics(directory, config.rounds, lambda: process.poll() is None)
        except KeyboardInterrupt:
            process.terminate()
            raise
        finally:
            process.wait()
            Path(handle.name).unlink(missing_ok=True)
    if process.returncode != 0:
        console.print(f"[red]flwr run exited with {process.returncode}; its log: {log_path}[/]")
        console.print("".join(log_path.read_text().splitlines(keepends=True)[-20:]))
    return process.returncode


def _report(directory: Path, failed: bool, error: object) -> int:
    document = read_metrics_file(directory / "metrics.json")
    if failed or not document or document.get("status") != "finished":
        reason = error or (document or {}).get("error") or "the run did not finish"
        console.print(f"[bold red]run failed:[/] {reason}\nwhat was done is in {directory}")
        return 1
    summary = document["summary"]
    table = Table(title="fedhog run summary", show_header=False)
    table.add_row("rounds", f"{summary['rounds_completed']} of {summary['rounds_planned']}"
                  + ("  (stopped: max-epsilon reached)" if summary["stopped_by_budget"] else ""))
    table.add_row("test accuracy", f"{format_value(summary['initial_accuracy'])} → {format_value(summary['final_accuracy'])}")
    epsilon = summary["epsilon"]
    table.add_row("privacy", "[bold red]ε = ∞: NO differential privacy[/]" if epsilon == "inf"
                  else f"(ε = {epsilon:.3f}, δ = {summary['delta']:g}), client-level")
    privacy = document.get("privacy", {})
    if privacy.get("has_guarantee"):
        calibrated = f" (calibrated to ε = {privacy['target_epsilon']:g})" if privacy.get("target_epsilon") else ""
        table.add_row("noise", f"σ = {privacy['noise_multiplier']:.4g}{calibrated}, {privacy['accountant']} accountant")
    if privacy.get("randomness"):
        table.add_row("randomness", privacy["randomness"])
    table.add_row("wall time", f"{document['seconds']:.1f} s")
    table.add_row("results", str(directory))
    Console().print(table)
    return 0


def _print_privacy_banner(config: RunConfig) -> None:
    if not config.mechanism_settings.has_guarantee:
        console.print(f"[bold red]WARNING: mechanism={config.mechanism!r}, noise-multiplier="
                      f"{config.noise_multiplier:g}: this run has NO differential-privacy guarantee (ε = ∞)[/]")
    if config.privacy_seed >= 0:
        console.print(f"[bold red]WARNING: privacy-seed={config.privacy_seed}: cohorts, ξ and noise are "
                      "reproducible, so anyone who knows the seed can remove the noise; the ε printed holds only "
                      "against those who do not. For experiments only; deployments use privacy-seed = -1.[/]")


if __name__ == "__main__":
    sys.exit(main())
