"""The ``fedhog`` command: ``fedhog run [CONFIG.toml] [--set key=value ...]``."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import ConfigError, RunConfig, load_config, parse_override
from .results import config_to_toml, default_results_dir

ENGINES = ("simulation", "inprocess")
QUICKSTART = "configs/quickstart.toml"
console = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = argparse.ArgumentParser(prog="fedhog", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one federated training and report accuracy and ε")
    run.add_argument("config", nargs="?", help=f"run-config TOML (default: {QUICKSTART})")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override one config key (repeatable), e.g. --set noise-multiplier=1.2")
    run.add_argument("--resume", metavar="RESULTS_DIR",
                     help="continue a stopped run from its last checkpoint (same config, same folder)")
    run.add_argument("--engine", choices=ENGINES, default="simulation",
                     help="Flower's Simulation Engine (Ray, via `flwr run`) or the in-process engine")
    run.add_argument("--client-cpus", type=int, default=1,
                     help="CPUs per simulated client (Simulation Engine only)")
    args = parser.parse_args(argv)
    try:
        config = (_resume_config(args.resume, args.config, args.overrides) if args.resume
                  else _resolve_config(args.config, args.overrides))
    except ConfigError as error:
        console.print(f"[bold red]config error:[/] {error}")
        return 2
    return run_command(config, args.engine, args.client_cpus)


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
        _watch(directory, config.rounds, worker.is_alive)
        worker.join()
        failed = "error" in outcome
    else:
        returncode = _run_simulation_engine(config, directory, client_cpus)
        failed = returncode != 0
    return _report(directory, failed, outcome.get("error"))


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
            _watch(directory, config.rounds, lambda: process.poll() is None)
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


def _watch(directory: Path, rounds: int, running) -> None:
    """Show round, accuracy and ε from ``metrics.json`` while ``running()``."""
    columns = (TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("training", total=rounds, status="starting…")
        while True:
            alive = running()
            document = _read(directory / "metrics.json")
            if document and document.get("rounds"):
                last = document["rounds"][-1]
                progress.update(task, completed=last["round"],
                                status=f"accuracy {_fmt(last['accuracy'])}  ε {_fmt(last['epsilon'])}")
            if not alive:
                break
            time.sleep(0.5)


def _report(directory: Path, failed: bool, error: object) -> int:
    document = _read(directory / "metrics.json")
    if failed or not document or document.get("status") != "finished":
        reason = error or (document or {}).get("error") or "the run did not finish"
        console.print(f"[bold red]run failed:[/] {reason}\nwhat was done is in {directory}")
        return 1
    summary = document["summary"]
    table = Table(title="fedhog run summary", show_header=False)
    table.add_row("rounds", f"{summary['rounds_completed']} of {summary['rounds_planned']}"
                  + ("  (stopped: max-epsilon reached)" if summary["stopped_by_budget"] else ""))
    table.add_row("test accuracy", f"{_fmt(summary['initial_accuracy'])} → {_fmt(summary['final_accuracy'])}")
    epsilon = summary["epsilon"]
    table.add_row("privacy", "[bold red]ε = ∞: NO differential privacy[/]" if epsilon == "inf"
                  else f"(ε = {epsilon:.3f}, δ = {summary['delta']:g}), client-level")
    table.add_row("wall time", f"{document['seconds']:.1f} s")
    table.add_row("results", str(directory))
    Console().print(table)
    return 0


def _print_privacy_banner(config: RunConfig) -> None:
    if not config.mechanism_settings.has_guarantee:
        console.print(f"[bold red]WARNING: mechanism={config.mechanism!r}, noise-multiplier="
                      f"{config.noise_multiplier:g}: this run has NO differential-privacy guarantee (ε = ∞)[/]")


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _fmt(value: object) -> str:
    if value is None:
        return "–"
    if value == "inf" or (isinstance(value, float) and math.isinf(value)):
        return "∞"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
