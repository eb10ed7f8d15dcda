"""The results folder: written as the run goes, so a crash keeps what was done."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from .config import RunConfig, toml_value


def default_results_dir(base: Path | None = None) -> Path:
    """``results/<timestamp>/`` under ``base`` (the working directory by default)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = (base or Path.cwd()) / "results"
    path = root / stamp
    suffix = 1
    while path.exists():
        path, suffix = root / f"{stamp}-{suffix}", suffix + 1
    return path.resolve()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the new one, never half."""
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


def config_to_toml(config: RunConfig) -> str:
    """The resolved config as a flat TOML document that :func:`load_config` reads back."""
    lines = ["# fedhog run config, as resolved for this run"]
    for key, value in config.to_mapping().items():
        if key == "noise-multiplier" and config.target_epsilon > 0:
            lines.append("# noise-multiplier is calibrated to target-epsilon at the start of the run")
            continue
        lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    """JSON has no ∞ or NaN: write them as strings "inf" / null."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


class ResultsWriter:
    """Writes ``config.toml``, ``metrics.json`` and ``final_model.pt`` into one folder."""

    def __init__(self, directory: Path, config: RunConfig) -> None:
        self.directory = directory.resolve()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.document: dict[str, Any] = {
            "status": "running",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config.to_mapping(),
            "rounds": [],
        }
        atomic_write(self.directory / "config.toml", config_to_toml(config).encode())
        self._flush()

    @property
    def metrics_path(self) -> Path:
        """Where the per-round metrics are."""
        return self.directory / "metrics.json"

    def add_round(self, record: Any) -> None:
        """Append one round (a dataclass) and rewrite ``metrics.json``."""
        self.document["rounds"].append(dataclasses.asdict(record))
        self._flush()

    def update(self, **fields: Any) -> None:
        """Set top-level fields (summary, status, ...) and rewrite ``metrics.json``."""
        self.document.update(fields)
        self._flush()

    def save_model(self, arrays: ArrayRecord, name: str = "final_model.pt") -> Path:
        """Save the model's state dict (loadable with ``torch.load``)."""
        buffer = io.BytesIO()
        torch.save(arrays.to_torch_state_dict(), buffer)
        path = self.directory / name
        atomic_write(path, buffer.getvalue())
        return path

    def _flush(self) -> None:
        text = json.dumps(_json_safe(self.document), indent=2)
        atomic_write(self.metrics_path, text.encode())
