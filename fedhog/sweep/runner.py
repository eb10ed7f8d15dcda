"""Running a sweep: its cells one after the other, resuming finished ones, then ``results.csv`` and the reports."""

from __future__ import annotations

import csv
import itertools
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import ConfigError
from ..engines import run_engine
from ..flower_log import flower_logger
from ..progress import console, read_metrics_file
from ..results import load_run_config
from .audit import collect_audits, is_audited, run_audits
from .plots import plot_accuracy_vs_epsilon, plot_accuracy_vs_round
from .report import summary_markdown, tuning_markdown
from .spec import Cell, Sweep, SweepError, load_sweep, widening_trials
from .stats import PairedComparison, TrialScore, best_settings, paired_comparisons, validation_score


@dataclass(frozen=True)
class SweepOutcome:
    """What :func:`run_sweep` did."""

    ran: tuple[str, ...]
    skipped: tuple[str, ...]
    failed: dict[str, str]
    comparisons: tuple[PairedComparison, ...]


def is_finished(cell: Cell) -> bool:
    """Whether the cell's run finished, with the config the sweep asks for.

    Raises
    ------
    SweepError
        When a finished run in the cell's folder used a different config.
    """
    document = _finished_metrics(cell)
    if document is None:
        return False
    stored = load_run_config(cell.directory)  # metrics.json withholds a fixed privacy-seed
    wanted = replace(cell.config, results_dir="")
    if replace(stored, results_dir="") != wanted:
        expected = wanted.to_mapping()
        differs = {k: (v, expected[k]) for k, v in stored.to_mapping().items()
                   if k != "results-dir" and v != expected[k]}
        raise SweepError(f"cell '{cell.cell_id}' in {cell.directory} was run with a different config "
                         f"({', '.join(f'{k}: {a!r} → {b!r}' for k, (a, b) in differs.items())}); "
                         "give the sweep a new output folder or delete that cell's folder")
    return True


def _finished_metrics(cell: Cell) -> dict[str, Any] | None:
    """The cell's ``metrics.json`` if its run finished, else None."""
    document = read_metrics_file(cell.directory / "metrics.json")
    return document if document and document.get("status") == "finished" else None


def run_sweep(sweep: Sweep, show_progress: bool = True, threads: int = 1) -> SweepOutcome:
    """Run every unfinished cell, one after the other, then the ``[audit]`` not yet done, then write the reports.

    A cell that raises is reported and the sweep goes on; Ctrl-C stops the
    sweep, leaving finished cells intact (the interrupted one is rerun next time).

    Parameters
    ----------
    sweep : Sweep
        The sweep to run.
    show_progress : bool
        Show cells done/total, the running cell's round and an ETA.
    threads : int
        PyTorch's intra-op threads while the cells run. The default, 1, is
        faster for fedhog's small models on a shared machine: on 2 loaded
        cores a cell of ``sweep_privacy_utility.toml`` (10 rounds) took 14 s
        (gaussian) and 20 s (hog) with 1 thread, 70 s and 144 s with 2.
    """
    if threads < 1:
        raise SweepError(f"threads={threads!r} is not allowed; expected an integer ≥ 1")
    ran: list[str] = []
    skipped: list[str] = []
    failed: dict[str, str] = {}
    if sweep.tuning is not None:
        sweep = apply_tuning(widen_tuning(sweep, lambda cells: _run_cells(
            sweep, cells, "tuning runs", show_progress, threads, ran, skipped, failed)))
    _run_cells(sweep, list(sweep.cells), "cells", show_progress, threads, ran, skipped, failed)
    with _quiet_flower(), _torch_threads(threads):
        ran.extend(f"audit/{name}" for name in run_audits(sweep, failed))
    comparisons = write_reports(sweep)
    return SweepOutcome(tuple(ran), tuple(sorted(skipped)), failed, tuple(comparisons))


def _run_cells(sweep: Sweep, cells: list[Cell], what: str, show_progress: bool, threads: int,
               ran: list[str], skipped: list[str], failed: dict[str, str]) -> None:
    """Run the unfinished ``cells``, noting each in ``ran``, ``skipped`` or ``failed``."""
    finished = {cell.cell_id for cell in cells if is_finished(cell)}
    skipped.extend(finished)
    pending = [cell for cell in cells if cell.cell_id not in finished]
    if not pending:
        return
    console.print(f"sweep {escape(sweep.path.name)}: {len(pending)} of {len(cells)} {what} to run "
                  f"on the {sweep.engine} engine → [bold]{escape(str(sweep.output))}[/]")
    if any(cell.config.privacy_seed >= 0 for cell in pending):
        console.print("[yellow]privacy-seed is fixed per seed so that paired cells draw the same cohorts "
                      "and seed their noise alike: the noise is predictable — for experiments only[/]")
    display = _SweepProgress(len(cells), len(finished), pending, show_progress)
    with _quiet_flower(), _torch_threads(threads), display as progress:
        for cell in pending:
            progress.start(cell)
            try:
                _run_cell(cell, sweep.engine)
                ran.append(cell.cell_id)
            except Exception as error:  # pylint: disable=broad-except  # one cell's fault; the sweep goes on
                failed[cell.cell_id] = f"{type(error).__name__}: {error}"
                console.print(f"[red]{escape(cell.cell_id)} failed:[/] {escape(failed[cell.cell_id])}")
            progress.finish(cell)


def widen_tuning(sweep: Sweep, run: Callable[[list[Cell]], None] | None = None) -> Sweep:
    """The sweep with its tuning grid widened past every choice on its edge (:func:`.spec.widening_trials`).

    With ``run``, each round of trials is run before the next is chosen; without, the sweep grows only as far
    as the finished trials tell (listing, reports), stopping at the first round that has unfinished trials.
    """
    while True:
        if run is not None:
            run([trial.cell for trial in sweep.trials])
        elif not all(is_finished(trial.cell) for trial in sweep.trials):
            return sweep
        more, _ = widening_trials(sweep, *tuning_choices(sweep))
        if not more:
            return sweep
        sweep = replace(sweep, trials=sweep.trials + tuple(more))


def apply_tuning(sweep: Sweep) -> Sweep:
    """The sweep whose cells take, per (variant, condition), the tuned setting with the best validation score.

    The grid is first widened as far as the finished trials tell (:func:`widen_tuning`). Writes ``tuning.md``
    and ``tuning.csv`` (every setting's score) in the sweep's folder; raises :class:`SweepError` as
    :func:`tuning_choices` does.
    """
    sweep = widen_tuning(sweep)
    scores, choices = tuning_choices(sweep)
    sweep.output.mkdir(parents=True, exist_ok=True)
    (sweep.output / "tuning.md").write_text(tuning_markdown(sweep, scores, choices))
    write_csv([{"variant": s.variant, **dict(s.condition), **dict(s.setting), "seed_score": s.score}
               for s in scores], sweep.output / "tuning.csv")
    return sweep.tuned(choices)


def tuning_choices(sweep: Sweep) -> tuple[list[TrialScore], dict[tuple[str, tuple], dict[str, Any]]]:
    """Every finished tuning run's validation score, and the best setting per (variant, condition).

    Raises
    ------
    SweepError
        When a (variant, condition) has no finished tuning run to choose from.
    """
    assert sweep.tuning is not None
    scores: list[TrialScore] = []
    for trial in sweep.trials:
        document = _finished_metrics(trial.cell)
        if document is not None:
            scores.append(TrialScore(trial.cell.variant, trial.condition, trial.setting,
                                     validation_score(document["rounds"], sweep.tuning.last_rounds),
                                     trial.cell.config.seed))
    expected = {(t.cell.variant, t.condition) for t in sweep.trials}
    choices = best_settings(scores)
    missing = sorted(expected - set(choices), key=str)
    if missing:
        raise SweepError("tuning has no finished run for " + "; ".join(
            f"variant '{v}' {dict(c) or ''}" for v, c in missing) + ": run the sweep again to retry them")
    return scores, choices


def _run_cell(cell: Cell, engine: str) -> None:
    shutil.rmtree(cell.directory, ignore_errors=True)  # a crashed run starts over
    run_engine(engine, cell.config)


class _DropPerCellWarnings(logging.Filter):
    """Warnings every cell of a kind repeats; the sweep says them once or they are expected."""

    EXPECTED = ("privacy-seed is fixed", "fraction_evaluate is set to 0.0")  # the second: flower-dp cells

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


@contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's logger at WARNING, without the warnings every cell repeats (the sweep says them once)."""
    logger = flower_logger()
    level, quiet = logger.level, _DropPerCellWarnings()
    logger.setLevel(logging.WARNING)
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
        logger.setLevel(level)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def estimate_remaining(elapsed: float, rounds_done: int, rounds_left: int) -> float | None:
    """Seconds left at the rate of the rounds run so far (None before the first round)."""
    return elapsed / rounds_done * rounds_left if rounds_done else None


class _SweepProgress:
    """Cells done/total, the running cell and its round, and an ETA from this session's rounds per second."""

    def __init__(self, total: int, done: int, pending: list[Cell], show: bool) -> None:
        columns = (TextColumn("[bold]cells"), MofNCompleteColumn(), BarColumn(),
                   TextColumn("{task.fields[cell]}"), TextColumn("ETA {task.fields[eta]}"), TimeElapsedColumn())
        self.progress = Progress(*columns, console=console, disable=not show)
        self.task = self.progress.add_task("sweep", total=total, completed=done, cell="", eta="–")
        self.done = done
        self.rounds_left = sum(cell.config.rounds for cell in pending)
        self.rounds_done = 0
        self.started = time.perf_counter()
        self.current: Cell | None = None
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> _SweepProgress:
        self.progress.start()
        self.watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.watcher.join()
        self.progress.stop()

    def start(self, cell: Cell) -> None:
        """A cell begins."""
        with self.lock:
            self.current = cell
            self._show(0)

    def finish(self, cell: Cell) -> None:
        """A cell ended (finished or failed): it counts as done."""
        with self.lock:
            self.current = None
            self.done += 1
            self.rounds_done += cell.config.rounds
            self.rounds_left -= cell.config.rounds
            self._show(0)

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            with self.lock:
                if self.current is not None:
                    document = read_metrics_file(self.current.directory / "metrics.json") or {}
                    self._show(len(document.get("rounds", [])))

    def _show(self, rounds: int) -> None:
        cell = self.current
        eta = estimate_remaining(time.perf_counter() - self.started, self.rounds_done + rounds,
                                 self.rounds_left - rounds)
        fraction = rounds / cell.config.rounds if cell else 0.0
        self.progress.update(self.task, completed=self.done + fraction,
                             cell=f"{cell.cell_id} round {rounds}/{cell.config.rounds}" if cell else "",
                             eta="–" if eta is None else time.strftime("%H:%M:%S", time.gmtime(eta)))


def collect_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """One row per finished cell and round (round 0: the initial model), as ``results.csv`` holds them."""
    rows = []
    for cell in sweep.cells:
        document = _finished_metrics(cell)
        if document is None:
            continue
        mapping = cell.config.to_mapping()
        head = {"cell_id": cell.cell_id, "variant": cell.variant, **{k: mapping[k] for k in sweep.column_keys},
                "sigma": document["privacy"]["noise_multiplier"], "cell_seconds": document["seconds"]}
        initial = {k: _float(v) for k, v in document["initial"].items()}  # accuracy, loss, auroc, auprc, ...
        rows.append({**head, "round": 0, **initial, "epsilon": 0.0})
        for record in document["rounds"]:
            metrics = {k: _float(v) for k, v in record.items() if not isinstance(v, (dict, list))}
            rows.append({**head, **metrics, **layer_summary(record.get("layers") or {})})
    return rows


def layer_summary(layers: dict[str, float]) -> dict[str, float]:
    """The worst layer of a round's diagnostics (:mod:`fedhog.diagnostics`): largest weight growth, noise walk
    and saturated fraction (NaN when the round has none: no noise, no saturating activation)."""
    def worst(kind: str) -> float:
        values = [_float(v) for k, v in layers.items() if k.startswith(f"{kind}/")]
        return max(values) if values else math.nan

    return {"weight_growth_max": worst("growth"), "noise_walk_max": worst("walk"), "saturated_max": worst("saturated")}


def _float(value: Any) -> Any:
    """``metrics.json`` writes ∞ as "inf" and NaN as null."""
    if value == "inf":
        return math.inf
    return math.nan if value is None else value


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The rows as CSV; columns in first-seen order, missing values empty, ∞ as ``inf``."""
    columns = list(dict.fromkeys(itertools.chain(*(row.keys() for row in rows))))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def write_reports(sweep: Sweep) -> list[PairedComparison]:
    """Write ``results.csv``, ``summary.md`` and the plots from the finished cells and audits; the comparisons."""
    sweep.output.mkdir(parents=True, exist_ok=True)
    rows = collect_rows(sweep)
    write_csv(rows, sweep.output / "results.csv")
    in_every_condition = sweep.broadcast(rows)
    comparisons = paired_comparisons(in_every_condition, sweep.paired, sweep.condition_keys, sweep.replicate_keys,
                                     sweep.metric)
    (sweep.output / "summary.md").write_text(summary_markdown(sweep, rows, comparisons, collect_audits(sweep)))
    plot_accuracy_vs_round(in_every_condition, sweep.condition_keys, sweep.output / "accuracy_vs_round.png",
                           sweep.metric)
    plot_accuracy_vs_epsilon(rows, sweep.condition_keys, sweep.output / "accuracy_vs_epsilon.png", sweep.metric)
    return comparisons


def sweep_command(path: str | Path, output: str | Path | None = None, list_only: bool = False,
                  threads: int = 1) -> int:
    """``fedhog sweep``: run (or list) the cells of a sweep file and write its reports; an exit status."""
    try:
        sweep = load_sweep(path, output)
        if list_only:
            if sweep.tuning is not None:
                sweep = widen_tuning(sweep)
            for trial in sweep.trials:
                console.print(f"{'finished' if is_finished(trial.cell) else 'to run  '}  tuning/"
                              f"{escape(trial.cell.cell_id)}")
            if sweep.tuning is not None and not all(is_finished(trial.cell) for trial in sweep.trials):
                console.print(f"then {len(sweep.cells)} cells with the tuned values")
                return 0
            listed = sweep.tuned(tuning_choices(sweep)[1]) if sweep.tuning is not None else sweep  # writes nothing
            for cell in listed.cells:
                console.print(f"{'finished' if is_finished(cell) else 'to run  '}  {escape(cell.cell_id)}")
            for target in listed.audit_targets:
                console.print(f"{'finished' if is_audited(listed, target) else 'to run  '}  "
                              f"audit/{escape(target.audit_id)}")
            return 0
        outcome = run_sweep(sweep, threads=threads)
    except ConfigError as error:  # a SweepError, or a stored config this fedhog cannot read
        console.print(f"[bold red]sweep error:[/] {escape(str(error))}")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: finished cells are kept; run the sweep again to continue[/]")
        return 130
    console.print(f"{len(outcome.ran)} cells run, {len(outcome.skipped)} already finished, "
                  f"{len(outcome.failed)} failed → [bold]{escape(str(sweep.output / 'summary.md'))}[/]")
    return 1 if outcome.failed else 0
