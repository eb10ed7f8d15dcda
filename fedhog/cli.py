"""The ``fedhog`` command: ``fedhog run | deploy-local [CONFIG.toml] [--set key=value ...]``,
``fedhog export RESULTS``, ``fedhog sweep SWEEP.toml``, ``fedhog keys``,
``fedhog audit [CONFIG.toml] [--set key=value ...]``."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from importlib.resources import as_file, files
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__, interrupts
from .aggregators import aggregator_of
from .alarms import PRIVACY_SEED_WARNING
from .choices import EXPORT_FORMATS, ExportFormat
from .config import ConfigError, RunConfig, load_config, parse_override, toml_value
from .deploy import DeployError, deploy_local
from .engines import DEFAULT_ENGINE, ENGINES, Engine, check_run, claim_run, engine_named
from .flower_log import flower_logger
from .progress import console, format_value, read_metrics_file, watch_metrics
from .results import (
    clear_stop_request,
    default_results_dir,
    describe_run,
    load_run_config,
    mark_failed,
    mark_interrupted,
    read_run_document,
    record_launch,
)

DESCRIPTION = "fedhog: federated learning with client-level differential privacy, on Flower and PyTorch."
EPILOG = """examples:
  fedhog run                                  the quickstart
  fedhog run my.toml --set noise-multiplier=1.2
  fedhog run --resume results/<run>           continue a stopped run
  fedhog keys [WORD]                          every config key, its default and meaning
  fedhog export results/<run>                 the final model, for serving
  fedhog <command> --help                     a command's options"""
QUICKSTART = "quickstart.toml"  # ships inside the package (configs/quickstart.toml in a checkout links to it)


class Refusal(Exception):
    """Nothing to run, said politely: the message is printed and the command exits with ``code``."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``fedhog`` and its subcommands."""
    parser = argparse.ArgumentParser(prog="fedhog", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fedhog {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one federated training and report accuracy and ε")
    _add_config_arguments(run)
    run.add_argument("--engine", choices=tuple(ENGINES), default=None,
                     help="; ".join(f"{name}: {engine.help}" for name, engine in ENGINES.items())
                     + f" (default: {DEFAULT_ENGINE}; a resumed run keeps its own)")
    run.add_argument("--client-cpus", type=int, default=None,
                     help="CPUs per simulated client (Simulation Engine only; default 1)")
    deploy = commands.add_parser("deploy-local", help="run on a real local deployment: a SuperLink and "
                                 "one SuperNode per client, started and stopped here")
    _add_config_arguments(deploy)
    deploy.add_argument("--nodes", type=int, help="SuperNodes to start; must equal population (default: population)")
    deploy.add_argument("--tls", action="store_true", default=None,
                        help="serve the SuperLink over TLS with a throwaway CA")
    deploy.add_argument("--workdir", type=Path,
                        help="keep FLWR_HOME, certificates and the run config here (default: a temporary folder)")
    export = commands.add_parser("export", help="export the final model of a results folder for serving")
    export.add_argument("results", type=Path, help="a results folder (config.toml, final_model.pt)")
    export.add_argument("--format", dest="fmt", choices=EXPORT_FORMATS, default="torchscript",
                        help="TorchScript (LibTorch, DJL) or a plain state dict")
    export.add_argument("--out", type=Path, help="output file (default: model.<format>.pt in the results folder)")
    sweep = commands.add_parser("sweep", help="run a grid of in-process runs (resumable); write results.csv, "
                                "summary.md with paired tests, and plots")
    sweep.add_argument("config", help="sweep TOML: output, [base], [grid], [[variants]], paired (see fedhog.sweep)")
    sweep.add_argument("--output", help="output folder (default: the sweep file's `output`)")
    sweep.add_argument("--list", dest="list_only", action="store_true",
                       help="list the cells and which are finished; run nothing")
    sweep.add_argument("--threads", type=int, default=1, help="PyTorch threads while cells run (default: 1)")
    keys = commands.add_parser("keys", help="list every run-config key with its default and meaning")
    keys.add_argument("word", nargs="?", help="only the keys whose name or meaning contains this word")
    _add_audit_parser(commands)
    return parser


def keys_command(word: str | None = None) -> int:
    """Print every run-config key (or those that mention ``word``) with its default and meaning."""
    from .config_keys import MEANINGS

    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for column in ("key", "default", "meaning"):
        table.add_column(column, overflow="fold")
    shown = 0
    for key, default in RunConfig().to_mapping().items():
        meaning = MEANINGS[key]
        if word and word.lower() not in f"{key} {meaning}".lower():
            continue
        table.add_row(key, escape(toml_value(default)), escape(meaning))
        shown += 1
    if not shown:
        console.print(f"no config key mentions {word!r}")
        return 1
    Console().print(table)
    return 0


def _add_audit_parser(commands: argparse._SubParsersAction) -> None:
    audit = commands.add_parser("audit", help="an empirical lower bound on ε: run the config's mechanism with "
                                "canaries and print what an attacker proved next to the accounted ε")
    audit.add_argument("config", nargs="?", help="run-config TOML (default: fedhog's quickstart)")
    audit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config key (repeatable), as for fedhog run")
    audit.add_argument("--json", action="store_true", help="print one JSON object (and nothing else)")
    audit.add_argument("--runs", type=int, default=None, help="independent runs (default: 4)")
    audit.add_argument("--canaries", type=int, default=0,
                       help="canaries per run (default: 100 000 on the vectorized harness, else the population "
                       "up to 2 000)")
    audit.add_argument("--confidence", type=float, default=None, help="confidence of the lower bound (default 0.95)")
    audit.add_argument("--threat-model", choices=("every-round", "final-model"), default="every-round",
                       help="the attacker epsilon_lower_bound reports (both are computed)")
    audit.add_argument("--harness", choices=("vectorized", "strategy"), default="vectorized",
                       help="trusted-server configs: the round batched over all canaries (vectorized), or the "
                       "strategy's own round loop, one reply per canary (strategy)")
    audit.add_argument("--canary-norm", type=float, default=None,
                       help="a canary's update length in clipping norms (default 100)")
    audit.add_argument("--output", help="results folder (default: the config's results-dir, else results/<time>)")


def audit_command(args: argparse.Namespace) -> int:
    """``fedhog audit``: run :func:`fedhog.auditing.runner.audit` and print its figures (or ``--json``)."""
    import json

    from .auditing import runner

    options: dict[str, Any] = {"canaries": args.canaries, "threat_model": args.threat_model,
                               "harness_name": args.harness}
    for name, value in (("runs", args.runs), ("confidence", args.confidence), ("canary_norm", args.canary_norm)):
        if value is not None:
            options[name] = value
    try:
        overrides = dict(parse_override(o) for o in args.overrides)
        path = Path(args.config) if args.config else None
        if path is None:
            with as_file(files("fedhog") / QUICKSTART) as quickstart:
                config = load_config(quickstart, overrides)
        else:
            config = load_config(path, overrides)
        output = args.output or config.results_dir or str(default_results_dir())
        flower_logger().setLevel(logging.WARNING)
        result = runner.audit(config, results_dir=output, **options)
    except ConfigError as error:
        _error("config error", error)
        return 2
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    table = Table(title=f"fedhog audit: {result.mechanism}", show_header=False)
    table.add_row("accounted", f"ε = {format_value(result.epsilon_accounted)} at δ = {result.delta:g}")
    for model, outcome in result.threat_models.items():
        table.add_row(f"lower bound, {model}", f"ε ≥ {outcome.epsilon_lower_bound:.3f} at {result.confidence:.0%} "
                      f"confidence ({outcome.statistic}: {outcome.hits}/{outcome.hit_trials} flagged vs "
                      f"{outcome.false_alarms}/{outcome.false_trials})")
        table.add_row(f"estimate, {model}", f"ε ≈ {outcome.epsilon_estimate_gdp:.3f} (μ-GDP fit, "
                      f"μ = {outcome.gdp_mu_estimate:.3f}; not a bound)")
    table.add_row("trials", f"{result.runs} runs × {result.canaries_per_run} canaries, {result.rounds} rounds, "
                  f"q = {result.inclusion_rate:g}, {result.relation}, {result.harness} harness")
    table.add_row("verdict", "[bold red]VIOLATED: the attack proves more ε than the accountant reports[/]"
                  if result.violated else "consistent with the accountant (a lower bound proves no guarantee)")
    table.add_row("results", escape(result.results_dir))
    Console().print(table)
    return 1 if result.violated else 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script."""
    started = time.perf_counter()  # the summary's wall time is the whole command's: start-up and data included
    args = build_parser().parse_args(argv)
    if args.command == "keys":
        return keys_command(args.word)
    if args.command == "sweep":
        from .sweep.runner import sweep_command  # matplotlib and the sweep machinery only for sweeps

        with interrupts.handled():  # SIGTERM stops a sweep's engines as Ctrl-C does
            return sweep_command(args.config, args.output, args.list_only, args.threads)
    if args.command == "export":
        return export_command(args.results, args.fmt, args.out)
    if args.command == "audit":
        return audit_command(args)
    with interrupts.handled():  # Ctrl-C and SIGTERM unwind the run in this thread, wherever it is
        try:
            config, launch = _prepare(args)
        except ConfigError as error:
            _error("config error", error)
            return 2
        except Refusal as refusal:
            console.print(escape(str(refusal)))
            return refusal.code
        except (KeyboardInterrupt, SystemExit) as stop:
            if (code := interrupts.interrupt_exit_code(stop)) is None:
                raise
            console.print("[yellow]interrupted[/] before the run started")
            return code
        try:
            with interrupts.deferred():  # claimed whole; an interrupt during the claim is raised once it is done
                config = _claim(args, config, launch)
        except ConfigError as error:  # the folder cannot be claimed (holds a run, other files, below a file)
            _error("config error", error)
            return 2
        except (KeyboardInterrupt, SystemExit) as stop:
            if (code := interrupts.interrupt_exit_code(stop)) is None:
                raise
            return _interrupted(Path(config.results_dir), config, code, args.command)
        if args.command == "deploy-local":
            return deploy_command(config, launch["nodes"], launch["tls"], args.workdir, started=started)
        return run_command(config, launch["engine"], launch["client_cpus"], started=started)


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="run-config TOML (default: fedhog's quickstart, "
                        "configs/quickstart.toml in a checkout)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key (repeatable), e.g. --set noise-multiplier=1.2")
    parser.add_argument("--resume", metavar="RESULTS_DIR",
                        help="continue a stopped run from its last checkpoint: same config, engine and folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run already in results-dir (its files only) instead of refusing")


def _prepare(args: argparse.Namespace) -> tuple[RunConfig, dict[str, Any]]:
    """The validated config and how to launch it (nothing written yet: :func:`_claim` does)."""
    given = _given_launch(args)
    if args.resume:
        if args.config or args.overrides or args.overwrite:
            raise ConfigError("--resume takes the config saved in the results folder; give no CONFIG, --set "
                              "or --overwrite")
        config, launch = _resume(args.command, Path(args.resume), given)
    else:
        notes: list[str] = []
        path = Path(args.config) if args.config else None
        if path is None:
            with as_file(files("fedhog") / QUICKSTART) as quickstart:
                config = load_config(quickstart, dict(parse_override(o) for o in args.overrides), notes)
        else:
            config = load_config(path, dict(parse_override(o) for o in args.overrides), notes)
        for note in notes:
            console.print(f"[yellow]note:[/] {escape(note)}")
        launch = {**_default_launch(args.command, config), **given}
    _check_launch(config, launch)
    check_run(config)  # loads a table or a model factory now, so bad input fails before any engine
    _check_metrics_port(config.metrics_port)
    return config, launch


def _claim(args: argparse.Namespace, config: RunConfig, launch: dict[str, Any]) -> RunConfig:
    """The results folder claimed (a new run) or its launch recorded again (``--resume``); the config with it."""
    if args.resume:
        record_launch(Path(config.results_dir), launch)
        return config
    return claim_run(config, launch, args.overwrite)


def _given_launch(args: argparse.Namespace) -> dict[str, Any]:
    """The launch options given on the command line (not their defaults)."""
    names = {"run": ("engine", "client_cpus"), "deploy-local": ("nodes", "tls")}[args.command]
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _default_launch(command: str, config: RunConfig) -> dict[str, Any]:
    if command == "run":
        return {"command": "run", "engine": DEFAULT_ENGINE, "client_cpus": 1}
    return {"command": "deploy-local", "nodes": config.population, "tls": False}


def _check_launch(config: RunConfig, launch: dict[str, Any]) -> None:
    if launch["command"] == "run":
        if launch["engine"] not in ENGINES:  # a resumed run's launch may name an engine of another fedhog
            raise ConfigError(f"engine {launch['engine']!r} is not available in this fedhog; "
                              f"expected one of {', '.join(ENGINES)}")
        if launch["client_cpus"] < 1:
            raise ConfigError(f"--client-cpus={launch['client_cpus']} is not allowed; expected an integer ≥ 1")
    elif launch["nodes"] != config.population:
        raise ConfigError(f"--nodes={launch['nodes']} must equal population={config.population} "
                          "(one SuperNode per client)")


def _resume(command: str, folder: Path, given: dict[str, Any]) -> tuple[RunConfig, dict[str, Any]]:
    """The stored config with ``resume = true`` and the stored launch; a finished run is refused politely."""
    folder = folder.expanduser().resolve()
    if not (folder / "config.toml").is_file():
        raise ConfigError(f"--resume {folder}: no config.toml there (not a fedhog results folder)")
    document = read_run_document(folder) or {}
    if document.get("status") == "finished":
        summary = document.get("summary", {})
        raise Refusal(f"nothing to resume: the run in {folder} has finished ({describe_run(document, False)}; accuracy "
                      f"{format_value(summary.get('final_accuracy'))}, ε = {format_value(summary.get('epsilon'))}); "
                      "its files are unchanged")
    config = load_run_config(folder)
    checkpointed = (folder / "checkpoint.pt").exists()
    if not aggregator_of(config).resumable and document.get("rounds"):
        raise ConfigError(f"--resume {folder}: aggregator={config.aggregator!r} writes no checkpoints, so its "
                          f"runs cannot be resumed; rerun it with fedhog run {folder / 'config.toml'} "
                          "--set results-dir='\"\"'")
    if not checkpointed:  # it stopped before its first checkpoint: nothing was done, so start it again
        console.print(f"[yellow]note:[/] no checkpoint in {escape(str(folder))}: the run starts again from round 1")
    config = config.with_overrides({"resume": checkpointed, "results-dir": str(folder)})
    stored = document.get("launch")
    if not isinstance(stored, dict):  # started by an older fedhog, or by `flwr run` directly
        launch = {**_default_launch(command, config), **given}
        console.print(f"[yellow]note:[/] {escape(str(folder))} does not say how it was started; resuming with "
                      + ", ".join(f"{k}={v}" for k, v in launch.items() if k != "command"))
        return config, launch
    stored = {**_default_launch(command, config), **stored}
    if stored.get("command") != command:
        raise ConfigError(f"--resume {folder}: the run was started with `fedhog {stored.get('command')}`; "
                          f"resume it with `fedhog {stored.get('command')} --resume {folder}`")
    for key, value in given.items():
        if stored.get(key) != value:
            option = "--" + key.replace("_", "-")
            raise ConfigError(f"--resume {folder}: the run was started with {option} {stored.get(key)}, and a "
                              f"resumed run keeps it; drop {option} {value}")
    return config, dict(stored)


def _check_metrics_port(port: int) -> None:
    """A fixed ``metrics-port`` must be free on 127.0.0.1 before training starts."""
    if port <= 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            raise ConfigError(f"metrics-port={port} is not allowed: 127.0.0.1:{port} cannot be bound "
                              f"({error.strerror}); choose another port, or 0 for any free one") from None


def _error(kind: str, error: object) -> None:
    """``kind: message`` in red, the message's text as it is (no markup)."""
    console.print(f"[bold red]{kind}:[/] {escape(str(error))}")


def run_command(config: RunConfig, engine: str, client_cpus: int = 1, *, started: float | None = None) -> int:
    """Run ``config`` on ``engine`` (a name of :data:`ENGINES`) with a live progress display; print the summary
    (its wall time counted from ``started``, a ``time.perf_counter()``; default: now)."""
    started = time.perf_counter() if started is None else started
    directory = Path(config.results_dir)
    chosen = engine_named(engine)
    error: object = None
    try:
        _print_privacy_banner(config)
        console.print(f"results → [bold]{escape(str(directory))}[/]  (engine: {engine})")
        if chosen.in_process:
            error = _run_watched(chosen, config, client_cpus, directory)
        else:
            try:
                chosen.run(config, client_cpus)
            except (DeployError, ConfigError) as problem:
                error = problem
        return _report(directory, error is not None, error, started)
    except (KeyboardInterrupt, SystemExit) as stop:
        if (code := interrupts.interrupt_exit_code(stop)) is None:
            raise
        return _interrupted(directory, config, code)


def _run_watched(engine: Engine, config: RunConfig, client_cpus: int, directory: Path) -> object:
    """Run ``engine`` in this thread while a display thread shows the progress; the error it raised, or None.

    The engine runs in the main thread so that Ctrl-C and SIGTERM unwind it
    (see :mod:`fedhog.interrupts`); interrupts propagate.
    """
    stop = threading.Event()
    watcher = threading.Thread(target=watch_metrics, args=(directory, config.rounds, lambda: not stop.is_set()),
                               daemon=True, name="fedhog-progress")
    flower = flower_logger()
    level, said = flower.level, _AlreadySaid(PRIVACY_SEED_WARNING)
    flower.setLevel(logging.WARNING)
    flower.addFilter(said)
    watcher.start()
    try:
        engine.run(config, client_cpus)
    except Exception as error:  # pylint: disable=broad-except  # reported with the run's own record
        return f"{type(error).__name__}: {error}"
    finally:
        with interrupts.deferred():  # a second Ctrl-C waits until the display has closed
            stop.set()
            watcher.join()
            flower.setLevel(level)
            flower.removeFilter(said)
    return None


class _AlreadySaid(logging.Filter):
    """Drops the log records that say what the CLI has printed already (its banner), so it is said once."""

    def __init__(self, *texts: str) -> None:
        super().__init__()
        self.texts = texts

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.texts


def _interrupted(directory: Path, config: RunConfig, code: int, command: str = "run") -> int:
    """Mark the run interrupted, say what was kept and how to continue; return ``code``."""
    from .checkpoint import CheckpointError, load_checkpoint  # torch

    interrupts.ignore()  # what follows is quick and must not be cut short
    mark_interrupted(directory)
    clear_stop_request(directory)
    shown = escape(str(directory))
    if (read_run_document(directory) or {}).get("status") == "finished":
        console.print(f"[yellow]interrupted[/] after the run had finished: its results are in {shown}")
        return code
    try:
        done = load_checkpoint(directory).round
    except CheckpointError:
        done = 0
    if not aggregator_of(config).resumable and (read_run_document(directory) or {}).get("rounds"):
        console.print(f"[yellow]interrupted:[/] what was done is in {shown}; aggregator={config.aggregator!r} writes "
                      "no checkpoints, so the run cannot be resumed")
        return code
    kept = (f"round 1 is kept in {shown}" if done == 1 else f"rounds 1–{done} are kept in {shown}" if done
            else f"no round had finished ({shown})")
    console.print(f"[yellow]interrupted:[/] {kept}; continue with: fedhog {command} --resume {shown}"
                  + ("" if done else " (it starts again from round 1)"))
    return code


def deploy_command(config: RunConfig, nodes: int, tls: bool = False, workdir: Path | None = None, *,
                   started: float | None = None) -> int:
    """Run ``config`` on a local SuperLink with ``nodes`` SuperNodes (:func:`deploy_local`); print the summary
    (its wall time counted from ``started``, as :func:`run_command`'s)."""
    started = time.perf_counter() if started is None else started
    directory = Path(config.results_dir)
    _print_privacy_banner(config)
    console.print(f"results → [bold]{escape(str(directory))}[/]  (local deployment: {nodes} SuperNodes)")
    try:
        try:
            deploy_local(config, nodes, tls=tls, workdir=workdir)
        except ConfigError as error:
            _error("config error", error)
            return 2
        except DeployError as error:
            return _report(directory, True, error, started)
        return _report(directory, False, None, started)
    except (KeyboardInterrupt, SystemExit) as stop:
        if (code := interrupts.interrupt_exit_code(stop)) is None:
            raise
        return _interrupted(directory, config, code, "deploy-local")


def export_command(results: Path, fmt: ExportFormat, out: Path | None = None) -> int:
    """Export the final model of ``results`` (:func:`export_model`); print where it went."""
    from .export import ExportError, export_model  # torch

    try:
        path = export_model(results, fmt, out)
    except ExportError as error:
        _error("export error", error)
        return 2
    console.print(f"{fmt} model → [bold]{escape(str(path))}[/]")
    return 0


def _report(directory: Path, failed: bool, error: object, started: float) -> int:
    if failed:  # what stopped it before the ServerApp could record it (or its process died) is recorded here
        mark_failed(directory, str(error or "the run did not finish"))
    document = read_metrics_file(directory / "metrics.json")
    if failed or not document or document.get("status") != "finished":
        reason = (document or {}).get("error") or error or "the run did not finish"
        _error("run failed", reason)
        console.print(f"what was done is in {escape(str(directory))}")
        return 1
    summary = document["summary"]
    table = Table(title="fedhog run summary", show_header=False)
    table.add_row("rounds", f"{summary['rounds_completed']} of {summary['rounds_planned']}"
                  + ("  (stopped: max-epsilon reached)" if summary["stopped_by_budget"] else ""))
    table.add_row("test accuracy",
                  f"{format_value(summary['initial_accuracy'])} → {format_value(summary['final_accuracy'])}")
    for name in ("auroc", "auprc"):
        if f"final_{name}" in summary:
            table.add_row(f"test {name.upper()}",
                          f"{format_value(summary[f'initial_{name}'])} → {format_value(summary[f'final_{name}'])}")
    epsilon = summary["epsilon"]
    privacy = document.get("privacy", {})
    table.add_row("privacy", "[bold red]ε = ∞: NO differential privacy[/]" if epsilon == "inf"
                  else f"(ε = {epsilon:.3f}, δ = {summary['delta']:g}), client-level"
                  + ("" if "epsilon_void_against" not in privacy else
                     " — [bold red]VOID against " + escape(privacy["epsilon_void_against"]) + "[/]"))
    if privacy.get("has_guarantee"):
        calibrated = f" (calibrated to ε = {privacy['target_epsilon']:g})" if privacy.get("target_epsilon") else ""
        table.add_row("noise", f"σ = {privacy['noise_multiplier']:.4g}{calibrated}, {privacy['accountant']} accountant")
    if privacy.get("randomness"):
        table.add_row("randomness", escape(privacy["randomness"]))
    table.add_row("wall time", wall_time(time.perf_counter() - started, document))
    table.add_row("machine", machine_load())
    table.add_row("results", escape(str(directory)))
    Console().print(table)
    return 0


def wall_time(command_seconds: float, document: dict[str, Any]) -> str:
    """The summary's wall time: the whole command's, then the ServerApp's part (calibration, data, the rounds) and,
    after ``--resume``, which rounds this command ran (the earlier ones were timed by the commands that ran them)."""
    text = f"{command_seconds:.1f} s for the whole command ({document['seconds']:.1f} s in the ServerApp"
    resumed = document.get("resumed_after_round")
    if resumed:
        done = document.get("summary", {}).get("rounds_completed", resumed)
        text += f"; resumed after round {resumed}: rounds {resumed + 1}–{done} only"
    return text + ")"


def machine_load() -> str:
    """The load average over 1, 5 and 15 minutes against this machine's CPUs: what a timing was taken under."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:  # not every platform has one
        return f"{os.cpu_count()} CPUs, load average not available"
    return f"load average {one:.2f} / {five:.2f} / {fifteen:.2f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs"


def _print_privacy_banner(config: RunConfig) -> None:
    if not config.privacy_mechanism.has_guarantee:
        console.print(f"[bold red]WARNING: mechanism={config.mechanism!r}, noise-multiplier="
                      f"{config.noise_multiplier:g}: this run has NO differential-privacy guarantee (ε = ∞)[/]")
    if config.privacy_seed >= 0:
        console.print(f"[bold red]WARNING: {escape(PRIVACY_SEED_WARNING)}[/]")


if __name__ == "__main__":
    sys.exit(main())
