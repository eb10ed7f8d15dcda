"""Per-round checkpoints: everything a killed run needs to continue as if it never stopped."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .files import atomic_write
from .interrupts import deferred
from .results import read_round_log

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated or not fedhog's."""


@dataclass
class Checkpoint:
    """The state after a finished round.

    It holds no randomness: with OS entropy a resumed run draws fresh keys,
    with a fixed privacy seed every round's streams follow from (seed, round).

    Parameters
    ----------
    round : int
        The last finished round.
    model : dict
        The global model's state dict after that round.
    accountant : dict
        :meth:`ClientLevelAccountant.state_dict` (the releases so far).
    rounds : list
        The per-round records not yet in ``rounds.jsonl`` when the checkpoint
        was written (the round's own; every round in checkpoints before
        ``rounds_logged`` existed).
    adaptive_clipping : dict, optional
        :meth:`AdaptiveClipping.state_dict` (the current clipping norm), when on.
    job_id : str
        The training job's name, the same across resumes (DP-SGD clients keep
        their record-level accountants under it).
    server_optimizer : dict, optional
        :meth:`ServerOptimizer.state_dict` (momenta: functions of the releases).
    rounds_logged : int
        How many rounds ``rounds.jsonl`` held before ``rounds``.
    """

    round: int
    model: dict[str, torch.Tensor]
    accountant: dict[str, Any]
    rounds: list[dict[str, Any]]
    adaptive_clipping: dict[str, Any] | None = None
    job_id: str = ""
    server_optimizer: dict[str, Any] | None = None
    rounds_logged: int = 0


def save_checkpoint(directory: Path, checkpoint: Checkpoint) -> Path:
    """Write ``checkpoint.pt`` atomically; the one before it is kept as ``checkpoint.prev.pt``.

    ``checkpoint.pt`` is never moved away: the previous one is linked (or
    copied) to ``checkpoint.prev.pt`` through a temporary name, then the new
    one replaces ``checkpoint.pt`` in one ``os.replace``. Killed at any moment,
    the folder holds a whole ``checkpoint.pt`` of the last round it finished
    writing, or of the round before.
    """
    buffer = io.BytesIO()
    torch.save({f.name: getattr(checkpoint, f.name) for f in fields(checkpoint)}, buffer)  # asdict would copy it all
    path = directory / CHECKPOINT
    if path.exists():
        _keep_previous(path, directory / PREVIOUS)
    atomic_write(path, buffer.getvalue())
    return path


def _keep_previous(path: Path, previous: Path) -> None:
    """Make ``previous`` a copy of ``path`` (a hard link where the file system allows), atomically."""
    with deferred():  # an interrupt waits: no temporary file is left behind
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{previous.name}.")
        os.close(handle)
        try:
            os.unlink(temporary)
            try:
                os.link(path, temporary)
            except OSError:  # no hard links here: copy the bytes
                shutil.copyfile(path, temporary)
            os.replace(temporary, previous)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def checkpointed_rounds(directory: Path, checkpoint: Checkpoint) -> list[dict[str, Any]]:
    """Every round's record up to the checkpoint's: the round log's first ``rounds_logged``, then its own.

    Raises
    ------
    CheckpointError
        If ``rounds.jsonl`` lost rounds the checkpoint counts on.
    """
    if not checkpoint.rounds_logged:
        return list(checkpoint.rounds)
    try:
        return read_round_log(directory, checkpoint.rounds_logged) + list(checkpoint.rounds)
    except ValueError as error:
        raise CheckpointError(f"cannot resume round {checkpoint.round + 1}: {error}") from None


def load_checkpoint(directory: Path) -> Checkpoint:
    """Read ``checkpoint.pt``; a damaged file raises :class:`CheckpointError` and nothing is removed."""
    path = directory / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(f"cannot resume: no {CHECKPOINT} in {directory}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        checkpoint = Checkpoint(**state)
        if not isinstance(checkpoint.round, int) or checkpoint.round < 1:
            raise ValueError(f"round={checkpoint.round!r}")
    except Exception as error:  # pylint: disable=broad-except  # any damage reads as one clear error
        previous = directory / PREVIOUS
        hint = (f"; the previous checkpoint is kept at {previous}: move it to {path} to resume from it"
                if previous.is_file() else "")
        reason = (str(error).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path} is corrupt or truncated ({type(error).__name__}: {reason}){hint}") from None
    return checkpoint
