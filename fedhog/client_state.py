"""A DP-SGD client's record-level accountant, kept on the client's own disk.

The record-level ε is spent where the records are, so its history lives there
too: one JSON file per training job and partition,
``<state dir>/<job-id>/partition-<id>.json``, holding Opacus's accountant state
(``{"mechanism": ..., "history": [[σ, q, steps], ...]}``; q = batch/N implies
the client's record count, which therefore stays on the client). The job id is
the server's name for the training job, the same across ``--resume``, so the
accountant survives a resumed run and a restarted SuperNode or ClientApp
process alike; a new job starts a new accountant (ε is reported per job).

The state is read when a DP-SGD train message arrives and written, atomically,
after training and before the reply. A client stopped after that write but
before the server checkpointed the round counts the round again when the run
resumes: correct, because it did release an update.

The state dir is the SuperNode's node config ``state-dir`` if it has one, else
``$FEDHOG_CACHE/client-state`` (default ``~/.cache/fedhog/client-state``). It
also holds the node's release ledger (:mod:`fedhog.secure_aggregation.ledger`)
and a cache of the σ calibrated for the runs it served (:func:`cached_calibration`:
public values, recomputed when missing).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .files import atomic_write, cache_dir

STATE_DIR_KEY = "state-dir"  # node config key
_JOB_ID = re.compile(r"[0-9a-f]{32}")  # the server's uuid4().hex: no path separators, no dots


def state_dir(node_config: Mapping[str, Any]) -> Path:
    """Where this node keeps its state: node config ``state-dir``, else ``$FEDHOG_CACHE/client-state``.

    Raises
    ------
    ValueError
        If ``state-dir`` is set but is not a non-empty string.
    """
    if STATE_DIR_KEY not in node_config:
        return cache_dir() / "client-state"
    value = node_config[STATE_DIR_KEY]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"node config {STATE_DIR_KEY}={value!r} is not allowed; expected a directory path")
    return Path(value).expanduser()


def accountant_path(directory: Path, job_id: object, partition_id: int) -> Path:
    """``<directory>/<job-id>/partition-<id>.json`` for a job id that cannot leave ``directory``.

    Raises
    ------
    ValueError
        If ``job_id`` is not 32 lowercase hex characters or ``partition_id`` is not an integer ≥ 0.
    """
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ValueError(f"job-id={job_id!r} is not allowed; expected 32 lowercase hex characters "
                         "(the server's name for the training job)")
    if isinstance(partition_id, bool) or not isinstance(partition_id, int) or partition_id < 0:
        raise ValueError(f"partition-id={partition_id!r} is not allowed; expected an integer ≥ 0")
    return directory / job_id / f"partition-{partition_id}.json"


def load_accountant_state(path: Path) -> dict[str, Any] | None:
    """The accountant state saved at ``path``, or None before the client's first DP-SGD round of the job.

    Raises
    ------
    ValueError
        If the file is not JSON (its contents are checked by :func:`fedhog.dpsgd.train_dpsgd`).
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as error:
        raise ValueError(f"the DP-SGD accountant state {path} is not valid JSON ({error}); "
                         "it holds this client's spent ε: restore it rather than delete it") from None


def save_accountant_state(path: Path, state: Mapping[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically (readers see the old state or the new one); directories are private."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(path, json.dumps(state).encode("utf-8"))


CALIBRATIONS = "calibrations.json"


def cached_calibration(directory: Path, key: str, compute: Callable[[], float]) -> float:
    """``compute()`` (a σ calibrated from public config described by ``key``), kept in ``<directory>/calibrations.json``
    so that a node calibrates each run once, not once per ClientApp process (PLD calibration takes seconds).

    An unreadable cache is recomputed and rewritten: it holds nothing that cannot be computed again.
    """
    path = directory / CALIBRATIONS
    try:
        cache = json.loads(path.read_text(encoding="utf-8"))
        value = cache[key] if isinstance(cache, dict) else None
    except (OSError, ValueError, KeyError):
        cache, value = {}, None
    if isinstance(value, float):
        return value
    value = float(compute())
    cache = {**(cache if isinstance(cache, dict) else {}), key: value}
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    atomic_write(path, json.dumps(dict(list(cache.items())[-256:])).encode("utf-8"))
    return value
