"""The results folder: written as the run goes, so a crash keeps what was done, and never overwritten silently."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import NO_TARGET_EPSILON, ConfigError, RunConfig, load_config, read_toml, toml_value
from .files import atomic_write, restored_floats, standard_json
from .interrupts import deferred

if TYPE_CHECKING:
    from flwr.app import ArrayRecord

# What a run (and ``fedhog export``) writes into its folder: what ``--overwrite`` removes, nothing else.
RUN_FILES = ("config.toml", "metrics.json", "rounds.jsonl", "metrics.prom", "checkpoint.pt", "checkpoint.prev.pt",
             "final_model.pt", "flwr.log", "logs", "model.torchscript.pt", "model.state_dict.pt", ".stop-requested")
STOP_REQUEST = ".stop-requested"  # written by a launcher that is about to stop the run's processes
ROUND_LOG = "rounds.jsonl"  # one line a finished round, appended as it finishes: what --resume reads back
FLUSH_SECONDS = 1.0  # metrics.json is rewritten at most this often while rounds go by (and at every status change)


def request_stop(directory: Path) -> None:
    """Tell the ServerApp writing into ``directory`` to keep no further round: its clients are about to be stopped."""
    if directory.is_dir():
        (directory / STOP_REQUEST).touch()


def stop_requested(directory: Path) -> bool:
    """Whether the run's launcher has asked it to stop (see :func:`request_stop`)."""
    return (directory / STOP_REQUEST).exists()


def clear_stop_request(directory: Path) -> None:
    """Forget a stop request (a new run or a resume starts)."""
    (directory / STOP_REQUEST).unlink(missing_ok=True)


def default_results_dir(base: Path | None = None) -> Path:
    """``results/<timestamp>/`` under ``base`` (the working directory by default)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = (base or Path.cwd()) / "results"
    path = root / stamp
    suffix = 1
    while path.exists():
        path, suffix = root / f"{stamp}-{suffix}", suffix + 1
    return path.resolve()


def read_run_document(directory: Path) -> dict[str, Any] | None:
    """The ``metrics.json`` of the fedhog run in ``directory``, or None when it holds none (or not fedhog's)."""
    try:
        document = json.loads((directory / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    return document if isinstance(document, dict) and "status" in document else None


def describe_run(document: dict[str, Any], status: bool = True) -> str:
    """``finished, 10 of 10 rounds`` (``status`` first) for a run's ``metrics.json``."""
    planned = document.get("config", {}).get("rounds")
    done = len(document.get("rounds", []))
    text = f"{done}" + (f" of {planned}" if planned else "") + " rounds"
    if document.get("summary", {}).get("stopped_by_budget"):
        text += ", stopped by max-epsilon"
    return f"{document.get('status')}, {text}" if status else text


def claim_results_dir(directory: Path, overwrite: bool = False) -> Path:
    """Create ``directory`` for a new run and return it, absolute; refuse what would lose or mix files.

    A folder that holds a fedhog run is refused (``overwrite`` removes that run's
    files, :data:`RUN_FILES`, and nothing else); a folder with other files is
    refused; a path below a file, or one that cannot be created, is refused.
    Every refusal is a one-line :class:`~fedhog.config.ConfigError` that names
    ``results-dir`` and says what to do.
    """
    directory = directory.expanduser().absolute()
    shown = f"results-dir={toml_value(str(directory))}"
    for parent in [directory, *directory.parents]:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{shown} is not allowed: {parent} is a file, not a folder")
    if directory.is_dir():
        document = read_run_document(directory)
        if document is not None or (directory / "checkpoint.pt").exists():
            if not overwrite:
                what = describe_run(document) if document else "a checkpoint"
                resume = (f", --resume {directory} continues it" if (document or {}).get("status") != "finished"
                          else "")
                raise ConfigError(f"{shown} already holds a run ({what}); fedhog does not overwrite it: "
                                  f"--set results-dir='\"\"' writes a new results/<timestamp> folder{resume}, "
                                  "--overwrite replaces it")
            for name in RUN_FILES:
                path = directory / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
        elif any(directory.iterdir()):
            names = sorted(p.name for p in directory.iterdir())
            listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise ConfigError(f"{shown} is a folder with other files ({listed}) and no fedhog run; "
                              "give a new or empty folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):  # a file can be created there
            pass
    except OSError as error:
        raise ConfigError(f"{shown} cannot be written: {error.strerror or error}") from None
    return directory


def record_launch(directory: Path, launch: dict[str, Any], config: RunConfig | None = None) -> None:
    """Record how the run in ``directory`` was started (``metrics.json``'s ``launch``), so a resume repeats it.

    A new run's ``metrics.json`` starts as ``{"status": "starting", "launch": ...}``
    and, given ``config``, its ``config.toml`` is written too, so that even a run
    that fails before its ServerApp starts can be resumed; :class:`ResultsWriter`
    keeps the entry when the ServerApp takes the folder over.
    """
    document = read_run_document(directory) or {"status": "starting"}
    document["launch"] = launch
    if config is not None:
        atomic_write(directory / "config.toml", config_to_toml(config).encode())
    atomic_write(directory / "metrics.json", standard_json(document, indent=2).encode())


def mark_interrupted(directory: Path) -> None:
    """Set ``metrics.json``'s status to ``interrupted`` unless the run there finished or failed."""
    document = read_run_document(directory)
    if document is not None and document.get("status") in ("starting", "running"):
        document["status"] = "interrupted"
        atomic_write(directory / "metrics.json", standard_json(document, indent=2).encode())


def mark_failed(directory: Path, reason: str) -> None:
    """Set ``metrics.json``'s status to ``failed`` with ``reason`` unless the run there finished or says why it
    stopped (a failure the ServerApp recorded keeps its own reason)."""
    document = read_run_document(directory)
    if document is not None and document.get("status") in ("starting", "running"):
        document.update(status="failed", error=reason)
        atomic_write(directory / "metrics.json", standard_json(document, indent=2).encode())


def config_to_toml(config: RunConfig) -> str:
    """The resolved config as a flat TOML document that :func:`load_config` reads back."""
    lines = ["# fedhog run config, as resolved for this run"]
    for key, value in config.to_mapping().items():
        if key == "noise-multiplier" and config.target_epsilon > 0:
            lines.append("# noise-multiplier is calibrated to target-epsilon at the start of the run")
            continue
        lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def load_run_config(directory: Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """The ``config.toml`` of the results folder ``directory`` (with ``overrides``), validated.

    A folder written before ``target-epsilon = -1`` meant "no calibration" says
    ``target-epsilon = 0.0`` for it, which a config given now is refused for: read as it was meant.
    """
    path = directory / "config.toml"
    legacy = {"target-epsilon": NO_TARGET_EPSILON} if read_toml(path).get("target-epsilon") == 0 else {}
    return load_config(path, {**legacy, **(overrides or {})})


WITHHELD = "withheld"  # what metrics.json says of a fixed privacy-seed


def published_config(config: RunConfig) -> dict[str, Any]:
    """The config as ``metrics.json`` shows it: a fixed ``privacy-seed`` withheld (``config.toml``, which
    ``--resume`` needs, keeps it: that file is the run's private input, not a result to publish)."""
    mapping = config.to_mapping()
    if config.privacy_seed >= 0:
        mapping["privacy-seed"] = WITHHELD
    return mapping


class ResultsWriter:
    """Writes ``config.toml``, ``metrics.json``, ``rounds.jsonl`` and ``final_model.pt`` into one folder.

    Each finished round is appended to ``rounds.jsonl`` (one JSON line, its
    floats exact) at once; ``metrics.json``, the whole document, is rewritten
    when a round finishes at least :data:`FLUSH_SECONDS` after the last
    rewrite, and whenever a top-level field changes (status, summary...), so a
    round costs one short append however long the run. A ``launch`` entry
    already in ``metrics.json`` (:func:`record_launch`) is kept; ``rounds``
    are the records of the rounds a resumed run keeps.
    """

    def __init__(self, directory: Path, config: RunConfig, rounds: list[dict[str, Any]] | None = None) -> None:
        self.directory = directory.resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        launch = (read_run_document(self.directory) or {}).get("launch")
        self.document: dict[str, Any] = {
            "status": "running",
            **({"launch": launch} if launch is not None else {}),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": published_config(config),
            "rounds": list(rounds or []),
        }
        atomic_write(self.directory / "config.toml", config_to_toml(config).encode())
        atomic_write(self.directory / ROUND_LOG, "".join(_log_line(row) for row in self.document["rounds"]).encode())
        self._flushed_at = -math.inf
        self._flush()

    @property
    def metrics_path(self) -> Path:
        """Where the per-round metrics are."""
        return self.directory / "metrics.json"

    @property
    def rounds_logged(self) -> int:
        """How many rounds ``rounds.jsonl`` holds."""
        return len(self.document["rounds"])

    def add_round(self, record: Any) -> bool:
        """Append one round (a dataclass) to ``rounds.jsonl`` and the document; True if ``metrics.json`` was
        rewritten with it (always where it showed a start-up ``stage``, which the round ends)."""
        row = dataclasses.asdict(record)
        with deferred(), open(self.directory / ROUND_LOG, "a", encoding="utf-8") as log:
            log.write(_log_line(row))
            log.flush()
            os.fsync(log.fileno())
        staged = self.document.pop("stage", None) is not None  # a display showing the start-up switches to rounds
        self.document["rounds"].append(row)
        if not staged and time.monotonic() - self._flushed_at < FLUSH_SECONDS:
            return False
        self._flush()
        return True

    def update(self, **fields: Any) -> None:
        """Set top-level fields (summary, status, ...) and rewrite ``metrics.json``."""
        self.document.update(fields)
        self._flush()

    def save_model(self, arrays: ArrayRecord, name: str = "final_model.pt") -> Path:
        """Save the model's state dict (loadable with ``torch.load``)."""
        import torch  # the ServerApp has it loaded; the CLI reads results without it

        buffer = io.BytesIO()
        torch.save(arrays.to_torch_state_dict(), buffer)
        path = self.directory / name
        atomic_write(path, buffer.getvalue())
        return path

    def _flush(self) -> None:
        text = standard_json(self.document, indent=2)
        atomic_write(self.metrics_path, text.encode())
        self._flushed_at = time.monotonic()


def _log_line(row: dict[str, Any]) -> str:
    """One round as a line of ``rounds.jsonl``: standard JSON, NaN as null and ∞ as "inf" as in ``metrics.json``
    (:func:`read_round_log` reads them back as the floats they were)."""
    return standard_json(row, separators=(",", ":")) + "\n"


def read_round_log(directory: Path, count: int) -> list[dict[str, Any]]:
    """The first ``count`` rounds of ``rounds.jsonl`` in ``directory``.

    Raises
    ------
    ValueError
        If the log is missing or holds fewer than ``count`` whole lines.
    """
    path = directory / ROUND_LOG
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)[:count]
    except OSError as error:
        raise ValueError(f"{path} cannot be read: {error}") from None
    whole = [line for line in lines if line.endswith("\n")]
    if len(whole) < count:
        raise ValueError(f"{path} holds {len(whole)} whole rounds, {count} expected")
    return [restored_floats(json.loads(line)) for line in whole]
