"""The live progress display of a run: round, accuracy and ε, read from ``metrics.json``."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .alarms import alarms

console = Console(stderr=True, soft_wrap=True)  # messages stay one line each: the terminal wraps them
STAGE_LOGGER = "fedhog.stage"  # what a run in this process is doing before its first round (data, discovery)


class _LastStage(logging.Handler):
    """Keeps the last message of :data:`STAGE_LOGGER`."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.text = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.text = record.getMessage()


@contextmanager
def _stages() -> Iterator[_LastStage]:
    """Listen to :data:`STAGE_LOGGER` (INFO, not passed on to other handlers) inside the block."""
    logger, handler = logging.getLogger(STAGE_LOGGER), _LastStage()
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def watch_metrics(directory: Path, rounds: int, running: Callable[[], bool]) -> None:
    """Show round, accuracy (AUROC, AUPRC when measured) and ε from ``metrics.json`` while ``running()``.

    Before the first round it shows what the run says it is doing (generating or
    partitioning data, discovering clients: :data:`STAGE_LOGGER` in this process,
    ``stage`` in ``metrics.json`` from a ServerApp in another).
    """
    if not console.is_terminal:  # a log file or a pipe: no live display to redraw
        _print_rounds(directory, rounds, running)
        return
    columns = (TextColumn("[bold]round"), MofNCompleteColumn(), BarColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    with _stages() as stage, Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("training", total=rounds, status="starting…")
        while True:
            alive = running()
            document = read_metrics_file(directory / "metrics.json")
            if document and document.get("rounds"):
                last = document["rounds"][-1]
                progress.update(task, completed=last.get("round", 0), status=round_status(last))
            elif stage.text or (document or {}).get("stage"):  # this process's, or the ServerApp's (metrics.json)
                progress.update(task, status=escape(stage.text or (document or {})["stage"]))
            if not alive:
                break
            time.sleep(0.5)


def _print_rounds(directory: Path, rounds: int, running: Callable[[], bool]) -> None:
    """:func:`watch_metrics` for a console that is not a terminal: one plain line per start-up stage and per round
    (a resumed run's kept rounds are not repeated)."""
    printed: int | None = None
    last_stage = ""
    with _stages() as stage:
        while True:
            alive = running()
            document = read_metrics_file(directory / "metrics.json") or {}
            records = document.get("rounds") or []
            if printed is None and records:  # the rounds a resumed run keeps were shown by the run that made them
                printed = sum(1 for r in records if r.get("round", 0) <= (document.get("resumed_after_round") or 0))
            now = stage.text or document.get("stage") or ""
            if not records and now and now != last_stage:
                console.print(escape(now), highlight=False)
                last_stage = now
            if printed is not None:
                for record in records[printed:]:
                    console.print(f"round {record.get('round')}/{rounds}  {round_status(record)}", highlight=False)
                printed = max(printed, len(records))
            if not alive:
                break
            time.sleep(0.5)


def round_status(record: dict) -> str:
    """``accuracy 0.912  AUPRC 0.433  ε 1.2`` for one round of ``metrics.json`` (AUROC/AUPRC when measured),
    then the first of the round's :func:`fedhog.alarms.alarms` (saturated layers; not the noise notes,
    which healthy runs under DP have as well)."""
    ranking = "".join(f"  {name.upper()} {format_value(record[name])}" for name in ("auroc", "auprc")
                      if record.get(name) is not None)
    warnings = alarms(record.get("layers") or {})
    warning = f"  [yellow]⚠ {escape(warnings[0])}{f' (+{len(warnings) - 1} more)' if len(warnings) > 1 else ''}[/]" \
        if warnings else ""
    return f"accuracy {format_value(record.get('accuracy'))}{ranking}  ε {format_value(record.get('epsilon'))}{warning}"


def read_metrics_file(path: Path) -> dict | None:
    """``metrics.json`` as a dict, or None while it does not exist or is being replaced."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def format_value(value: object) -> str:
    """A metric for display: ∞ for inf, – for missing, 3 decimals for floats."""
    if value is None:
        return "–"
    if value == "inf" or (isinstance(value, float) and math.isinf(value)):
        return "∞"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
