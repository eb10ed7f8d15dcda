"""Sweeps: a grid of full federated runs on the vectorized engine, resumable, with tidy results.

A sweep file is TOML::

    output = "results/sweeps/privacy-utility"     # folder of the sweep (relative: to the working directory)
    engine = "vectorized"                         # optional: or "inprocess" (one Flower message per client)
    paired = [["gaussian", "hog-γ0.5"]]           # optional: pairs [A, B] of variants to compare (B − A)

    [base]                                        # run-config keys shared by every cell
    dataset = "mnist1d"

    [grid]                                        # run-config keys, each a list: every combination is run
    target-epsilon = [1.0, 3.0, 8.0]
    seed = [0, 1, 2]

    [[variants]]                                  # optional: named cells that override keys
    name = "gaussian"
    mechanism = "gaussian"

A cell is one combination of the grid values with one variant (the grid alone
when there are no variants). A variant may set a condition key of the grid
(``target-epsilon = 0.0`` for a no-DP ceiling): it then runs once per value of
the other grid keys, and the paired tests and the plots compare it with every
condition (a reference line); its id (``hog-gamma0.5__target-epsilon=1.0__seed=0``)
comes from the variant's name and the grid values, and its run goes to
``output/runs/<cell-id>/``. Without variants a cell's variant is its mechanism.

**Pairing.** Cells with the same ``seed`` share the data, the partition, the
model initialisation and the clients' shuffling and directions. Unless the
sweep sets ``privacy-seed``, each cell gets the fixed privacy seed
:func:`privacy_seed_for` its ``seed``, so paired cells also draw the same
cohorts every round and the same Gaussian noise draws (``hog`` takes its ξ from
a stream of its own, so mixing does not shift the noise). A fixed privacy seed
makes the noise predictable: it is for experiments, never for a deployment.

**Resuming.** A cell whose ``metrics.json`` says ``"finished"`` is not rerun
(its stored config must match the sweep's, or the sweep stops with an error
naming the keys that differ); any other cell (crashed, killed, interrupted,
missing) is run again from scratch.

**Outputs** (in ``output``): ``results.csv`` (one row per cell and round,
round 0 being the initial model), ``summary.md`` (final accuracy mean ± std over
seeds per variant and condition, and the paired comparisons), and the plots
``accuracy_vs_round.png`` and ``accuracy_vs_epsilon.png``.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import shutil
import threading
import time
import unicodedata
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from scipy import stats

from .config import ConfigError, RunConfig, load_config, read_toml, unknown_key_message
from .progress import console, format_value, read_metrics_file

SWEEP_KEYS = ("output", "engine", "paired", "base", "grid", "variants")
SWEEP_ENGINES = ("vectorized", "inprocess")  # both give the same results (tests/test_vectorized.py)
RESERVED_KEYS = ("results-dir", "resume")  # set by the sweep for every cell
DIFFERENCE_DECIMALS = 12  # paired differences of accuracies are rounded to this many decimals before testing
REPLICATE_KEYS = ("seed", "privacy-seed")  # grid keys that repeat a condition rather than define one
PRIVACY_KEYS = ("target-epsilon", "noise-multiplier")  # grid keys that set ε (the x axis of the ε plot)
PRIVACY_SEED_TAG = 0xF3D405  # separates the privacy seeds from the data seeds
CONFIG_KEYS = tuple(f.name.replace("_", "-") for f in fields(RunConfig))


class SweepError(ConfigError):
    """A sweep file, or a sweep folder, that fedhog cannot run."""


@dataclass(frozen=True)
class Cell:
    """One federated run of a sweep.

    Attributes
    ----------
    cell_id : str
        Stable id from the variant name and the grid values; the run's folder name.
    variant : str
        The variant's name, or the cell's mechanism when the sweep has no variants.
    overrides : dict
        The grid values and the variant's keys, as the sweep file gives them.
    config : RunConfig
        The resolved run config; ``results-dir`` is the cell's folder.
    """

    cell_id: str
    variant: str
    overrides: dict[str, Any]
    config: RunConfig

    @property
    def directory(self) -> Path:
        """The cell's results folder."""
        return Path(self.config.results_dir)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep file and its cells."""

    path: Path
    output: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    variants: tuple[dict[str, Any], ...]
    paired: tuple[tuple[str, str], ...]
    cells: tuple[Cell, ...]
    engine: str = "vectorized"

    @property
    def replicate_keys(self) -> list[str]:
        """Grid keys that pair cells (``seed``, ``privacy-seed``)."""
        return [key for key in self.grid if key in REPLICATE_KEYS] or ["seed"]

    @property
    def condition_keys(self) -> list[str]:
        """Grid keys that define a condition: all but the replicate keys (and ``mechanism`` without variants)."""
        return [key for key in self.grid
                if key not in REPLICATE_KEYS and (self.variants or key != "mechanism")]

    @property
    def fixed_keys(self) -> dict[str, list[str]]:
        """Variant name → the grid's condition keys that the variant sets itself."""
        return {v["name"]: [k for k in v if k in self.grid] for v in self.variants if any(k in self.grid for k in v)}

    def broadcast(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows, with those of a variant that sets grid keys repeated for every grid value of those keys.

        A no-DP ceiling run once then appears in every ε condition, for pairing and plotting.
        """
        out: list[dict[str, Any]] = []
        fixed = self.fixed_keys
        for row in rows:
            keys = fixed.get(row["variant"], [])
            for values in itertools.product(*(self.grid[k] for k in keys)):
                condition = dict(zip(keys, values))
                cell_id = "__".join([row["cell_id"], *(f"{k}={_format_value(v)}" for k, v in condition.items())])
                out.append({**row, **condition, "cell_id": cell_id})
        return out

    @property
    def column_keys(self) -> list[str]:
        """Config keys that get a column in ``results.csv``: mechanism, grid, variant keys, seed."""
        keys = ["mechanism", *self.grid, *(k for v in self.variants for k in v if k != "name"), "seed"]
        return list(dict.fromkeys(keys))


@dataclass(frozen=True)
class PairedComparison:
    """Final accuracy of variant B minus variant A, paired on the replicate keys, in one condition."""

    baseline: str
    variant: str
    condition: tuple[tuple[str, Any], ...]
    replicates: tuple[tuple[Any, ...], ...]
    differences: tuple[float, ...]
    t_statistic: float
    t_pvalue: float
    wilcoxon_statistic: float
    wilcoxon_pvalue: float

    @property
    def mean(self) -> float:
        """Mean difference B − A."""
        return float(np.mean(self.differences)) if self.differences else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation of the differences (NaN below two pairs)."""
        return float(np.std(self.differences, ddof=1)) if len(self.differences) > 1 else math.nan


@dataclass(frozen=True)
class SweepOutcome:
    """What :func:`run_sweep` did."""

    ran: tuple[str, ...]
    skipped: tuple[str, ...]
    failed: dict[str, str]
    comparisons: tuple[PairedComparison, ...]


# --- the sweep file ----------------------------------------------------------
def load_sweep(path: str | Path, output: str | Path | None = None) -> Sweep:
    """Read and validate a sweep file and resolve every cell's config.

    Parameters
    ----------
    path : str or Path
        The sweep TOML.
    output : str or Path, optional
        Replaces the file's ``output``.

    Raises
    ------
    SweepError
        Naming the key (and the cell) that is wrong.
    """
    path = Path(path)
    document = read_toml(path, "sweep file", SweepError)
    for key in document:
        if key not in SWEEP_KEYS:
            raise SweepError(f"sweep file {path}: {unknown_key_message(key, SWEEP_KEYS, 'key')} "
                             "(run-config keys go under [base], [grid] or [[variants]])")
    engine = document.get("engine", "vectorized")
    if engine not in SWEEP_ENGINES:
        raise SweepError(f"sweep file {path}: engine={engine!r} is not allowed; expected one of "
                         f"{', '.join(SWEEP_ENGINES)}")
    output = document.get("output") if output is None else str(output)
    if not isinstance(output, str) or not output:
        raise SweepError(f"sweep file {path}: output={output!r} must be a folder name (a non-empty string)")
    base = _table(document, "base")
    grid = _table(document, "grid")
    _check_config_keys("[base]", base)
    _check_config_keys("[grid]", grid)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid key '{key}' must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise SweepError(f"grid key '{key}' repeats a value: {values!r}")
        if key in base:
            raise SweepError(f"key '{key}' is in both [base] and [grid]; keep it in one")
    variants = _variants(document.get("variants", []), grid)
    directory = Path(output).resolve()
    cells = tuple(expand_cells(base, grid, variants, directory))
    labels = list(dict.fromkeys(cell.variant for cell in cells))
    paired = _paired(document.get("paired", []), labels)
    return Sweep(path, directory, base, grid, variants, paired, cells, engine)


def expand_cells(base: dict[str, Any], grid: dict[str, list[Any]], variants: Sequence[dict[str, Any]],
                 output: Path) -> list[Cell]:
    """Every variant × every combination of grid values, with validated configs.

    Cells with the same ``seed`` get the same fixed ``privacy-seed``
    (:func:`privacy_seed_for`) unless the sweep sets one.
    """
    cells: list[Cell] = []
    seen: dict[str, Cell] = {}
    for variant in variants or [None]:
        keys = {k: v for k, v in (variant or {}).items() if k != "name"}
        variant_grid = {k: v for k, v in grid.items() if k not in keys}
        for values in itertools.product(*variant_grid.values()):
            grid_values = dict(zip(variant_grid, values))
            mapping = {**base, **keys, **grid_values}
            name = variant["name"] if variant else str(mapping.get("mechanism", RunConfig.mechanism))
            cell_id = cell_id_of(variant["name"] if variant else None, grid_values)
            if cell_id in seen:
                raise SweepError(f"cells {seen[cell_id].overrides} and {grid_values} (variant '{name}') "
                                 f"have the same id '{cell_id}'; rename a variant")
            seed = mapping.get("seed", RunConfig.seed)
            if "privacy-seed" not in mapping and isinstance(seed, int) and not isinstance(seed, bool):
                if seed < 0:
                    raise SweepError(f"cell '{cell_id}': seed={seed!r} is not allowed; expected an integer ≥ 0")
                mapping["privacy-seed"] = privacy_seed_for(seed)
            mapping["results-dir"] = str(output / "runs" / cell_id)
            try:
                config = load_config(None, mapping)
            except ConfigError as error:
                raise SweepError(f"cell '{cell_id}': {error}") from None
            cell = Cell(cell_id, name, {**grid_values, **keys}, config)
            seen[cell_id] = cell
            cells.append(cell)
    return cells


def privacy_seed_for(seed: int) -> int:
    """The fixed privacy seed of every sweep cell with data seed ``seed`` (experiments only)."""
    return int(np.random.SeedSequence([PRIVACY_SEED_TAG, seed]).generate_state(1)[0])


def cell_id_of(variant: str | None, grid_values: dict[str, Any]) -> str:
    """``<variant>__<key>=<value>__...`` in file-name-safe ASCII (``γ`` becomes ``gamma``)."""
    parts = ([_slug(variant)] if variant is not None else []) + [
        f"{key}={_slug(_format_value(value))}" for key, value in grid_values.items()]
    return "__".join(parts) or "base"


def _table(document: dict[str, Any], key: str) -> dict[str, Any]:
    table = document.get(key, {})
    if not isinstance(table, dict):
        raise SweepError(f"'{key}' must be a table ([{key}]), got {table!r}")
    return table


def _check_config_keys(where: str, table: dict[str, Any]) -> None:
    for key in table:
        if key not in CONFIG_KEYS:
            raise SweepError(f"{where}: {unknown_key_message(key, CONFIG_KEYS, 'run-config key')}")
        if key in RESERVED_KEYS:
            raise SweepError(f"{where}: '{key}' is set by the sweep for every cell (output/runs/<cell-id>)")


def _variants(raw: Any, grid: dict[str, list[Any]]) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not all(isinstance(v, dict) for v in raw):
        raise SweepError(f"'variants' must be an array of tables ([[variants]]), got {raw!r}")
    names: set[str] = set()
    for index, variant in enumerate(raw, 1):
        name = variant.get("name")
        if not isinstance(name, str) or not name:
            raise SweepError(f"variant #{index} ({variant}) needs a 'name' (a non-empty string)")
        if name in names:
            raise SweepError(f"variant name '{name}' is used twice")
        names.add(name)
        keys = {k: v for k, v in variant.items() if k != "name"}
        _check_config_keys(f"variant '{name}'", keys)
        for key in keys:
            if key in grid and key in REPLICATE_KEYS:
                raise SweepError(f"variant '{name}' sets '{key}', a [grid] key that pairs cells; "
                                 "a variant may set only the grid's condition keys")
    return tuple(raw)


def _paired(raw: Any, labels: list[str]) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list):
        raise SweepError(f"paired={raw!r} must be a list of [A, B] pairs of variant names")
    pairs = []
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
            raise SweepError(f"paired entry {pair!r} must be a pair [A, B] of variant names")
        for name in pair:
            if name not in labels:
                raise SweepError(f"paired entry {pair!r}: no variant '{name}'; variants: {', '.join(labels)}")
        if pair[0] == pair[1]:
            raise SweepError(f"paired entry {pair!r} compares a variant with itself")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def _slug(text: str) -> str:
    out = []
    for char in text:
        if char.isascii() and (char.isalnum() or char in "._-+="):
            out.append(char)
        elif not char.isascii() and char.isalpha():
            out.append(unicodedata.name(char, "-").split()[-1].lower())
        else:
            out.append("-")
    return "".join(out)


# --- running -------------------------------------------------------------------
def is_finished(cell: Cell) -> bool:
    """Whether the cell's run finished, with the config the sweep asks for.

    Raises
    ------
    SweepError
        When a finished run in the cell's folder used a different config.
    """
    document = read_metrics_file(cell.directory / "metrics.json")
    if not document or document.get("status") != "finished":
        return False
    stored = RunConfig.from_mapping(document["config"])
    wanted = replace(cell.config, results_dir="")
    if replace(stored, results_dir="") != wanted:
        differs = {k: (v, wanted.to_mapping()[k]) for k, v in stored.to_mapping().items()
                   if k != "results-dir" and v != wanted.to_mapping()[k]}
        raise SweepError(f"cell '{cell.cell_id}' in {cell.directory} was run with a different config "
                         f"({', '.join(f'{k}: {a!r} → {b!r}' for k, (a, b) in differs.items())}); "
                         "give the sweep a new output folder or delete that cell's folder")
    return True


def run_sweep(sweep: Sweep, show_progress: bool = True, threads: int = 1) -> SweepOutcome:
    """Run every unfinished cell, one after the other, then write the reports.

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
    finished = {cell.cell_id for cell in sweep.cells if is_finished(cell)}
    pending = [cell for cell in sweep.cells if cell.cell_id not in finished]
    failed: dict[str, str] = {}
    if pending:
        console.print(f"sweep {escape(sweep.path.name)}: {len(pending)} of {len(sweep.cells)} cells to run "
                      f"on the {sweep.engine} engine → [bold]{escape(str(sweep.output))}[/]")
        if any(cell.config.privacy_seed >= 0 for cell in pending):
            console.print("[yellow]privacy-seed is fixed per seed so that paired cells draw the same cohorts "
                          "and seed their noise alike: the noise is predictable — for experiments only[/]")
        display = _SweepProgress(len(sweep.cells), len(finished), pending, show_progress)
        with _quiet_flower(), _torch_threads(threads), display as progress:
            for cell in pending:
                progress.start(cell)
                try:
                    _run_cell(cell, sweep.engine)
                except Exception as error:  # pylint: disable=broad-except  # one cell's fault; the sweep goes on
                    failed[cell.cell_id] = f"{type(error).__name__}: {error}"
                    console.print(f"[red]cell {escape(cell.cell_id)} failed:[/] {escape(failed[cell.cell_id])}")
                progress.finish(cell)
    comparisons = write_reports(sweep)
    return SweepOutcome(tuple(c.cell_id for c in pending if c.cell_id not in failed),
                        tuple(sorted(finished)), failed, tuple(comparisons))


def _run_cell(cell: Cell, engine: str) -> None:
    from .client_app import app as client_app  # heavy imports only when running
    from .engine import run_in_process
    from .server_app import app as server_app
    from .vectorized import run_vectorized

    shutil.rmtree(cell.directory, ignore_errors=True)  # a crashed run starts over
    if engine == "vectorized":
        run_vectorized(server_app, client_app, cell.config)
    else:
        run_in_process(server_app, client_app, cell.config.population, cell.config.to_mapping())


class _DropPerCellWarnings(logging.Filter):
    """Warnings every cell of a kind repeats; the sweep says them once or they are expected."""

    EXPECTED = ("privacy-seed is fixed", "fraction_evaluate is set to 0.0")  # the second: flower-dp cells

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


@contextmanager
def _quiet_flower() -> Iterator[None]:
    """Flower's logger at WARNING, without the warnings every cell repeats (the sweep says them once)."""
    logger = logging.getLogger("flwr")
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

    def __enter__(self) -> "_SweepProgress":
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


# --- results -------------------------------------------------------------------
def collect_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """One row per finished cell and round (round 0: the initial model), as ``results.csv`` holds them."""
    rows = []
    for cell in sweep.cells:
        document = read_metrics_file(cell.directory / "metrics.json")
        if not document or document.get("status") != "finished":
            continue
        mapping = cell.config.to_mapping()
        head = {"cell_id": cell.cell_id, "variant": cell.variant, **{k: mapping[k] for k in sweep.column_keys},
                "sigma": document["privacy"]["noise_multiplier"], "cell_seconds": document["seconds"]}
        rows.append({**head, "round": 0, "accuracy": document["initial"]["accuracy"],
                     "loss": document["initial"]["loss"], "epsilon": 0.0})
        for record in document["rounds"]:
            metrics = {k: _float(v) for k, v in record.items() if not isinstance(v, dict)}
            rows.append({**head, **metrics})
    return rows


def final_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last round's row of every cell."""
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["cell_id"] not in last or row["round"] > last[row["cell_id"]]["round"]:
            last[row["cell_id"]] = row
    return list(last.values())


def paired_comparisons(rows: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]],
                       condition_keys: Sequence[str], replicate_keys: Sequence[str]) -> list[PairedComparison]:
    """Final accuracy of B − A per condition, paired on the replicate keys; paired t-test and Wilcoxon.

    Both tests are two-sided (``scipy.stats.ttest_rel``, ``scipy.stats.wilcoxon``) on the
    differences rounded to :data:`DIFFERENCE_DECIMALS` decimals, so that differences equal
    but for float rounding are equal. A statistic that is undefined is NaN: both with
    fewer than two pairs, the t-test when every difference is the same (zero variance),
    the Wilcoxon test when every difference is zero.
    """
    finals = final_rows(rows)
    conditions = list(dict.fromkeys(tuple((k, row[k]) for k in condition_keys) for row in finals))
    comparisons = []
    for baseline, variant in pairs:
        for condition in conditions:
            a, b = (_accuracy_by_replicate(finals, name, condition, replicate_keys) for name in (baseline, variant))
            replicates = tuple(sorted(set(a) & set(b)))
            first, second = np.array([a[r] for r in replicates]), np.array([b[r] for r in replicates])
            differences = np.round(second - first, DIFFERENCE_DECIMALS) + 0.0  # + 0.0: no -0.0
            comparisons.append(PairedComparison(baseline, variant, condition, replicates,
                                                tuple(differences.tolist()), *_paired_tests(differences)))
    return comparisons


def _accuracy_by_replicate(finals: Sequence[dict[str, Any]], variant: str, condition: tuple[tuple[str, Any], ...],
                           replicate_keys: Sequence[str]) -> dict[tuple[Any, ...], float]:
    return {tuple(row[k] for k in replicate_keys): row["accuracy"] for row in finals
            if row["variant"] == variant and all(row[k] == v for k, v in condition)}


def _paired_tests(differences: np.ndarray) -> tuple[float, float, float, float]:
    """t, p (paired t-test), W, p (Wilcoxon) of B − A; NaN where undefined (see :func:`paired_comparisons`)."""
    nan = (math.nan, math.nan)
    if len(differences) < 2:
        return nan + nan
    t_result = w_result = nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns about ties and small samples; the values are as computed
        if np.ptp(differences) > 0:  # zero variance: t = ±∞ or 0/0, whatever the float noise said
            t_test = stats.ttest_1samp(differences, 0.0)  # = ttest_rel(B, A)
            t_result = (float(t_test.statistic), float(t_test.pvalue))
        if np.any(differences != 0):
            wilcoxon = stats.wilcoxon(differences)
            w_result = (float(wilcoxon.statistic), float(wilcoxon.pvalue))
    return *t_result, *w_result


def write_reports(sweep: Sweep) -> list[PairedComparison]:
    """Write ``results.csv``, ``summary.md`` and the plots from the finished cells; return the comparisons."""
    sweep.output.mkdir(parents=True, exist_ok=True)
    rows = collect_rows(sweep)
    write_csv(rows, sweep.output / "results.csv")
    in_every_condition = sweep.broadcast(rows)
    comparisons = paired_comparisons(in_every_condition, sweep.paired, sweep.condition_keys, sweep.replicate_keys)
    (sweep.output / "summary.md").write_text(summary_markdown(sweep, rows, comparisons))
    plot_accuracy_vs_round(in_every_condition, sweep.condition_keys, sweep.output / "accuracy_vs_round.png")
    plot_accuracy_vs_epsilon(rows, sweep.condition_keys, sweep.output / "accuracy_vs_epsilon.png")
    return comparisons


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The rows as CSV; columns in first-seen order, missing values empty, ∞ as ``inf``."""
    columns = list(dict.fromkeys(itertools.chain(*(row.keys() for row in rows))))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def _groups(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return groups


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def summary_markdown(sweep: Sweep, rows: Sequence[dict[str, Any]], comparisons: Sequence[PairedComparison]) -> str:
    """The Markdown summary: final accuracy per (variant, condition) and the paired comparisons."""
    finals = final_rows(rows)
    keys = sweep.condition_keys
    lines = [f"# Sweep `{sweep.path.name}`", "",
             f"{len(finals)} of {len(sweep.cells)} cells finished. Final accuracy is the test accuracy after "
             f"the last round, mean ± sample std over {', '.join(sweep.replicate_keys)} (n finished cells); "
             "ε is the accountant's ε after the last round and σ the noise multiplier it ran with (means).", "",
             "| variant | " + " | ".join(keys) + (" | " if keys else "") + "n | final accuracy | ε | σ |",
             "|---|" + "---|" * len(keys) + "---|---|---|---|"]
    for (variant, *values), group in _groups(finals, ["variant", *keys]).items():
        mean, std = _mean_std([r["accuracy"] for r in group])
        epsilon = float(np.mean([r["epsilon"] for r in group]))
        sigma = float(np.mean([r["sigma"] for r in group]))
        cells = [variant, *(_format_value(v) for v in values), str(len(group)), f"{_num(mean)} ± {_num(std)}",
                 format_value(epsilon), _num(sigma if math.isfinite(epsilon) else math.nan)]
        lines.append("| " + " | ".join(cells) + " |")
    if comparisons:
        lines += ["", "## Paired comparisons", "",
                  f"Difference = final accuracy of B − A, paired on {', '.join(sweep.replicate_keys)}: paired "
                  "cells share the data, partition, initial model and client shuffling, and with a fixed "
                  "privacy-seed the cohorts and noise draws. Two-sided "
                  "paired t-test and Wilcoxon signed-rank test (`scipy.stats.ttest_rel`, `scipy.stats.wilcoxon`), "
                  "as measured, not corrected for multiple comparisons; with n pairs the exact two-sided "
                  "Wilcoxon p is at least 2/2ⁿ (0.25 for n = 3). – marks a statistic that is undefined: "
                  "fewer than 2 pairs, for the t-test every difference equal (zero variance), for Wilcoxon "
                  "every difference zero.", "",
                  "| A | B | " + " | ".join(keys) + (" | " if keys else "")
                  + "n | B − A (mean ± std) | t | p (t-test) | W | p (Wilcoxon) |",
                  "|---|---|" + "---|" * len(keys) + "---|---|---|---|---|---|"]
        for c in comparisons:
            cells = [c.baseline, c.variant, *(_format_value(v) for _, v in c.condition), str(len(c.differences)),
                     f"{_num(c.mean, '+.4f')} ± {_num(c.std)}", _num(c.t_statistic, ".3f"), _num(c.t_pvalue, ".3g"),
                     _num(c.wilcoxon_statistic, "g"), _num(c.wilcoxon_pvalue, ".3g")]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "![accuracy vs round](accuracy_vs_round.png)", "", "![final accuracy vs ε](accuracy_vs_epsilon.png)"]
    return "\n".join(lines) + "\n"


def _num(value: float, spec: str = ".4f") -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _float(value: Any) -> Any:
    """``metrics.json`` writes ∞ as "inf" and NaN as null."""
    if value == "inf":
        return math.inf
    return math.nan if value is None else value


def plot_accuracy_vs_round(rows: Sequence[dict[str, Any]], condition_keys: Sequence[str], path: Path) -> None:
    """One panel per condition, one line per variant: mean accuracy over seeds, band = ± std."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    conditions = _groups(rows, condition_keys)
    columns = min(len(conditions), 3) or 1
    lines = -(-max(len(conditions), 1) // columns)
    figure = Figure(figsize=(4.5 * columns, 3.4 * lines), layout="constrained")
    figure.suptitle("test accuracy: mean over seeds, band ± std", fontsize=10)
    axes = figure.subplots(lines, columns, squeeze=False, sharey=True).ravel()
    for axis, (values, group) in zip(axes, conditions.items()):
        for variant, variant_rows in _groups(group, ["variant"]).items():
            by_round = _groups(variant_rows, ["round"])
            rounds = sorted(r for (r,) in by_round)
            mean, std = np.array([_mean_std([row["accuracy"] for row in by_round[(r,)]]) for r in rounds]).T
            axis.plot(rounds, mean, marker=".", label=variant[0])
            axis.fill_between(rounds, mean - np.nan_to_num(std), mean + np.nan_to_num(std), alpha=0.2)
        axis.set_title(", ".join(f"{k}={_format_value(v)}" for k, v in zip(condition_keys, values)) or "all cells",
                       fontsize=9)
        axis.set_xlabel("round")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_ylabel("test accuracy")
        axis.legend(fontsize=7)
    for axis in axes[len(conditions):]:
        axis.set_axis_off()
    figure.savefig(path, dpi=110)


def plot_accuracy_vs_epsilon(rows: Sequence[dict[str, Any]], condition_keys: Sequence[str], path: Path) -> None:
    """Final accuracy against the final ε (means over seeds), error bars = std over seeds.

    One line per variant and per value of the condition keys that do not set ε
    (all but ``target-epsilon`` and ``noise-multiplier``); one point per condition.
    A variant without a DP guarantee (ε = ∞) is a horizontal line, band ± std.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    series_keys = [key for key in condition_keys if key not in PRIVACY_KEYS]

    figure = Figure(figsize=(5.5, 4), layout="constrained")
    axis = figure.subplots()
    finals = [row for row in final_rows(rows) if math.isfinite(row["epsilon"])]
    unbounded = [row for row in final_rows(rows) if not math.isfinite(row["epsilon"])]
    ticks: set[float] = set()
    for index, (series, group) in enumerate(_groups(unbounded, ["variant", *series_keys]).items()):
        mean, std = _mean_std([row["accuracy"] for row in group])
        label = ", ".join([f"{series[0]} (ε = ∞)", *(f"{k}={_format_value(v)}" for k, v in zip(series_keys, series[1:]))])
        axis.axhline(mean, linestyle=("--", ":", "-.")[index % 3], linewidth=1, color="0.2", label=label)
        axis.axhspan(mean - np.nan_to_num(std), mean + np.nan_to_num(std), color="0.2", alpha=0.08)
    for series, group in _groups(finals, ["variant", *series_keys]).items():
        points = []
        for condition in _groups(group, condition_keys).values():
            mean, std = _mean_std([row["accuracy"] for row in condition])
            points.append((float(np.mean([row["epsilon"] for row in condition])), mean, std))
        x, y, error = np.array(sorted(points)).T
        ticks.update(round(float(value), 2) for value in x)
        label = ", ".join([series[0], *(f"{k}={_format_value(v)}" for k, v in zip(series_keys, series[1:]))])
        axis.errorbar(x, y, yerr=np.nan_to_num(error), marker="o", capsize=3, label=label)
    if finals or unbounded:
        axis.legend(fontsize=7)
    if finals:
        axis.set_xscale("log")
        axis.set_xticks(sorted(ticks))
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(NullFormatter())
    else:
        axis.text(0.5, 0.5, "no finished cell with a finite ε", ha="center", transform=axis.transAxes)
    axis.set_xlabel("ε (client-level, after the last round)")
    axis.set_ylabel("final test accuracy (mean ± std over seeds)")
    figure.savefig(path, dpi=110)


# --- command -------------------------------------------------------------------
def sweep_command(path: str | Path, output: str | Path | None = None, list_only: bool = False,
                  threads: int = 1) -> int:
    """``fedhog sweep``: run (or list) the cells of a sweep file and write its reports; an exit status."""
    try:
        sweep = load_sweep(path, output)
        if list_only:
            for cell in sweep.cells:
                console.print(f"{'finished' if is_finished(cell) else 'to run  '}  {escape(cell.cell_id)}")
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
