"""Small file helpers on the bottom floor: atomic writes, standard JSON (no bare ∞/NaN), fedhog's cache folder.

Importing nothing of fedhog but :mod:`fedhog.interrupts`, these serve every
floor above (results, checkpoints, monitoring, client state) without an
upward arrow.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from .interrupts import deferred


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half.

    Ctrl-C or SIGTERM (see :mod:`fedhog.interrupts`) waits until the write is done, so no temporary file is left.
    """
    with deferred():
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(handle, "wb") as stream:
                stream.write(data)
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def json_safe(value: Any) -> Any:
    """JSON has no ∞ or NaN: write them as strings "inf" / null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


def standard_json(value: Any, **options: Any) -> str:
    """``value`` as standard JSON (RFC 8259 has no NaN or ∞, and Python's own ``NaN``/``Infinity`` tokens are
    not JSON): through :func:`json_safe`, the one convention of ``metrics.json`` and ``rounds.jsonl``."""
    return json.dumps(json_safe(value), allow_nan=False, **options)


def restored_floats(value: Any) -> Any:
    """:func:`json_safe`'s inverse, for records that hold no null of their own (a round's): null -> NaN,
    "inf" / "-inf" -> ±∞."""
    if value is None:
        return math.nan
    if value in ("inf", "-inf"):
        return math.inf if value == "inf" else -math.inf
    if isinstance(value, dict):
        return {k: restored_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [restored_floats(v) for v in value]
    return value


def cache_dir() -> Path:
    """fedhog's cache folder (generated datasets, client state): ``$FEDHOG_CACHE``, else ``~/.cache/fedhog``."""
    return Path(os.environ.get("FEDHOG_CACHE") or Path.home() / ".cache" / "fedhog")
